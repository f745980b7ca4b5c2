"""A replication factor larger than the brokers stops every role that creates topics at start: exit 2,
a message naming both numbers and the flag, and no topic created (on the session's one broker)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support.role_start import assert_stopped_cleanly, run_role, topics_of

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(90)]


@pytest.mark.parametrize("role", ["gateway", "batcher", "worker"])
def test_a_replication_factor_larger_than_the_brokers_stops_the_role_and_creates_nothing(
    role: str, tmp_path: Path, infra: Any
) -> None:
    namespace = f"t{uuid.uuid4().hex[:10]}"

    flags = ("--replication-factor", "2")
    code, output, elapsed_s = run_role(role, infra.redis_url, infra.kafka_bootstrap, namespace, tmp_path, flags=flags)

    assert_stopped_cleanly(
        code, output, elapsed_s, "replication factor 2 is larger than the 1 broker(s)", "--replication-factor"
    )
    assert topics_of(infra.kafka_bootstrap, namespace) == [], "a refused start created topics"


def test_a_min_insync_replicas_above_the_replication_factor_stops_the_role(tmp_path: Path, infra: Any) -> None:
    namespace = f"t{uuid.uuid4().hex[:10]}"

    flags = ("--min-insync-replicas", "2")
    code, output, elapsed_s = run_role(
        "batcher", infra.redis_url, infra.kafka_bootstrap, namespace, tmp_path, flags=flags
    )

    assert_stopped_cleanly(code, output, elapsed_s, "min.insync.replicas 2 is larger than the replication factor 1")
    assert topics_of(infra.kafka_bootstrap, namespace) == []
