"""One broker of three frozen (SIGSTOP) while it leads a partition: the cluster fences it and elects a
new leader among the in-sync copies, and batchwire's clients go on with that leader while the broker is
still frozen, instead of waiting on the frozen one for as long as it stays frozen:

- the gateway's request producer is ready again (a gateway whose cached metadata names the frozen broker
  refused every submit 503 meanwhile);
- a group member (a batcher's or a worker's consumer) reads what is written to the partition's new
  leader (its metadata refresh waited on the frozen broker for the 30 s coordination timeout, and the
  requests or batches of the partitions it led waited with it).

A stack of its own (`batchwire stack up --brokers 3`, a plain Redis) in a state dir of its own; topics
with RF 3 and min ISR 2, so a record is acked by the two brokers left.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka.errors import KafkaError  # type: ignore[import-untyped, unused-ignore]
from aiokafka.protocol.metadata import MetadataRequest  # type: ignore[import-untyped, unused-ignore]

from infra.stack import ENV_FILE_NAME, KAFKA_ENV, read_env_file
from infra.topics import ensure_topics
from schemas.records import InferenceRequest
from schemas.wire import Names
from tests.support.eventually import eventually
from tests.support.stack_cli import discard_stack
from tests.support.stack_cli import stack_cli as _cli
from transport.kafka.group import GroupConsumer, GroupTiming
from transport.kafka.producers import KafkaRequestProducer, RenewingProducer
from transport.ports import TransportError
from transport.routing import Partitioner

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(180)]

PARTITIONS = 2
READY_AGAIN_WITHIN_S = 30.0
"""The cluster fences a silent broker after its session timeout (3 s, `broker.session.timeout.ms`) and
moves its leaders at once; the producer then needs a metadata refresh or two (each at most its 5 s
request timeout when it asks the frozen broker first)."""
READ_WITHIN_S = 30.0
"""The same for a group member: fenced, the election, a fetch and a metadata refresh that may each first
wait out the data request timeout (5 s) on the frozen broker."""
GIVEN_UP_WITHIN_S = 15.0
"""A request to the frozen broker over a group member's data connection fails after the data request
timeout (5 s), not the coordination timeout (30 s)."""


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("frozen-leader") / "state"
    done = _cli(path, "up", "--brokers", "3", "--redis-replicas", "0")
    try:
        assert done.returncode == 0, f"stack up exited {done.returncode}:\n{done.stderr}"
        yield path
    finally:
        discard_stack(path)


def leader_of(state_dir: Path, topic: str, partition: int) -> tuple[int, int]:
    """(node id, pid) of the broker that leads ``topic``[``partition``] (`stack status --json`)."""
    report = json.loads(_cli(state_dir, "status", "--json").stdout)
    leaders = [s for s in report["servers"] if s["kind"] == "kafka" and partition in s["leads"].get(topic, [])]
    assert len(leaders) == 1, f"one broker leads {topic}[{partition}]: {report['servers']}"
    return int(leaders[0]["node_id"]), int(leaders[0]["pid"])


def request(n: int) -> InferenceRequest:
    now_ms = int(time.time() * 1000)
    return InferenceRequest(f"frozen-{n}", "sim", f"input {n}", now_ms, now_ms + 30_000, "gw")


async def test_a_frozen_leader_replaced_by_the_cluster_leaves_the_request_producer_ready(state_dir: Path) -> None:
    bootstrap = read_env_file(state_dir / ENV_FILE_NAME)[KAFKA_ENV]
    names = Names(f"frozen-{uuid.uuid4().hex[:8]}")
    replication = await ensure_topics(bootstrap, {names.request_topic: PARTITIONS})
    assert (replication.replication_factor, replication.min_insync_replicas) == (3, 2), replication
    producer = KafkaRequestProducer(bootstrap, names, Partitioner(["sim"], PARTITIONS), ready_timeout_s=1.0)
    await producer.start()
    try:
        await producer.send(request(0))
        assert await producer.ready(), "ready before the freeze"
        # The probe asks the leader of the topic's first partition: freeze that one.
        _, pid = leader_of(state_dir, names.request_topic, 0)
        os.kill(pid, signal.SIGSTOP)
        try:
            # As a send that failed or went unacked opens it: from then on only the breaker's own probes
            # (every 0.5 s, each bounded by the same second) ask, as in a gateway that no /readyz polls.
            producer.breaker.failed("the test froze the leader")
            await eventually(
                lambda: not producer.breaker.open,
                "the breaker's probes to reach the leader elected in place of the frozen broker",
                timeout_s=READY_AGAIN_WITHIN_S,
                interval_s=0.1,
            )
            assert await producer.ready(), "ready while one broker of three is frozen"
            for n in range(1, 5):  # both partitions, one of which the frozen broker led
                await producer.send(request(n))
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        await producer.close()


async def read_until(member: GroupConsumer, value: bytes, since: float, within_s: float) -> None:
    """Fetches until ``value`` comes; fails once ``within_s`` have passed since ``since``."""
    while True:
        elapsed_s = time.monotonic() - since
        assert elapsed_s < within_s, f"{value!r} not read {elapsed_s:.1f} s on"
        if any(record.value == value for record in await member.getmany(timeout_s=0.5, max_records=100)):
            return


async def written(writer: RenewingProducer, topic: str, value: bytes, since: float, within_s: float) -> None:
    """Sends ``value`` to ``topic``[0] until a leader acks it (a send to the frozen one fails, and the
    producer is replaced by one that reads fresh metadata)."""
    refused: list[str] = []
    while time.monotonic() - since < within_s:
        try:
            await writer.send(topic, 0, value)
            return
        except TransportError as err:
            refused.append(str(err))
        await asyncio.sleep(0.2)  # a writer's back-off while no leader is known, not synchronization
    raise AssertionError(f"{value!r} not acked within {within_s:g} s: {refused[-1:]}")


async def test_a_group_member_reads_from_the_leader_elected_in_place_of_a_frozen_one(state_dir: Path) -> None:
    bootstrap = read_env_file(state_dir / ENV_FILE_NAME)[KAFKA_ENV]
    topic = f"frozen-read-{uuid.uuid4().hex[:8]}"
    await ensure_topics(bootstrap, {topic: PARTITIONS})
    writer = RenewingProducer(
        bootstrap,
        client_id="frozen-writer",
        linger_ms=0,
        request_timeout_ms=5000,
        compression_type=None,
        ready_timeout_s=1,
    )
    member = GroupConsumer(
        bootstrap, topic, f"{topic}-group", client_id="frozen-reader", max_poll_records=100, timing=GroupTiming()
    )

    async def nothing(partitions: frozenset[int]) -> None:
        pass

    await writer.start()
    await member.start(nothing, nothing)
    try:
        await writer.send(topic, 0, b"before")
        await read_until(member, b"before", time.monotonic(), READ_WITHIN_S)
        node, pid = leader_of(state_dir, topic, 0)
        os.kill(pid, signal.SIGSTOP)
        try:
            frozen_at = time.monotonic()
            await written(writer, topic, b"during", frozen_at, READ_WITHIN_S)
            await read_until(member, b"during", frozen_at, READ_WITHIN_S)
            # What a metadata refresh or a fetch that meets the frozen broker waits for before it asks another.
            client = member._consumer._client
            asked_at = time.monotonic()
            with pytest.raises(KafkaError):
                await client.send(node, MetadataRequest([topic]))
            waited_s = time.monotonic() - asked_at
            assert waited_s < GIVEN_UP_WITHIN_S, f"a request to the frozen broker waited {waited_s:.1f} s to fail"
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        await member.close()
        await writer.close()
