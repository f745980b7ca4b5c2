"""Replicated topics on a real three-broker cluster (`batchwire stack up --brokers 3`), started once.

Topics come out with RF 3 and min ISR 2 by default; an existing topic with less stops a role before
it creates anything; `topics grow` adds batch partitions keeping what is in them (a running producer
reaches the new ones and an idle worker gets one), and refuses to grow the request topic while a
batcher is in its group.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition  # type: ignore[import-untyped, unused-ignore]
from aiokafka.admin import AIOKafkaAdminClient, NewTopic  # type: ignore[import-untyped, unused-ignore]
from aiokafka.admin.config_resource import (  # type: ignore[import-untyped, unused-ignore]
    ConfigResource,
    ConfigResourceType,
)

from infra.stack import ENV_FILE_NAME, KAFKA_ENV, REDIS_ENV, read_env_file
from schemas.wire import Names
from tests.support.stack_cli import discard_stack
from transport.errors import PermanentTransportError
from transport.kafka.consumers import KafkaBatchConsumer
from transport.kafka.producers import KafkaBatchProducer

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(120)]

WAIT_S = 20.0


def _cli(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``batchwire ARGS`` over the cluster in ``state_dir``, without the developer's settings."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("BATCHWIRE_")}
    env["BATCHWIRE_STACK_ENV"] = str(state_dir.parent / "no-stack.env")
    if (state_dir / ENV_FILE_NAME).is_file():
        stack_env = read_env_file(state_dir / ENV_FILE_NAME)
        env.update(BATCHWIRE_KAFKA_BOOTSTRAP=stack_env[KAFKA_ENV], BATCHWIRE_REDIS_URL=stack_env[REDIS_ENV])
    return subprocess.run(
        [sys.executable, "-m", "batchwire.cli", *args],
        env=env,
        cwd=state_dir.parent,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("cluster") / "state"
    done = _cli(path, "stack", "up", "--brokers", "3", "--state-dir", str(path))
    assert done.returncode == 0, f"stack up exited {done.returncode}:\n{done.stderr}"
    yield path
    discard_stack(path)


@pytest.fixture
def bootstrap(state_dir: Path) -> str:
    return read_env_file(state_dir / ENV_FILE_NAME)[KAFKA_ENV]


@pytest.fixture
def names() -> Names:
    return Names(namespace=f"t{uuid.uuid4().hex[:10]}")


async def _describe(bootstrap: str, topics: list[str]) -> dict[str, tuple[int, set[int], str | None]]:
    """Each topic's partition count, replica counts and min.insync.replicas (None: that broker has no config yet)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        described = await admin.describe_topics(topics)
        configs = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, t) for t in topics])
    finally:
        await admin.close()
    min_isr = {
        resource[3]: next((entry[1] for entry in resource[4] if entry[0] == "min.insync.replicas"), None)
        for response in configs
        for resource in response.resources
    }
    return {
        t["topic"]: (len(t["partitions"]), {len(p["replicas"]) for p in t["partitions"]}, min_isr[t["topic"]])
        for t in described
    }


async def _described_with(bootstrap: str, topic: str, partitions: int) -> tuple[int, set[int], str | None]:
    """The topic as a broker shows it once ``partitions`` and its config reached that broker (they propagate)."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while True:
        found = (await _describe(bootstrap, [topic]))[topic]
        if (found[0] >= partitions and found[2] is not None) or asyncio.get_running_loop().time() > deadline:
            return found
        await asyncio.sleep(0.1)


async def _create(bootstrap: str, topic: str, partitions: int, rf: int, min_isr: int) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        config = {"min.insync.replicas": str(min_isr)}
        await admin.create_topics([NewTopic(topic, partitions, rf, topic_configs=config)])
    finally:
        await admin.close()


async def _list(bootstrap: str, namespace: str) -> list[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return sorted(t for t in await admin.list_topics() if t.startswith(namespace + "."))
    finally:
        await admin.close()


def test_stack_up_creates_the_topics_with_rf_3_and_min_isr_2(bootstrap: str) -> None:
    default = Names("batchwire")
    topics = [default.request_topic, default.batch_topic("sim")]

    described = {topic: asyncio.run(_described_with(bootstrap, topic, 1)) for topic in topics}

    assert described == {default.request_topic: (12, {3}, "2"), default.batch_topic("sim"): (8, {3}, "2")}, described


def test_an_existing_topic_with_rf_1_stops_a_role_naming_the_fix_and_nothing_else_is_created(
    state_dir: Path, bootstrap: str, names: Names
) -> None:
    asyncio.run(_create(bootstrap, names.request_topic, 12, 1, 1))

    done = _cli(state_dir, "batcher", "--namespace", names.namespace)

    output = done.stderr + done.stdout
    assert done.returncode == 2, f"expected exit 2, got {done.returncode}:\n{output}"
    for text in (
        f"topic {names.request_topic!r} has replication factor 1; 3 was asked",
        "kafka-reassign-partitions",
        f"topic {names.request_topic!r} has min.insync.replicas 1; 2 was asked",
        "--add-config min.insync.replicas=2",
    ):
        assert text in output, f"expected {text!r} in:\n{output}"
    assert asyncio.run(_list(bootstrap, names.namespace)) == [names.request_topic], "the batch topic was created"


def test_a_replication_factor_above_the_brokers_names_both_numbers(state_dir: Path, names: Names) -> None:
    done = _cli(state_dir, "worker", "--namespace", names.namespace, "--replication-factor", "4")

    assert done.returncode == 2, done.stderr
    assert "replication factor 4 is larger than the 3 broker(s)" in done.stderr, done.stderr


async def _produce(bootstrap: str, topic: str, partition: int, value: bytes) -> int:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        meta = await asyncio.wait_for(producer.send_and_wait(topic, value, partition=partition), WAIT_S)
    finally:
        await producer.stop()
    offset: int = meta.offset
    return offset


async def _read(bootstrap: str, topic: str, partition: int, offset: int) -> bytes:
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


def test_topics_grow_adds_batch_partitions_and_keeps_the_records(state_dir: Path, bootstrap: str, names: Names) -> None:
    topic = names.batch_topic("sim")
    asyncio.run(_create(bootstrap, topic, 8, 3, 2))
    offset = asyncio.run(_produce(bootstrap, topic, 7, b"before the grow"))

    async def grow_beside_a_batcher_producer() -> subprocess.CompletedProcess[str]:
        producer = KafkaBatchProducer(bootstrap, names)
        await producer.start()
        try:
            await producer.send_encoded("sim", b"cached 8 partitions", 0)
            done = await asyncio.to_thread(
                _cli, state_dir, "topics", "grow", "--namespace", names.namespace, "--batch-partitions", "12"
            )
            if done.returncode == 0:  # the same producer reaches a new partition: its metadata is refreshed
                await _send_when_known(producer, 11, b"on a new partition")
            return done
        finally:
            await producer.close()

    done = asyncio.run(grow_beside_a_batcher_producer())

    assert done.returncode == 0, done.stderr
    assert f"{topic}: 8 -> 12 partitions" in done.stdout, done.stdout
    assert asyncio.run(_described_with(bootstrap, topic, 12)) == (12, {3}, "2")
    assert asyncio.run(_read(bootstrap, topic, 7, offset)) == b"before the grow"
    assert asyncio.run(_read(bootstrap, topic, 11, 0)) == b"on a new partition"


async def _send_when_known(producer: KafkaBatchProducer, partition: int, value: bytes) -> None:
    """Sends as a batcher does: a partition the answering broker does not know yet fails, and is tried again."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while True:
        try:
            await producer.send_encoded("sim", value, partition)
            return
        except PermanentTransportError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


