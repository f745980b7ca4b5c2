"""The Kafka plumbing the request and batch transports share: a group consumer with explicit commits.

Both the batcher (request topic) and the workers (batch topics) read through a group-managed
subscription, commit by hand, and must learn about rebalances *before* their partitions move, so
they can commit what they handed on. ``GroupConsumer`` owns that once; ``consumers.py`` adds decoding.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import (
    CommitFailedError,
    IllegalStateError,
    InvalidSessionTimeoutError,
    KafkaError,
    KafkaTimeoutError,
)

from transport.errors import PermanentTransportError
from transport.kafka.connection import bound_requests
from transport.ports import PartitionsCallback, TransportError

log = logging.getLogger(__name__)

# The group's leader assigns partitions from its cached metadata, so partitions added to a topic
# (`batchwire topics grow`) reach the members only after a refresh: this bounds that wait, for one
# small metadata request per consumer this often (aiokafka's default is 5 minutes).
METADATA_MAX_AGE_MS = 10_000


def translate(action: str, err: BaseException) -> TransportError:
    """A ``TransportError`` for a client failure, retriable exactly when the Kafka error is; a timeout
    too, which aiokafka marks not retriable (a send buffer that did not drain while a broker was
    away drains once it is back)."""
    retriable = isinstance(err, KafkaTimeoutError) or bool(getattr(err, "retriable", True))
    message = f"{action} failed: {type(err).__name__}: {err}"
    return TransportError(message) if retriable else PermanentTransportError(message)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka ships no type hints
    """Hands rebalances to the service as partition numbers of one topic.

    aiokafka awaits these coroutines inside the rebalance, so a revoked callback runs while this
    member still owns the partitions and may commit. aiokafka logs and drops a callback's
    exception; we keep it so that the next fetch raises it instead.
    """

    def __init__(
        self,
        consumer: GroupConsumer,
        on_assigned: PartitionsCallback,
        on_revoked: PartitionsCallback,
    ) -> None:
        self._consumer = consumer
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._consumer.give_up(self._consumer.partitions_of(revoked), self._on_revoked)

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        partitions = self._consumer.partitions_of(assigned)
        self._consumer.assigned = partitions
        await self._consumer.run_callback("on_assigned", self._on_assigned, partitions)


@dataclass(frozen=True, slots=True)
class GroupTiming:
    """How a group member paces its fetches, heartbeats and commits (aiokafka's settings of the same names)."""

    fetch_max_wait_ms: int = 500
    """How long the broker may hold a fetch open while no record is there. With fetch_min_bytes=1 it
    answers as soon as a record lands, so this adds no latency; it only sets how often an idle
    consumer asks, and on a small machine those idle fetches take CPU from the requests' own hops."""
    heartbeat_interval_ms: int = 1000
    """Heartbeats are how a member learns that a rebalance started: 1 s instead of aiokafka's 3 s lets
    the group settle faster when a member comes or goes, for a negligible load on the coordinator."""
    session_timeout_ms: int = 10_000
    max_poll_interval_ms: int = 300_000
    """A worker runs one batch between fetches: heartbeats flow from aiokafka's background task
    meanwhile, and this only bounds a stuck model call."""
    rebalance_timeout_ms: int | None = None
    """How long the coordinator waits for each member to rejoin once a rebalance starts, its revoked
    callback included: a member still in it past this is dropped from the group, and its commits are
    refused. None: the session timeout (aiokafka's default)."""
    request_timeout_ms: int = 30_000
    """Requests to the group's coordinator: it holds a JoinGroup until the rebalance ends."""
    data_request_timeout_ms: int = 5_000
    """Fetches, metadata requests and offset lookups, and each connection's set-up (``bound_requests``):
    the broker holds a fetch ``fetch_max_wait_ms`` at most and answers the rest at once, and a broker
    frozen or cut off holds the metadata refresh that would name its partitions' new leaders this long."""
    commit_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.data_request_timeout_ms <= self.fetch_max_wait_ms:
            raise ValueError(
                f"data_request_timeout_ms ({self.data_request_timeout_ms}) must exceed fetch_max_wait_ms "
                f"({self.fetch_max_wait_ms}), which the broker may hold a fetch"
            )

    @classmethod
    def revoking_within(cls, session_timeout_ms: int, revoke_s: float) -> GroupTiming:
        """For a member whose revocation may take ``revoke_s`` (its work in hand ends and commits first):
        the group waits that long past the session timeout for it, rather than drop it and refuse its
        commit, after which the partitions' next owner reads that work again."""
        return cls(
            session_timeout_ms=session_timeout_ms, rebalance_timeout_ms=session_timeout_ms + math.ceil(revoke_s * 1000)
        )


class GroupConsumer:
    """One aiokafka consumer in a consumer group, subscribed to one topic, committing explicitly.

    Offsets start at the earliest record when the group has none committed, so a request that was
    produced before the first batcher joined is still served.
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        group_id: str,
        *,
        client_id: str,
        max_poll_records: int,
        timing: GroupTiming,
    ) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.group_id = group_id
        self.assigned: frozenset[int] = frozenset()
        self.commit_timeout_s = timing.commit_timeout_s
        self._data_request_timeout_ms = timing.data_request_timeout_ms
        self._settings: dict[str, Any] = {
            "bootstrap_servers": bootstrap,
            "group_id": group_id,
            "client_id": client_id,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "session_timeout_ms": timing.session_timeout_ms,
            "heartbeat_interval_ms": timing.heartbeat_interval_ms,
            "max_poll_interval_ms": timing.max_poll_interval_ms,
            "rebalance_timeout_ms": timing.rebalance_timeout_ms,
            "fetch_max_wait_ms": timing.fetch_max_wait_ms,
            "max_poll_records": max_poll_records,
            "request_timeout_ms": timing.request_timeout_ms,
            "metadata_max_age_ms": METADATA_MAX_AGE_MS,
        }
        self._consumer: Any = None
        self._closing = False
        self._on_revoked: PartitionsCallback | None = None
        self._callback_failure: BaseException | None = None
        self._forget_hooks: list[Callable[[frozenset[int]], None]] = []

    def on_forget(self, hook: Callable[[frozenset[int]], None]) -> None:
        """Runs ``hook`` with partitions this member gives up, before the service's revoked callback."""
        self._forget_hooks.append(hook)

    async def give_up(self, partitions: frozenset[int], on_revoked: PartitionsCallback) -> None:
        """Drops local state for ``partitions``, lets the service commit, then marks them gone.

        ``assignment()`` still lists them while ``on_revoked`` runs, as it does in memory.
        """
        if not partitions:
            return
        for hook in self._forget_hooks:
            hook(partitions)
        try:
            await self.run_callback("on_revoked", on_revoked, partitions)
        finally:
            self.assigned = self.assigned - partitions

    def partitions_of(self, tps: Iterable[TopicPartition]) -> frozenset[int]:
        return frozenset(tp.partition for tp in tps if tp.topic == self.topic)

    async def run_callback(self, name: str, callback: PartitionsCallback, partitions: frozenset[int]) -> None:
        try:
            await callback(partitions)
        except Exception as err:
            log.exception("%s callback failed for %s partitions %s", name, self.topic, sorted(partitions))
            self._callback_failure = err

    async def start(self, on_assigned: PartitionsCallback, on_revoked: PartitionsCallback) -> None:
        """Connects and joins the group; ``on_assigned`` runs whenever partitions arrive (maybe later)."""
        if self._consumer is not None:
            raise RuntimeError(f"consumer for {self.topic} started twice")
        consumer = AIOKafkaConsumer(**self._settings)
        bound_requests(
            consumer._client,
            data_timeout_ms=self._data_request_timeout_ms,
            coordination_timeout_ms=self._settings["request_timeout_ms"],
        )
        consumer.subscribe([self.topic], listener=_Listener(self, on_assigned, on_revoked))
        try:
            await consumer.start()
        except BaseException as err:
            await consumer.stop()
            if isinstance(err, InvalidSessionTimeoutError):
                raise PermanentTransportError(
                    f"the broker at {self.bootstrap} refuses session_timeout_ms="
                    f"{self._settings['session_timeout_ms']} for group {self.group_id}: it must lie within the "
                    "broker's group.min.session.timeout.ms and group.max.session.timeout.ms (stock Kafka: 6000 to "
                    "1800000); set BATCHWIRE_SESSION_TIMEOUT_MS (--session-timeout-ms) in that range, or lower "
                    "the broker's minimum (batchwire's local stack and compose file use 1000)"
                ) from err
            if isinstance(err, KafkaError):
                action = f"connecting a consumer of {self.topic} (group {self.group_id}) to {self.bootstrap}"
                raise translate(action, err) from err
            raise
        self._consumer = consumer
        self._on_revoked = on_revoked

    async def close(self) -> None:
        """Runs ``on_revoked`` for what this member holds (aiokafka does not on stop), then leaves the group.

        The consumer stays usable during that callback so the service can commit its last offsets.
        """
        consumer = self._consumer
        if consumer is None or self._closing:
            return
        self._closing = True
        try:
            if self._on_revoked is not None:
                await self.give_up(self.assigned, self._on_revoked)
        finally:
            self._consumer = None
            await consumer.stop()

    def _raise_callback_failure(self) -> None:
        failure, self._callback_failure = self._callback_failure, None
        if failure is not None:
            raise TransportError(f"a rebalance callback for {self.topic} failed: {failure!r}") from failure

    async def getmany(self, timeout_s: float, max_records: int) -> list[Any]:
        """Records from every assigned partition, in offset order per partition, waiting at most ``timeout_s``.

        A rebalance callback that failed raises here before the next fetch. One that failed during a
        fetch raises on the call after it: that fetch's records are returned, since aiokafka has
        moved past them and would not return them again.
        """
        self._raise_callback_failure()
        if self._consumer is None:
            raise PermanentTransportError(f"consumer of {self.topic} is not started (or closed)")
        try:
            batches = await self._consumer.getmany(timeout_ms=max(0, int(timeout_s * 1000)), max_records=max_records)
        except KafkaError as err:
            raise translate(f"fetching from {self.topic}", err) from err
        records: list[Any] = []
        for tp in sorted(batches, key=lambda tp: tp.partition):
            records.extend(batches[tp])
        return records

    async def commit(self, offsets: Mapping[int, int]) -> None:
        """Commits next-offsets per partition; refuses (permanently) partitions this member no longer owns."""
        if not offsets:
            return
        if self._consumer is None:
            raise PermanentTransportError(f"consumer of {self.topic} is not started (or closed)")
        tps = {TopicPartition(self.topic, partition): offset for partition, offset in offsets.items()}
        try:
            async with asyncio.timeout(self.commit_timeout_s):
                await self._consumer.commit(tps)
        except TimeoutError as err:
            raise TransportError(
                f"committing {self.topic} offsets {dict(offsets)} took over {self.commit_timeout_s} s "
                "(group coordinator unreachable?)"
            ) from err
        except (CommitFailedError, IllegalStateError) as err:
            raise PermanentTransportError(
                f"commit of {self.topic} offsets {dict(offsets)} refused: group {self.group_id} rebalanced "
                f"and this member owns partitions {sorted(self.assigned)}; the records will be read again by "
                f"their owner ({err})"
            ) from err
        except KafkaError as err:
            raise translate(f"committing {self.topic} offsets {dict(offsets)}", err) from err
