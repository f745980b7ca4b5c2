"""The deployment's queue depth from Kafka: request topic end offsets minus the batchers' commits.

A batcher commits a request's offset only once the batch holding it is on the batch topic, so the
difference counts every request that gateways produced and no worker was handed yet, whichever
gateway produced it and whichever batcher holds it. One owned task refreshes it every
``refresh_s``; ``depth()`` reads the cached figure, so asking on every request costs nothing.

A read is trusted only when the group's coordinator answered a committed offset (or "none yet", -1)
for every partition asked. A broker that no longer coordinates the group answers an empty list
without an error (aiokafka's ``list_consumer_group_offsets`` drops the response's top-level error
code): counting that as "nothing committed" would read every record the topic keeps as waiting, and
refuse every request. Such a read fails instead, the coordinator is looked up again, and the last
good figure stands for ``stale_after_s``; after that the figure is unknown (None), which admission
treats as unknown, not as a full queue, and the reader replaces its clients (``_reconnect``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from schemas.wire import Names
from telemetry.metrics import REQUEST_LAG
from transport.background_loop import BackgroundLoop
from transport.kafka.group import METADATA_MAX_AGE_MS, translate
from transport.ports import Backlog, TransportError
from transport.routing import Partitioner

log = logging.getLogger(__name__)

DEFAULT_REFRESH_S = 0.15
# Without a successful refresh for this long the figure is unknown: depth() and backlog() answer None
# (admission then admits), because a bus that is really down fails the produce anyway, while a stale
# high figure would turn every request away for as long as the lag cannot be read.
DEFAULT_STALE_AFTER_S = 5.0
_WARN_EVERY = 50


class LagUnreadable(TransportError):
    """A read of the lag that cannot be trusted: the coordinator asked left partitions unanswered."""


class KafkaQueueDepth:
    """``QueueDepth`` over Kafka: lag of ``names.batcher_group`` on ``names.request_topic``."""

    def __init__(
        self,
        bootstrap: str,
        names: Names,
        partitions: int,
        *,
        refresh_s: float = DEFAULT_REFRESH_S,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        request_timeout_ms: int = 2000,
        client_id: str = "batchwire-gateway-lag",
        models: Sequence[str] = (),
        count_batches: bool = False,
    ) -> None:
        """``models`` enables ``backlog``: per-model counters; ``count_batches`` adds the batch topics'
        end offsets, the batches handed to each model's workers, over every partition the cluster's
        metadata shows (``topics grow`` adds partitions to a live deployment, whatever this gateway's
        ``--batch-partitions``)."""
        if partitions < 1 or not refresh_s > 0:
            raise ValueError(f"need partitions >= 1 and refresh_s > 0, got {partitions} and {refresh_s}")
        self.bootstrap = bootstrap
        self.topic = names.request_topic
        self.group = names.batcher_group
        self.refresh_s = refresh_s
        self.stale_after_s = stale_after_s
        self._partitions = [TopicPartition(self.topic, p) for p in range(partitions)]
        partitioner = Partitioner(models, partitions) if models else None
        self._model_partitions = {m: partitioner.partitions_for(m) for m in models} if partitioner else {}
        self._batch_topics = {m: names.batch_topic(m) for m in models} if count_batches else {}
        self._sums: dict[str, tuple[int, int]] = {}
        """Each model's (records waiting, records read) over its partitions, summed once per refresh:
        ``backlog`` is asked once per request."""
        self._batches: dict[str, int] = {}
        self._counted: dict[str, int] = {}
        """Per model, how many batch partitions its count is over."""
        self._settings: dict[str, Any] = {
            "bootstrap_servers": bootstrap,
            "client_id": client_id,
            "request_timeout_ms": request_timeout_ms,
            # A batch topic created after start is counted once the metadata is refreshed.
            "metadata_max_age_ms": METADATA_MAX_AGE_MS,
        }
        self._admin: Any = None
        self._consumer: Any = None
        self._coordinator: int | None = None
        self._depth = 0
        self._refreshed_at = float("-inf")  # monotonic time of the last successful refresh
        self._read_at = float("-inf")  # when that refresh began
        self._failures = 0
        self._connected_at = float("-inf")
        self._trusted = True  # for logging each change between a trusted and an untrusted figure
        self._loop = BackgroundLoop(f"queue-depth-{self.topic}")

    @property
    def alive(self) -> bool:
        """The refresh task runs (for readiness)."""
        return self._loop.alive

    async def start(self) -> None:
        """Connects, reads the lag once (so the first requests see a real figure), then refreshes in
        the background. A Kafka that cannot be reached fails here, naming the servers; a first read
        that fails for a passing reason (a fresh cluster has no group coordinator yet) is retried
        by the refresher."""
        if self._loop.started:
            raise RuntimeError("KafkaQueueDepth started twice")
        try:
            await self._connect()
        except BaseException as err:
            await self._disconnect()
            if isinstance(err, KafkaError):
                raise translate(f"connecting to {self.bootstrap} to read the lag of {self.group}", err) from err
            raise
        try:
            await self.refresh()
        except LagUnreadable as err:
            log.info("first read of the lag of %s failed (%s); retrying in the background", self.group, err)
        except KafkaError as err:
            if not getattr(err, "retriable", False):
                await self._disconnect()
                raise translate(f"reading the lag of {self.group} on {self.bootstrap}", err) from err
            log.info("first read of the lag of %s failed (%s); retrying in the background", self.group, err)
        self._loop.start(self._refresh_forever())

    async def close(self) -> None:
        await self._loop.close()
        await self._disconnect()

    async def _connect(self) -> None:
        self._admin = AIOKafkaAdminClient(**self._settings)
        self._consumer = AIOKafkaConsumer(group_id=None, enable_auto_commit=False, **self._settings)
        await self._admin.start()
        await self._consumer.start()
        # The metadata of the topics read, so that ``_count_batches`` knows which exist (and counts a
        # batch topic created later once the metadata is refreshed); aiokafka has no public way.
        topics = [self.topic, *self._batch_topics.values()]
        await self._consumer._client.set_topics(topics)
        self._connected_at = time.monotonic()

    async def _reconnect(self) -> None:
        """New clients in place of clients whose reads have failed for ``stale_after_s``: aiokafka's
        offset lookups do not refresh the cluster's metadata when they time out, so a client that knew
        the leaders from before an outage can keep asking the wrong broker after the cluster is whole.
        At most once per ``stale_after_s``."""
        if time.monotonic() - self._connected_at < self.stale_after_s:
            return
        self._connected_at = time.monotonic()
        await self._disconnect()
        try:
            async with asyncio.timeout(self.stale_after_s):  # a bootstrap server that does not answer
                await self._connect()
        except (KafkaError, OSError, TimeoutError) as err:
            log.warning("reconnecting to %s to read the lag of %s failed: %s", self.bootstrap, self.group, err)
            await self._disconnect()
        else:
            log.warning("reconnected to %s to read the lag of %s", self.bootstrap, self.group)

    async def depth(self) -> int | None:
        if self._stale():
            return None
        return self._depth

    def _stale(self) -> bool:
        return time.monotonic() - self._refreshed_at > self.stale_after_s

    async def refresh(self) -> int:
        """Reads end offsets and committed offsets now; returns (and caches) the lag."""
        read_at = time.monotonic()  # a request produced before this is in the end offsets
        if self._consumer is None or self._admin is None:
            raise LagUnreadable(f"not connected to {self.bootstrap}: a reconnection failed, and is tried again")
        ends: dict[TopicPartition, int] = await self._consumer.end_offsets(self._partitions)
        if self._coordinator is None:
            self._coordinator = await self._admin.find_coordinator(self.group)
        coordinator = self._coordinator
        try:
            committed = await self._admin.list_consumer_group_offsets(
                self.group, group_coordinator_id=coordinator, partitions=self._partitions
            )
        except KafkaError:
            self._coordinator = None  # it may have moved: look it up again next time
            raise
        unanswered = [tp for tp in self._partitions if tp not in committed]
        if unanswered:
            self._coordinator = None
            raise LagUnreadable(
                f"broker {coordinator} answered no committed offset for {len(unanswered)} of the "
                f"{len(self._partitions)} partitions of {self.topic} for group {self.group} (it may no longer "
                "coordinate the group): looking the coordinator up again"
            )
        # Gathered apart and swapped in with the time, after the last await: a backlog read meanwhile
        # never pairs new counts with the previous read's time (admission counts by that time).
        waiting: dict[int, int] = {}
        left: dict[int, int] = {}
        never_committed: list[TopicPartition] = []
        for tp in self._partitions:
            end = ends.get(tp, 0)
            offset = committed[tp].offset if tp in committed else -1
            if offset >= 0:
                waiting[tp.partition] = max(0, end - offset)
                left[tp.partition] = offset
            elif end > 0:
                never_committed.append(tp)
            else:
                waiting[tp.partition] = left[tp.partition] = 0
        if never_committed:  # a batcher starts those from the earliest record still kept
            starts: dict[TopicPartition, int] = await self._consumer.beginning_offsets(never_committed)
            for tp in never_committed:
                start = starts.get(tp, 0)
                waiting[tp.partition] = max(0, ends[tp] - start)
                left[tp.partition] = start
        lag = sum(waiting.values())
        if self._batch_topics:
            await self._count_batches()
        self._sums = {
            model: (sum(waiting.get(p, 0) for p in partitions), sum(left.get(p, 0) for p in partitions))
            for model, partitions in self._model_partitions.items()
        }
        self._depth = lag
        self._read_at = read_at
        self._refreshed_at = time.monotonic()
        REQUEST_LAG.set(lag)
        return lag

    async def _count_batches(self) -> None:
        """Each model's batch topic end offsets: the batches handed to its workers so far.

        The partitions are the ones the consumer's metadata knows: aiokafka waits out its request
        timeout on one that does not exist, and fails the whole read, which would hold every refresh
        and stop every model's count (admission reads a count that stops as a stalled model); and a
        partition added since start (``topics grow``) is counted once the metadata is refreshed, as a
        worker that owns it takes batches there."""
        every = [
            TopicPartition(topic, partition)
            for topic in self._batch_topics.values()
            for partition in sorted(self._consumer.partitions_for_topic(topic) or ())
        ]
        if not every:
            return
        try:
            ends: dict[TopicPartition, int] = await self._consumer.end_offsets(every)
        except KafkaError as err:  # the counts stay as they were
            log.debug("could not read the batch topics' end offsets: %s", err)
            return
        for model, topic in self._batch_topics.items():
            counts = [end for tp, end in ends.items() if tp.topic == topic]
            if counts:  # a model whose topic is missing keeps its count
                self._batches[model] = sum(counts)
                if self._counted.get(model) != len(counts):  # at start, and after a ``topics grow``
                    self._counted[model] = len(counts)
                    log.info("counting the batches of model %r over %d partitions of %s", model, len(counts), topic)

    def backlog(self, model: str) -> Backlog | None:
        if model not in self._model_partitions or self._stale():
            return None
        waiting, left = self._sums.get(model, (0, 0))
        return Backlog(waiting, left, self._batches.get(model, 0), self._read_at)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                # A read that hangs (a broker gone mid-request) fails like one that errs.
                async with asyncio.timeout(self.stale_after_s):
                    await self.refresh()
            except (KafkaError, TransportError, OSError, TimeoutError) as err:
                self._failures += 1
                if self._trusted or self._failures % _WARN_EVERY == 1:
                    log.warning(
                        "reading the lag of %s failed (%d time(s) in a row): %s; the last figure stands for %.0f s, "
                        "then the queue depth is unknown and its limit is not applied",
                        self.group,
                        self._failures,
                        err,
                        self.stale_after_s,
                    )
                self._trusted = False
                if self._stale():
                    REQUEST_LAG.set(math.nan)
                    await self._reconnect()
            else:
                if not self._trusted:
                    log.warning("the lag of %s is read again after %d failed read(s)", self.group, self._failures)
                self._trusted, self._failures = True, 0

    async def _disconnect(self) -> None:
        consumer, self._consumer = self._consumer, None
        admin, self._admin = self._admin, None
        # A client stopped after its broker went away can raise from its own metadata task (uvloop's
        # closed transport): stopping it is best effort, so the gateway still shuts down.
        if consumer is not None:
            await _best_effort("stopping the lag reader's consumer", consumer.stop())
        if admin is not None:
            await _best_effort("closing the lag reader's admin client", admin.close())


async def _best_effort(what: str, stop: Awaitable[None]) -> None:
    try:
        await stop
    except (KafkaError, OSError, RuntimeError) as err:
        log.info("%s: %s", what, err)
