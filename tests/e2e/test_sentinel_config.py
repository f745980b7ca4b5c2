"""A Sentinel URL that cannot work stops every role at once: non-zero, saying what to change, and before
the role creates anything on Kafka."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from tests.support.sentinels import MASTER, SentinelCluster

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(90)]

EXIT_TIMEOUT_S = 15.0
FORM = "redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/DB]"


@pytest.fixture(scope="module")
def lone_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelCluster]:
    """A primary watched by one Sentinel: enough to ask it for a master it does not know."""
    servers = SentinelCluster(Path(tmp_path_factory.mktemp("sentinel")), replicas=0, sentinels=1)
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()


def run_role(role: str, redis_url: str, kafka_bootstrap: str, namespace: str, tmp_path: Path) -> tuple[int, str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWIRE_")}
    env.update(
        BATCHWIRE_KAFKA_BOOTSTRAP=kafka_bootstrap,
        BATCHWIRE_REDIS_URL=redis_url,
        BATCHWIRE_NAMESPACE=namespace,
        BATCHWIRE_STACK_ENV=str(tmp_path / "no-stack.env"),
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "batchwire.cli", role],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=EXIT_TIMEOUT_S,
        check=False,
    )
    return done.returncode, done.stderr + done.stdout, time.monotonic() - started


def topics_of(kafka_bootstrap: str, namespace: str) -> list[str]:
    async def listed() -> list[str]:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            return [topic for topic in await admin.list_topics() if namespace in topic]
        finally:
            await admin.close()

    return asyncio.run(listed())


def assert_stopped_cleanly(code: int, output: str, elapsed_s: float, *expected: str) -> None:
    assert code == 2, f"expected exit 2 (a settings error), got {code}:\n{output}"
    for text in expected:
        assert text in output, f"expected {text!r} in the output:\n{output}"
    assert "Traceback" not in output, output
    assert elapsed_s < 10, f"took {elapsed_s:.1f} s to stop"


@pytest.mark.parametrize("role", ["gateway", "batcher", "worker"])
def test_a_sentinel_url_that_points_nowhere(role: str, tmp_path: Path, infra: Any) -> None:
    namespace = f"s{uuid.uuid4().hex[:8]}"
    url = "redis+sentinel://127.0.0.1:1,127.0.0.1:2/batchwire"
    code, output, elapsed_s = run_role(role, url, infra.kafka_bootstrap, namespace, tmp_path)
    assert_stopped_cleanly(
        code,
        output,
        elapsed_s,
        "no Sentinel answered at 127.0.0.1:1,127.0.0.1:2: check --redis-url / BATCHWIRE_REDIS_URL",
    )
    assert topics_of(infra.kafka_bootstrap, namespace) == [], "nothing is created before Redis is found"


def test_a_master_the_sentinels_do_not_know(lone_sentinel: SentinelCluster, tmp_path: Path, infra: Any) -> None:
    namespace = f"s{uuid.uuid4().hex[:8]}"
    url = lone_sentinel.url.replace(f"/{MASTER}/", "/nosuch/")
    code, output, elapsed_s = run_role("gateway", url, infra.kafka_bootstrap, namespace, tmp_path)
    where = f"127.0.0.1:{lone_sentinel.sentinel_ports[0]}"
    assert_stopped_cleanly(
        code, output, elapsed_s, f"Sentinels at {where} know no master named 'nosuch'; they know: '{MASTER}'"
    )
    assert topics_of(infra.kafka_bootstrap, namespace) == []


@pytest.mark.parametrize(
    ("url", "wrong"),
    [
        ("redis+sentinel://127.0.0.1:26379", "no master name after the Sentinel addresses"),
        ("redis+sentinel://127.0.0.1:x/batchwire", "the port in Sentinel address '127.0.0.1:x'"),
        ("sentinel://127.0.0.1:26379/batchwire", "the scheme must be one of"),
    ],
)
def test_a_malformed_sentinel_url(url: str, wrong: str, tmp_path: Path, infra: Any) -> None:
    namespace = f"s{uuid.uuid4().hex[:8]}"
    code, output, elapsed_s = run_role("gateway", url, infra.kafka_bootstrap, namespace, tmp_path)
    assert_stopped_cleanly(code, output, elapsed_s, wrong, FORM)
    assert topics_of(infra.kafka_bootstrap, namespace) == []
