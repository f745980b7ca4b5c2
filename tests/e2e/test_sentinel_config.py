"""A Sentinel URL that cannot work stops every role at once: non-zero, saying what to change, and before
the role creates anything on Kafka."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.role_start import assert_stopped_cleanly, run_role, topics_of
from tests.support.sentinels import MASTER, SentinelCluster

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(90)]

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
