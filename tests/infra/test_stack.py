"""The real thing: a local broker and Redis, restarts, and the detached `stack up/down`."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition  # type: ignore[import-untyped, unused-ignore]
from aiokafka.admin import AIOKafkaAdminClient  # type: ignore[import-untyped, unused-ignore]

from infra.aio import run_blocking
from infra.kafka_probe import kafka_serves
from infra.process import ServiceProcess
from infra.redis_server import redis_pings
from infra.stack import ENV_FILE_NAME, KAFKA_ENV, REDIS_ENV, LocalStack, stack_down, stack_status, stack_up
from infra.topics import TopicError, ensure_topics

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]

WAIT_S = 20.0


def _topic() -> str:
    return f"infra-test-{uuid.uuid4().hex[:10]}"


async def _produce(bootstrap: str, topic: str, value: bytes, partition: int | None = None) -> tuple[int, int]:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await producer.start()
    try:
        meta = await asyncio.wait_for(producer.send_and_wait(topic, value, partition=partition), WAIT_S)
    finally:
        await producer.stop()
    return meta.partition, meta.offset


async def _read_one(bootstrap: str, topic: str, partition: int, offset: int) -> bytes:
    # Manual assignment: no consumer-group join, so the read costs one fetch.
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        consumer.seek(tp, offset)
        record = await asyncio.wait_for(consumer.getone(), WAIT_S)
    finally:
        await consumer.stop()
    value: bytes = record.value
    return value


async def _partition_count(bootstrap: str, topic: str) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        [described] = await admin.describe_topics([topic])
    finally:
        await admin.close()
    return len(described["partitions"])


@pytest.mark.asyncio
async def test_topic_with_three_partitions_carries_a_message(local_stack: LocalStack) -> None:
    bootstrap = local_stack.kafka_bootstrap
    topic = _topic()

    await ensure_topics(bootstrap, {topic: 3})
    await ensure_topics(bootstrap, {topic: 3})  # idempotent

    assert await _partition_count(bootstrap, topic) == 3
    partition, offset = await _produce(bootstrap, topic, b"hello", partition=2)
    assert (partition, offset) == (2, 0)
    assert await _read_one(bootstrap, topic, partition, offset) == b"hello"


@pytest.mark.asyncio
async def test_ensure_topics_refuses_a_different_partition_count(local_stack: LocalStack) -> None:
    topic = _topic()
    await ensure_topics(local_stack.kafka_bootstrap, {topic: 2})

    with pytest.raises(TopicError, match="exists with 2 partitions; wanted 4"):
        await ensure_topics(local_stack.kafka_bootstrap, {topic: 4})


@pytest.mark.asyncio
async def test_redis_set_get(local_stack: LocalStack) -> None:
    client = aioredis.Redis.from_url(local_stack.redis_url)
    try:
        await client.set("infra-test:key", b"value")
        assert await client.get("infra-test:key") == b"value"
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_kafka_restart_keeps_address_and_data(local_stack: LocalStack) -> None:
    bootstrap = local_stack.kafka_bootstrap
    topic = _topic()
    await ensure_topics(bootstrap, {topic: 1})
    _, before_offset = await _produce(bootstrap, topic, b"before")
    pid_before = local_stack.kafka.pid

    await asyncio.to_thread(local_stack.restart_kafka)

    assert local_stack.kafka_bootstrap == bootstrap
    assert local_stack.kafka.pid != pid_before, "expected a new broker process after restart"
    _, after_offset = await _produce(bootstrap, topic, b"after")
    assert after_offset == before_offset + 1, f"offsets continue across restart; got {after_offset}"
    assert await _read_one(bootstrap, topic, 0, before_offset) == b"before"


@pytest.mark.asyncio
async def test_kafka_recovers_from_a_crash(local_stack: LocalStack) -> None:
    bootstrap = local_stack.kafka_bootstrap
    topic = _topic()
    await ensure_topics(bootstrap, {topic: 1})

    await asyncio.to_thread(local_stack.kill_kafka)
    assert not await kafka_serves(bootstrap, request_timeout_s=1.0)
    await asyncio.to_thread(local_stack.start_kafka)

    _, offset = await _produce(bootstrap, topic, b"after-crash")
    assert await _read_one(bootstrap, topic, 0, offset) == b"after-crash"


@pytest.mark.asyncio
async def test_redis_restart_keeps_address_and_loses_data(local_stack: LocalStack) -> None:
    url = local_stack.redis_url
    before = aioredis.Redis.from_url(url)
    try:
        await before.set("infra-test:gone", b"1")
    finally:
        await before.aclose()

    await asyncio.to_thread(local_stack.restart_redis)

    assert local_stack.redis_url == url
    after = aioredis.Redis.from_url(url)
    try:
        assert await after.ping()
        assert await after.get("infra-test:gone") is None, "no persistence: a restart empties Redis"
    finally:
        await after.aclose()


def test_stack_up_status_down_round_trip(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    try:
        env = stack_up(state_dir)

        env_text = (state_dir / ENV_FILE_NAME).read_text()
        assert env_text == f"{KAFKA_ENV}={env[KAFKA_ENV]}\n{REDIS_ENV}={env[REDIS_ENV]}\n"
        assert env[KAFKA_ENV].startswith("127.0.0.1:")
        assert env[REDIS_ENV].startswith("redis://127.0.0.1:")
        assert env[REDIS_ENV].endswith("/0")
        status = stack_status(state_dir)
        assert status.healthy, f"expected a healthy stack, got {status}"
        assert status.kafka_pid is not None
        assert status.redis_pid is not None
        pids = (status.kafka_pid, status.redis_pid)

        started = time.monotonic()
        assert stack_up(state_dir) == env, "a second `up` reuses the running stack"
        assert time.monotonic() - started < 10.0
        again = stack_status(state_dir)
        assert (again.kafka_pid, again.redis_pid) == pids
    finally:
        was_running = stack_down(state_dir)

    assert was_running
    assert not (state_dir / ENV_FILE_NAME).exists()
    for pid in pids:
        assert ServiceProcess.attach(pid, []) is None, f"process {pid} still alive after down"
    assert not redis_pings(int(env[REDIS_ENV].rsplit(":", 1)[1].split("/")[0]))
    assert stack_down(state_dir) is False, "a second `down` finds nothing to stop"
    assert not stack_status(state_dir).anything_running


def test_provide_infra_local_can_restart(tmp_path: Path) -> None:
    from infra.select import provide_infra

    with provide_infra("local", work_dir=tmp_path) as provided:
        assert provided.kind == "local"
        assert provided.can_restart
        assert redis_pings(int(provided.redis_url.rsplit(":", 1)[1].split("/")[0]))
        provided.restart_redis()
        provided.stop_kafka()
        assert not run_blocking(lambda: kafka_serves(provided.kafka_bootstrap, request_timeout_s=1.0))
        provided.start_kafka()
        assert run_blocking(lambda: kafka_serves(provided.kafka_bootstrap))
