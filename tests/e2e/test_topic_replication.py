"""A replication factor larger than the brokers stops every role that creates topics at start: exit 2,
a message naming both numbers and the flag, and no topic created (on the session's one broker)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient  # type: ignore[import-untyped, unused-ignore]

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(90)]

EXIT_TIMEOUT_S = 20.0


def run_role(role: str, infra: Any, namespace: str, tmp_path: Path, *flags: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWIRE_")}
    env.update(
        BATCHWIRE_KAFKA_BOOTSTRAP=infra.kafka_bootstrap,
        BATCHWIRE_REDIS_URL=infra.redis_url,
        BATCHWIRE_NAMESPACE=namespace,
        BATCHWIRE_STACK_ENV=str(tmp_path / "no-stack.env"),
    )
    done = subprocess.run(
        [sys.executable, "-m", "batchwire.cli", role, *flags],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=EXIT_TIMEOUT_S,
        check=False,
    )
    return done.returncode, done.stderr + done.stdout


def topics_of(kafka_bootstrap: str, namespace: str) -> list[str]:
    async def listed() -> list[str]:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            return [topic for topic in await admin.list_topics() if topic.startswith(namespace + ".")]
        finally:
            await admin.close()

    return asyncio.run(listed())


@pytest.mark.parametrize("role", ["gateway", "batcher", "worker"])
def test_a_replication_factor_larger_than_the_brokers_stops_the_role_and_creates_nothing(
    role: str, tmp_path: Path, infra: Any
) -> None:
    namespace = f"t{uuid.uuid4().hex[:10]}"

    code, output = run_role(role, infra, namespace, tmp_path, "--replication-factor", "2")

    assert code == 2, f"expected exit 2 (a settings error), got {code}:\n{output}"
    for text in ("replication factor 2 is larger than the 1 broker(s)", "--replication-factor"):
        assert text in output, f"expected {text!r} in the output:\n{output}"
    assert "Traceback" not in output, output
    assert topics_of(infra.kafka_bootstrap, namespace) == [], "a refused start created topics"


def test_a_min_insync_replicas_above_the_replication_factor_stops_the_role(tmp_path: Path, infra: Any) -> None:
    namespace = f"t{uuid.uuid4().hex[:10]}"

    code, output = run_role("batcher", infra, namespace, tmp_path, "--min-insync-replicas", "2")

    assert code == 2, f"expected exit 2, got {code}:\n{output}"
    assert "min.insync.replicas 2 is larger than the replication factor 1" in output, output
    assert topics_of(infra.kafka_bootstrap, namespace) == []
