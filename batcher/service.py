"""The batcher: reads requests into a ``BatchFormer`` and finishes them; its ``Dispatcher`` sends them.

Reading, expiry and offset commits live here; how a held request reaches an idle worker is
``batcher.dispatch``.

Kafka or Redis going away stops no loop: reads, claims and expiry writes are retried with backoff
until they work. Only an error that retrying cannot fix ends a loop, and a loop that ends sets
``failed`` so the process exits non-zero instead of hanging.

With Redis replicas (``replicas``), a request the batcher ends (expired, or for an unknown model) is
committed only once its end state is on enough of them, as a worker's results are: a failover then
cannot leave a committed request showing ``queued``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

from batcher import states
from batcher.dispatch import Dispatcher
from batcher.offsets import OffsetTracker
from batcher.policy import BatchFormer, Pending
from batcher.settings import BatcherSettings
from batcher.states import wall_ms
from batcher.tokens import TokenCounter, estimated
from schemas.codec import item_bytes
from schemas.records import InferenceRequest, TaskState
from telemetry import metrics
from telemetry.logs import ids
from transport.cancelling import cancel_and_wait
from transport.ports import (
    BatchProducer,
    CreditPool,
    Delivered,
    RequestConsumer,
    TaskStore,
    TransportError,
)
from transport.replicas import ReplicaWait
from transport.retry import pause, retry

log = logging.getLogger(__name__)

T = TypeVar("T")


class Batcher:
    """Reads the request topic into held requests and finishes them (handed over, expired or
    failed) so that their offsets are committed; its ``Dispatcher`` hands them to workers."""

    def __init__(
        self,
        settings: BatcherSettings,
        consumer: RequestConsumer,
        producer: BatchProducer,
        credits: CreditPool,
        store: TaskStore,
        clock: Callable[[], float] = time.monotonic,
        replicas: ReplicaWait | None = None,
        count_tokens: TokenCounter = estimated,
    ) -> None:
        """``count_tokens`` gives each request its length for the token budget (when the policy has one)."""
        self.settings = settings
        self._count_tokens = count_tokens if settings.policy.max_batch_tokens > 0 else None
        self.consumer = consumer
        self.store = store
        self.replicas = replicas
        """When set, a request the batcher ends is committed only once its end state is on enough Redis replicas."""
        self.clock = clock
        self.former: BatchFormer[InferenceRequest] = BatchFormer(settings.policy, clock, settings.tier_min_share)
        self.offsets = OffsetTracker()
        self._commit_wanted = False
        self._committer: asyncio.Task[None] | None = None
        self._commit_pausing = False
        """The committer sleeps between a failed commit and its retry: a close stops it there."""
        self._timer_wake = asyncio.Event()
        self._room = asyncio.Event()
        """Clear while ``max_held`` requests are held, over all models: reading waits for a send, an
        expiry or a rebalance to take some (``_check_room``)."""
        self._room.set()
        self._expiring: list[Pending[InferenceRequest]] = []
        """Requests that expired while held, whose end state ``_expiry_loop`` stores: still held against
        ``max_held`` until it is stored, so a store that is down stops the reads."""
        self._expiring_added = asyncio.Event()
        self._revoked_meanwhile: set[int] = set()
        """Partitions revoked since the read loop began counting its last read (``_count``)."""
        self._over_budget_told: set[str] = set()
        """Models an input over the token budget was logged for (``_warn_over_budget``): once each."""
        self._handover = asyncio.Lock()
        """Held while a batch is sealed or partitions go, and by a rebalance or a close until the
        batches on their way landed: the held requests and offsets stay consistent."""
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.failure: BaseException | None = None
        self.failed = asyncio.Event()
        """Set when a background loop crashed: the process supervisor should exit."""
        self.dispatcher = Dispatcher(
            settings,
            self.former,
            credits,
            producer,
            store,
            handover=self._handover,
            freed=self._check_room,
            requeued=self._requeued,
            assignment=consumer.assignment,
            handed_over=self._handed_over,
            expire=self._end_expired,
            spawn=self._spawn,
            clock=clock,
        )

    @property
    def batches_sent(self) -> int:
        return self.dispatcher.batches_sent

    @property
    def state(self) -> str:
        """What the fleet's heartbeat shows: failed (a loop crashed: the process exits), starting (joining
        its group), draining (closing), busy (requests held) or idle."""
        if self.failure is not None:
            return "failed"
        if self._closing:
            return "draining"
        if not self._tasks:
            return "starting"
        return "busy" if any(self.former.held(model) for model in self.former.models()) else "idle"

    # lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.consumer.start(self._on_assigned, self._on_revoked)
        self._tasks = [
            self._spawn(self._consume_loop(), "batcher-consume"),
            self._spawn(self._timer_loop(), "batcher-timer"),
            self._spawn(self._expiry_loop(), "batcher-expiry"),
        ]

    async def close(self) -> None:
        """Stops reading, lets an in-flight hand-over finish, commits it, and leaves the group.

        Whatever is still held (not handed to a worker) was never committed, so the batcher that
        takes over the partitions reads it again: handed back, not lost. A loop that lost its
        cancellation in a library below is cancelled again (``cancel_and_wait``).
        """
        self._closing = True
        async with self._handover:
            for task in self._tasks:
                task.cancel()
            self.dispatcher.cancel()
        await asyncio.gather(*(cancel_and_wait(task) for task in self._tasks))
        await self.dispatcher.cancelled()
        self._tasks.clear()
        if self._committer is not None:
            if self._commit_pausing:
                self._committer.cancel()  # a retry's pause: the commit below is the last try
            await asyncio.gather(self._committer, return_exceptions=True)
        await self._commit()
        await self.consumer.close()

    def _spawn(self, loop: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Runs a background loop in a task of its own (cancelled before its first step, it still
        closes ``loop``); a crash is recorded and logged, never silent."""
        task = asyncio.create_task(loop, name=name)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or (err := task.exception()) is None:
            return
        self.failure = err
        self.failed.set()
        log.error("batcher loop %s crashed; the batcher is no longer serving", task.get_name(), exc_info=err)

    def healthy(self) -> bool:
        return self.failure is None and all(not t.done() for t in self._tasks)

    # rebalance ---------------------------------------------------------------------------------
    async def _on_assigned(self, partitions: frozenset[int]) -> None:
        log.info("batcher %s assigned request partitions %s", self.settings.batcher_id, sorted(partitions))

    async def _on_revoked(self, partitions: frozenset[int]) -> None:
        async with self._handover:
            await self.dispatcher.landings.landed()  # a batch on its way: its requests are handed over, or held again
            await self._commit()
            dropped = self.former.drop_partitions(partitions)
            self.offsets.forget(partitions)
            self._revoked_meanwhile |= partitions
            self._show_held(self.former.models())
            self._check_room()
        log.info(
            "batcher %s gave up partitions %s (%d held requests go to their new owner)",
            self.settings.batcher_id,
            sorted(partitions),
            len(dropped),
        )

    # reading -----------------------------------------------------------------------------------
    async def _consume_loop(self) -> None:
        settings = self.settings
        while True:
            await self._room.wait()
            records = await self._retry(
                "reading requests", lambda: self.consumer.fetch(settings.fetch_timeout_s, settings.fetch_max_records)
            )
            if records:
                records, tokens = await self._count(records)
                unknown = self._accept(records, tokens)
                if unknown:
                    await self._fail_unknown(unknown)

    async def _count(
        self, records: Sequence[Delivered[InferenceRequest]]
    ) -> tuple[Sequence[Delivered[InferenceRequest]], list[int]]:
        """The records still this batcher's, and each one's tokens for the budget (1 without one),
        counted on a thread: a fetch of long inputs takes a while to tokenize, and the loop serves the
        dispatch (and, embedded, the gateway) meanwhile. A partition revoked meanwhile committed below
        its records in hand, so its new owner reads them again: they are left out."""
        if self._count_tokens is None:
            return records, [1] * len(records)
        texts = [record.value.input if record.value is not None else "" for record in records]
        self._revoked_meanwhile.clear()
        tokens = await asyncio.to_thread(lambda: [self._tokens(text) for text in texts])
        if not self._revoked_meanwhile:
            return records, tokens
        kept = [(r, n) for r, n in zip(records, tokens, strict=True) if r.partition not in self._revoked_meanwhile]
        return [record for record, _ in kept], [n for _, n in kept]

    def _accept(
        self, records: Sequence[Delivered[InferenceRequest]], tokens: Sequence[int]
    ) -> list[Delivered[InferenceRequest]]:
        """Feeds the accumulators (``tokens``: each request's, ``_count``); returns the requests for
        models this deployment does not serve."""
        now_s = self.clock()
        now_ms = wall_ms()
        touched: set[str] = set()
        unknown: list[Delivered[InferenceRequest]] = []
        for record, length in zip(records, tokens, strict=True):
            request = record.value
            self.offsets.read(record.partition, record.offset)
            if request is None:
                self.offsets.finish(record.partition, record.offset)
                self._commit_soon()
                continue
            if self.settings.models and request.model not in self.settings.models:
                # No worker will ever take it: holding it would pin its partition's commit point
                # until its deadline. (Gateways reject unknown models; this guards other producers.)
                unknown.append(record)
                continue
            if length > self.settings.policy.max_batch_tokens > 0 and request.model not in self._over_budget_told:
                self._warn_over_budget(request, length)
            self.former.add(request.model, self._pending(request, record, now_s, now_ms, length))
            touched.add(request.model)
        for model in touched:
            self.dispatcher.arrived(model)
        self._show_held(touched)
        self._timer_wake.set()
        self._check_room()
        return unknown

    def _warn_over_budget(self, request: InferenceRequest, tokens: int) -> None:
        """An input over the budget reached the batcher: a gateway without the same budget admitted it, and
        it runs alone past the budget (``within_budget``). Said once per model, naming the settings to align."""
        self._over_budget_told.add(request.model)
        log.warning(
            "request %s of model %s is %d tokens, over --max-batch-tokens (BATCHWIRE_MAX_BATCH_TOKENS) %d: it "
            "runs in a batch of its own, past the budget; give every gateway the batchers' --max-batch-tokens "
            "and --tokenizer, so that they refuse such inputs (413). Logged once per model",
            request.task_id,
            request.model,
            tokens,
            self.settings.policy.max_batch_tokens,
            extra=ids(task_id=request.task_id),
        )

    def _show_held(self, models: Iterable[str]) -> None:
        """``batchwire_batcher_pending`` (the fleet's queue column) after requests came or went."""
        for model in models:
            metrics.PENDING.labels(model=model).set(self.former.held(model))

    def _requeued(self) -> None:
        """A refused send put requests back: the timer counts their deadlines again, and the reader
        holds them against ``max_held`` again."""
        self._timer_wake.set()
        self._check_room()

    def _check_room(self) -> None:
        held = sum(self.former.held(model) for model in self.former.models()) + len(self._expiring)
        if held < self.settings.max_held:
            self._room.set()
        else:
            self._room.clear()

    def _pending(
        self, request: InferenceRequest, record: Delivered[InferenceRequest], now_s: float, now_ms: int, tokens: int
    ) -> Pending[InferenceRequest]:
        deadline_s = now_s + (request.deadline_ms - now_ms) / 1000.0
        arrived_s = now_s - max(0, now_ms - request.enqueued_at_ms) / 1000.0
        return Pending(
            request,
            record.partition,
            record.offset,
            arrived_s,
            deadline_s,
            rank=request.priority.rank,
            read_s=now_s,
            tokens=tokens,
            size_bytes=item_bytes(request),
        )

    def _tokens(self, text: str) -> int:
        """The input's tokens; the estimate for one the tokenizer cannot read (the gateway refused
        those from its callers; the backend fails one that comes from elsewhere, alone)."""
        assert self._count_tokens is not None
        try:
            return self._count_tokens(text)
        except ValueError:
            return estimated(text)

    async def _fail_unknown(self, records: list[Delivered[InferenceRequest]]) -> None:
        failed = states.unknown_model(
            (r.value for r in records if r.value is not None), self.settings.models, wall_ms()
        )
        await self._store_ended(failed, f"failing {len(failed)} request(s) for unknown models")
        async with self._handover:
            for record in records:
                self.offsets.finish(record.partition, record.offset)
        self._commit_soon()  # not awaited under the lock: a slow commit would hold up every send

    # timers ------------------------------------------------------------------------------------
    async def _timer_loop(self) -> None:
        while True:
            due = self.former.next_due_s()
            self._timer_wake.clear()
            timeout = None if due is None else max(0.0, due - self.clock())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._timer_wake.wait()
            for model in self.former.tick():
                self.dispatcher.wake(model)
            self._end_expired(self.former.expire())

    # finishing ---------------------------------------------------------------------------------
    def _handed_over(self, items: Sequence[Pending[InferenceRequest]]) -> None:
        """The dispatcher's batch holding ``items`` is on the bus (Kafka acknowledged it)."""
        for pending in items:
            self._finish(pending)
        self._commit_soon()

    def _end_expired(self, expired: list[Pending[InferenceRequest]]) -> None:
        """Hands requests whose deadline passed (taken out of the ``BatchFormer``) to ``_expiry_loop``."""
        if expired:
            self._expiring.extend(expired)
            self._expiring_added.set()

    async def _expiry_loop(self) -> None:
        """Stores the end of the requests that expired while held, in a loop of its own: a slow store
        (or a lagging Redis replica) holds up neither the timer that seals batches nor a dispatch."""
        while True:
            await self._expiring_added.wait()
            self._expiring_added.clear()
            if self._expiring:
                await self._expire(len(self._expiring))

    async def _expire(self, count: int) -> None:
        """Ends the first ``count`` expiring requests; their offsets are done once that is stored."""
        expired = self._expiring[:count]
        ended = states.expired((pending.item for pending in expired), wall_ms())
        await self._store_ended(ended, f"storing {len(ended)} expired task(s)")
        del self._expiring[:count]
        for pending in expired:
            self._finish(pending)
        self._show_held({pending.item.model for pending in expired})
        self._check_room()
        # Committed now, not with the next batch: the queue depth gateways admit by counts what is
        # uncommitted, and a quiet model holding only ended requests would look stalled.
        self._commit_soon()

    async def _store_ended(self, ended: list[TaskState], what: str) -> None:
        """Stores the end states of requests the batcher ends, on enough Redis replicas when it waits
        for them; their offsets are finished only after this returns (a close cancels it: uncommitted)."""
        if self.replicas is None:
            await self._retry(what, lambda: self.store.apply(ended))
        else:
            await self.replicas.store_results(ended, give_up=lambda: False, stopping=lambda: False, what=what)

    def _finish(self, pending: Pending[InferenceRequest]) -> None:
        """The request is on Kafka in a batch, or ended: its offset may be committed."""
        self.offsets.finish(pending.partition, pending.offset)

    async def _retry(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """``op`` until it works; raises only an error that retrying cannot fix (or a cancellation)."""
        return await retry(log, f"batcher {self.settings.batcher_id}", what, op, self.settings.retry_max_s)

    # commits -----------------------------------------------------------------------------------
    def _commit_soon(self) -> None:
        """Commits in a task of its own, so the next hand-over need not wait for the round trip
        (committing what is finished is safe at any time: those requests are on Kafka in batches).
        Requests coalesce: one commit in flight, and one more after it if anything finished meanwhile."""
        self._commit_wanted = True
        if self._committer is None or self._committer.done():
            self._committer = self._spawn(self._commit_while_wanted(), "batcher-commit")

    async def _commit_while_wanted(self) -> None:
        """A commit that failed (the group's coordinator moving) is tried again after a pause, not left
        for the next hand-over: on a quiet model there may be none, and the gateways would count the
        requests it handed over as still queued. A close commits once more itself."""
        failures = 0
        while self._commit_wanted:
            self._commit_wanted = False
            failed = await self._try_commit()
            if failed is None:
                failures = 0
                continue
            if not failed.retriable:
                log.warning("offset commit failed (%s); those requests may be read again", failed)
                return
            if self._closing:
                return  # the close commits once more itself
            failures += 1
            who, max_s = f"batcher {self.settings.batcher_id}", self.settings.retry_max_s
            self._commit_pausing = True
            try:
                await pause(log, who, "committing request offsets", failed, failures, max_s)
            finally:
                self._commit_pausing = False
            self._commit_wanted = not self._closing

    async def _commit(self) -> None:
        if (failed := await self._try_commit()) is not None:
            log.warning("offset commit failed (%s); those requests may be read again", failed)

    async def _try_commit(self) -> TransportError | None:
        """Commits what is finished; the error when the commit failed (those requests may be read again)."""
        offsets = self.offsets.committable()
        if not offsets:
            return None
        try:
            await self.consumer.commit(offsets)
        except TransportError as err:
            return err
        self.offsets.committed(offsets)
        return None
