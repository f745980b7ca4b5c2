"""A Redis or Kafka address where nothing answers, or a setting the broker refuses, stops every role at
once: exit 2 with one line that names the address or the setting to check, and no traceback (nothing is
created on Kafka before Redis answers)."""

from __future__ import annotations

import random
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from infra.topics import BOOTSTRAP_TIMEOUT_S, BOOTSTRAP_WAIT, ensure_topics
from tests.support.role_start import assert_stopped_cleanly, run_role, topics_of

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(90)]

NOWHERE = "127.0.0.1:1"
"""Port 1 on loopback: nothing listens, so a connection is refused at once."""


@pytest.mark.parametrize("role", ["gateway", "batcher", "worker"])
def test_a_redis_url_where_nothing_answers(role: str, tmp_path: Path, infra: Any) -> None:
    namespace = f"u{uuid.uuid4().hex[:8]}"
    url = f"redis://:secret@{NOWHERE}/0"
    code, output, elapsed_s = run_role(role, url, infra.kafka_bootstrap, namespace, tmp_path)
    assert_stopped_cleanly(
        code,
        output,
        elapsed_s,
        f"Redis at redis://:***@{NOWHERE}/0 did not answer",
        "check --redis-url / BATCHWIRE_REDIS_URL",
    )
    assert "secret" not in output, "the password stays out of the message"
    assert topics_of(infra.kafka_bootstrap, namespace) == [], "nothing is created before Redis answers"


@pytest.mark.parametrize("role", ["gateway", "batcher", "worker"])
def test_a_kafka_bootstrap_where_no_broker_answers(role: str, tmp_path: Path, infra: Any) -> None:
    code, output, elapsed_s = run_role(role, infra.redis_url, NOWHERE, f"u{uuid.uuid4().hex[:8]}", tmp_path)
    assert_stopped_cleanly(
        code,
        output,
        elapsed_s,
        f"no Kafka broker answered at {NOWHERE}",
        "check --kafka-bootstrap / BATCHWIRE_KAFKA_BOOTSTRAP",
    )


def test_a_kafka_bootstrap_that_takes_connections_and_never_answers(
    tmp_path: Path, infra: Any, silent_port: int
) -> None:
    """The role stops once the bootstrap's wait is over, not at the Kafka client's request timeout (40 s)."""
    bootstrap = f"127.0.0.1:{silent_port}"
    code, output, elapsed_s = run_role(
        "batcher", infra.redis_url, bootstrap, f"u{uuid.uuid4().hex[:8]}", tmp_path, exit_timeout_s=60
    )
    assert_stopped_cleanly(
        code,
        output,
        elapsed_s,
        f"no Kafka broker answered at {bootstrap} (",
        BOOTSTRAP_WAIT,
        "check --kafka-bootstrap / BATCHWIRE_KAFKA_BOOTSTRAP",
        within_s=BOOTSTRAP_TIMEOUT_S + 10,
    )


async def test_a_silent_address_of_a_bootstrap_list_costs_its_wait_and_the_next_one_is_asked(
    infra: Any, silent_server: socket.socket
) -> None:
    """A broker of three frozen: the roles start on the others once its wait is over."""
    silent = f"127.0.0.1:{silent_server.getsockname()[1]}"
    # aiokafka shuffles the addresses as it bootstraps (random.shuffle): a seed that asks the silent one first.
    seed = next(s for s in range(100) if _shuffled(s, ["silent", "broker"])[0] == "silent")
    random.seed(seed)
    started = time.monotonic()

    replication = await ensure_topics(f"{silent},{infra.kafka_bootstrap}", {})

    assert replication.replication_factor >= 1
    silent_server.setblocking(False)
    asked, _ = silent_server.accept()  # raises BlockingIOError if the silent address was not asked first
    asked.close()
    assert time.monotonic() - started < BOOTSTRAP_TIMEOUT_S + 10


def _shuffled(seed: int, items: list[str]) -> list[str]:
    random.seed(seed)
    random.shuffle(items)
    return items


@pytest.mark.parametrize("role", ["batcher", "worker"])
def test_a_session_timeout_the_broker_refuses(role: str, tmp_path: Path, infra: Any) -> None:
    namespace = f"u{uuid.uuid4().hex[:8]}"
    settings = {"BATCHWIRE_SESSION_TIMEOUT_MS": "-5"}
    code, output, elapsed_s = run_role(role, infra.redis_url, infra.kafka_bootstrap, namespace, tmp_path, **settings)
    assert_stopped_cleanly(code, output, elapsed_s, "refuses session_timeout_ms=-5", "BATCHWIRE_SESSION_TIMEOUT_MS")
