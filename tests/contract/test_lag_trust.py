"""A lag read that cannot be trusted never becomes "everything is waiting".

A broker that no longer coordinates the batchers' group answers the committed-offsets request with
no partitions and no error that aiokafka raises. These tests hand ``KafkaQueueDepth`` a client whose
answers are scripted (the shape of that answer, not Kafka's behaviour: the real one is attacked in
``tests/e2e/test_produce_broker_kill.py``), so each step of the read is checked alone.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaTimeoutError
from aiokafka.structs import OffsetAndMetadata

from schemas.wire import Names
from telemetry.metrics import REGISTRY
from tests.support.eventually import eventually
from transport.kafka.lag import KafkaQueueDepth, LagUnreadable

PARTITIONS = 4
END = 1000
COMMITTED = 990


class ScriptedCluster:
    """End offsets, and the committed offsets each coordinator answers (a missing one: answers ``{}``)."""

    def __init__(self, names: Names) -> None:
        self.topic = names.request_topic
        self.coordinator = 1
        self.answering = {1}
        self.asked: list[int | None] = []
        self.timing_out = False
        """Every end-offsets lookup times out: a client that asks a broker no longer leading."""
        self.stopped = False

    async def end_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        if self.timing_out:
            raise KafkaTimeoutError("Failed to get offsets by times in 2000 ms")
        return dict.fromkeys(partitions, END)

    async def stop(self) -> None:
        self.stopped = True

    async def close(self) -> None:
        self.stopped = True

    async def beginning_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(partitions, 0)

    async def find_coordinator(self, group: str) -> int:
        return self.coordinator

    async def list_consumer_group_offsets(
        self, group: str, group_coordinator_id: int | None = None, partitions: list[TopicPartition] | None = None
    ) -> dict[TopicPartition, OffsetAndMetadata]:
        self.asked.append(group_coordinator_id)
        if group_coordinator_id not in self.answering:
            return {}  # what a broker that no longer coordinates the group comes back with
        assert partitions is not None
        return {tp: OffsetAndMetadata(COMMITTED, "") for tp in partitions}


def _depth(names: Names, cluster: Any, stale_after_s: float = 5.0) -> KafkaQueueDepth:
    depth = KafkaQueueDepth("127.0.0.1:1", names, PARTITIONS, models=("sim",), stale_after_s=stale_after_s)
    depth._admin = depth._consumer = cluster
    return depth


def _reconnecting_to(depth: KafkaQueueDepth, cluster: Any) -> list[Any]:
    """Makes ``depth`` reconnect to ``cluster`` (instead of Kafka); returns the clients it connected."""
    connected: list[Any] = []

    async def connect() -> None:
        depth._admin = depth._consumer = cluster
        connected.append(cluster)

    depth._connect = connect  # type: ignore[method-assign]
    return connected


def _gauge() -> float | None:
    return REGISTRY.get_sample_value("batchwire_request_topic_lag")


async def test_an_empty_answer_from_a_former_coordinator_is_not_read_as_a_full_queue(names: Names) -> None:
    cluster = ScriptedCluster(names)
    depth = _depth(names, cluster)
    assert await depth.refresh() == PARTITIONS * (END - COMMITTED)
    good = await depth.depth()

    cluster.coordinator, cluster.answering = 2, {2}  # the role moved; broker 1 now answers {}
    with pytest.raises(LagUnreadable, match="no committed offset for 4 of the 4 partitions"):
        await depth.refresh()
    assert await depth.depth() == good, "the last good figure stands, not every record the topic keeps"
    backlog = depth.backlog("sim")
    assert backlog is not None and backlog.depth <= good, f"the model's figure stands too: {backlog}"
    assert _gauge() == good

    assert await depth.refresh() == good, "the next read looks the coordinator up again and is right"
    assert cluster.asked[-2:] == [1, 2], f"asked the old coordinator once, then the new one: {cluster.asked}"


async def test_a_figure_that_cannot_be_read_becomes_unknown_after_stale_after_s(names: Names) -> None:
    cluster = ScriptedCluster(names)
    depth = _depth(names, cluster, stale_after_s=0.0)
    await depth.refresh()
    cluster.answering = set()  # no broker answers for the group
    with pytest.raises(LagUnreadable):
        await depth.refresh()
    assert await depth.depth() is None, "past stale_after_s the depth is unknown, not 0 and not the old figure"
    assert depth.backlog("sim") is None


async def test_the_refresher_marks_the_gauge_unknown_once_stale(names: Names) -> None:
    cluster = ScriptedCluster(names)
    depth = KafkaQueueDepth("127.0.0.1:1", names, PARTITIONS, refresh_s=0.01, stale_after_s=0.05)
    depth._admin = depth._consumer = cluster
    _reconnecting_to(depth, cluster)
    await depth.refresh()
    cluster.answering = set()
    depth._loop.start(depth._refresh_forever())
    try:
        await eventually(lambda: math.isnan(_gauge() or 0.0), "the lag gauge to read NaN (unknown)", timeout_s=10)
        cluster.answering = {cluster.coordinator}
        await eventually(lambda: _gauge() == PARTITIONS * (END - COMMITTED), "the gauge to read the lag again")
    finally:
        await depth._loop.close()


async def test_a_client_whose_reads_time_out_past_stale_after_s_is_replaced(names: Names) -> None:
    """aiokafka's offset lookups do not refresh its metadata when they time out: after an outage a
    client can keep asking a broker that no longer leads. The refresher replaces it once stale."""
    stuck, fresh = ScriptedCluster(names), ScriptedCluster(names)
    depth = KafkaQueueDepth("127.0.0.1:1", names, PARTITIONS, refresh_s=0.01, stale_after_s=0.05)
    depth._admin = depth._consumer = stuck
    connected = _reconnecting_to(depth, fresh)
    await depth.refresh()
    stuck.timing_out = True
    depth._loop.start(depth._refresh_forever())
    try:
        await eventually(lambda: bool(connected), "the refresher to connect new clients", timeout_s=10)
        assert stuck.stopped, "the stuck clients are stopped"
        await eventually(lambda: _gauge() == PARTITIONS * (END - COMMITTED), "the gauge to read the lag again")
        # depth() is the figure while under stale_after_s old: a loaded loop can let one read age past it
        # between two checks, so this is read as depth() reads it, until it holds.
        await eventually(
            lambda: not depth._stale() and depth._depth == PARTITIONS * (END - COMMITTED), "the depth to read again"
        )
    finally:
        await depth._loop.close()