def test_an_idle_worker_gets_a_partition_added_by_topics_grow_without_a_restart(
    state_dir: Path, bootstrap: str, names: Names
) -> None:
    topic = names.batch_topic("sim")
    asyncio.run(_create(bootstrap, topic, 1, 3, 2))

    async def two_workers_across_a_grow() -> list[frozenset[int]]:
        owned: list[frozenset[int]] = [frozenset(), frozenset()]
        changed = asyncio.Event()
        consumers = [KafkaBatchConsumer(bootstrap, names, "sim") for _ in owned]

        def recorder(index: int) -> Callable[[frozenset[int]], Awaitable[None]]:
            async def on_assigned(partitions: frozenset[int]) -> None:
                owned[index] = partitions
                changed.set()

            return on_assigned

        async def on_revoked(partitions: frozenset[int]) -> None:
            pass

        async def until_owned(expected: list[int]) -> None:
            while sorted(p for o in owned for p in o) != expected:
                changed.clear()
                await asyncio.wait_for(changed.wait(), WAIT_S)

        try:
            for index, consumer in enumerate(consumers):
                await consumer.start(recorder(index), on_revoked)
            await until_owned([0])  # one worker owns the partition, the other idles
            await asyncio.to_thread(
                _cli, state_dir, "topics", "grow", "--namespace", names.namespace, "--batch-partitions", "2"
            )
            await until_owned([0, 1])  # after the members' next metadata refresh
            return owned
        finally:
            for consumer in consumers:
                await consumer.close()

    owned = asyncio.run(two_workers_across_a_grow())

    assert all(len(o) == 1 for o in owned), owned


def test_topics_grow_refuses_the_request_topic_while_a_batcher_is_in_its_group(
    state_dir: Path, bootstrap: str, names: Names
) -> None:
    asyncio.run(_create(bootstrap, names.request_topic, 12, 3, 2))

    async def grow_beside_a_batcher() -> subprocess.CompletedProcess[str]:
        assigned = _Assigned()
        member = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=names.batcher_group)
        member.subscribe([names.request_topic], listener=assigned)
        await member.start()
        try:
            await asyncio.wait_for(assigned.event.wait(), WAIT_S)
            return await asyncio.to_thread(
                _cli, state_dir, "topics", "grow", "--namespace", names.namespace, "--request-partitions", "16"
            )
        finally:
            await member.stop()

    refused = asyncio.run(grow_beside_a_batcher())

    assert refused.returncode == 2, refused.stderr
    assert "1 batcher(s) are running" in refused.stderr and "--request-partitions 16" in refused.stderr
    # a broker that has not yet heard of the new topic shows it with no partitions: wait for it
    assert asyncio.run(_described_with(bootstrap, names.request_topic, 12))[0] == 12

    grown = _cli(state_dir, "topics", "grow", "--namespace", names.namespace, "--request-partitions", "16")

    assert grown.returncode == 0, grown.stderr
    assert asyncio.run(_described_with(bootstrap, names.request_topic, 16))[0] == 16


class _Assigned(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.event = asyncio.Event()

    async def on_partitions_revoked(self, revoked: object) -> None:
        pass

    async def on_partitions_assigned(self, assigned: object) -> None:
        self.event.set()
