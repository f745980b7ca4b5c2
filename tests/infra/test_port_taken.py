"""A server whose port another server of its kind bound first does not take that server's answers for its own.

The test suite starts Redis and Kafka on many workers at once: between drawing a free port and binding it,
another worker's server may bind it. The late server then dies of "Address already in use" while the
early one answers PING or metadata on the port.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from infra import redis_server
from infra.errors import PortTakenError
from infra.fetch_kafka import prepare_kafka
from infra.kafka_server import KafkaServer
from infra.local_stack import LocalStack
from infra.ports import free_port
from infra.redis_server import RedisServer, redis_pings

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]


def test_a_redis_given_a_port_another_redis_holds_fails_to_start(local_stack: LocalStack, tmp_path: Path) -> None:
    late = RedisServer(tmp_path / "late", port=local_stack.redis.port)
    try:
        with pytest.raises(PortTakenError, match=f"port {local_stack.redis.port}: another process answered"):
            late.start()
        assert not late.is_running()
        assert late.port_taken()
    finally:
        late.stop()
    assert redis_pings(local_stack.redis.port), "the server that holds the port is untouched"


def test_a_redis_whose_drawn_port_another_redis_took_starts_on_a_new_one(
    local_stack: LocalStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    draws = iter([local_stack.redis.port])
    monkeypatch.setattr(redis_server, "free_port", lambda: next(draws, None) or free_port())
    late = RedisServer(tmp_path / "late")
    try:
        late.start()
        assert late.port != local_stack.redis.port
        assert late.pid is not None and late.is_running()
        assert redis_pings(late.port)
    finally:
        late.stop()


def test_a_kafka_given_a_broker_port_another_broker_holds_fails_to_start(
    local_stack: LocalStack, tmp_path: Path
) -> None:
    held = local_stack.kafka.broker_port
    late = KafkaServer(prepare_kafka(), tmp_path / "late", broker_port=held, controller_port=free_port())
    try:
        with pytest.raises(PortTakenError, match=f"127.0.0.1:{held}: another process answered"):
            late.start(timeout_s=60)
        assert not late.is_running()
    finally:
        late.stop()
