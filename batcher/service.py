"""The batcher: reads requests, forms batches with ``BatchFormer``, hands each to an idle worker.

Dispatch is credit-based. An idle worker offers one credit naming its batch-topic partition; a
model's dispatcher claims a credit only when it has something to send, and sends exactly one batch
against it. So a batch always goes to a worker that is idle right now, never queues behind a busy
one, and the first worker to free up gets the next batch, whichever batcher holds it.

Kafka or Redis going away stops no loop: reads, claims and expiry writes are retried with backoff
until they work (a failed send is given back and tried again; a failed ``batched`` write is only
logged, the worker's writes follow). Only an error that retrying cannot fix ends a loop, and a
loop that ends sets ``failed`` so the process exits non-zero instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from batcher.express import ExpressLedger, Record
from batcher.offsets import OffsetTracker
from batcher.policy import BatchFormer, Pending, Taken
from batcher.read_pacing import ReadPacing
from batcher.settings import BatcherSettings
from batcher.spacing import Spacing
from schemas.records import Batch, BatchItem, Credit, InferenceRequest, TaskState, TaskStatus
from telemetry import metrics
from transport.ports import (
    UNKNOWN,
    BatchProducer,
    CreditPool,
    Delivered,
    RequestConsumer,
    TaskStore,
    TransportError,
)
from transport.retry import retry
from transport.routing import Partitioner

log = logging.getLogger(__name__)

T = TypeVar("T")

CATCH_UP_MIN_S = 0.002


def wall_ms() -> int:
    return int(time.time() * 1000)


class Batcher:
    def __init__(
        self,
        settings: BatcherSettings,
        consumer: RequestConsumer,
        producer: BatchProducer,
        credits: CreditPool,
        store: TaskStore,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.consumer = consumer
        self.producer = producer
        self.credits = credits
        self.store = store
        self.clock = clock
        self.former: BatchFormer[InferenceRequest] = BatchFormer(settings.policy, clock)
        self.offsets = OffsetTracker()
        self.express: ExpressLedger[InferenceRequest] = ExpressLedger()
        self._commit_wanted = False
        self._committer: asyncio.Task[None] | None = None
        self._wake: dict[str, asyncio.Event] = {}
        self._timer_wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._handover = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._dispatchers: dict[str, asyncio.Task[None]] = {}
        self._own_partitions: dict[str, frozenset[int]] = {}
        if settings.request_partitions > 0:
            partitioner = Partitioner(settings.models, settings.request_partitions)
            self._own_partitions = {m: frozenset(partitioner.partitions_for(m)) for m in settings.models}
        self._keep_after: dict[str, float] = {}
        self._spacing: defaultdict[str, Spacing] = defaultdict(Spacing)
        self._pacing = ReadPacing(settings.read_pace_ms / 1000)
        self._claiming: set[str] = set()
        """Models whose dispatcher waits for a credit, holding requests: all of their workers are busy."""
        self._stopping = False
        self.failure: BaseException | None = None
        self.failed = asyncio.Event()
        """Set when a background loop crashed: the process supervisor should exit."""
        self.batches_sent = 0

    # lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.consumer.start(self._on_assigned, self._on_revoked)
        self._tasks = [
            asyncio.create_task(self._guard(self._consume_loop()), name="batcher-consume"),
            asyncio.create_task(self._guard(self._timer_loop()), name="batcher-timer"),
        ]

    async def close(self) -> None:
        """Stops reading, lets an in-flight hand-over finish, commits it, and leaves the group.

        Whatever is still held (not handed to a worker) was never committed, so the batcher that
        takes over the partitions reads it again: handed back, not lost.
        """
        self._stopping = True
        tasks = [*self._tasks, *self._dispatchers.values()]
        async with self._handover:
            for task in tasks:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._dispatchers.clear()
        if self._committer is not None:
            await asyncio.gather(self._committer, return_exceptions=True)
        await self._commit()
        await self.consumer.close()

    async def _guard(self, loop: object) -> None:
        """Runs a background loop; a crash is recorded and logged, never silent."""
        assert asyncio.iscoroutine(loop)
        try:
            await loop
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            self.failure = err
            self.failed.set()
            log.exception("batcher loop crashed; the batcher is no longer serving")
            raise

    def healthy(self) -> bool:
        return self.failure is None and all(not t.done() for t in self._tasks)

    # rebalance ---------------------------------------------------------------------------------
    async def _on_assigned(self, partitions: frozenset[int]) -> None:
        log.info("batcher %s assigned request partitions %s", self.settings.batcher_id, sorted(partitions))

    async def _on_revoked(self, partitions: frozenset[int]) -> None:
        async with self._handover:
            await self._commit()
            dropped = self.former.drop_partitions(partitions)
            self.offsets.forget(partitions)
            self.express.drop(partitions)
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
                unknown = self._accept(records)
                if unknown:
                    await self._fail_unknown(unknown)
            await self._pacing.after_read(self._all_busy())

    def _all_busy(self) -> bool:
        """Whether every served model's dispatcher waits for a credit (see ``batcher.read_pacing``):
        a model with an idle worker sends a request the moment it is read."""
        served = self.settings.models or self._dispatchers.keys()
        return bool(self._claiming) and all(model in self._claiming for model in served)

    def _accept(self, records: Sequence[Delivered[InferenceRequest]]) -> list[Delivered[InferenceRequest]]:
        """Feeds the accumulators; returns the requests for models this deployment does not serve."""
        now_s = self.clock()
        now_ms = wall_ms()
        touched: set[str] = set()
        unknown: list[Delivered[InferenceRequest]] = []
        for record in records:
            request = record.value
            if record.via == "express":  # a copy ahead of its Kafka record (transport.express.copies)
                if request is None or (self.settings.models and request.model not in self.settings.models):
                    continue  # its record is handled when it comes
                pending = self._pending(request, record, now_s, now_ms)
                if self.express.copy(request.task_id, pending):
                    self.former.add(request.model, pending)
                    touched.add(request.model)
                continue
            self.offsets.read(record.partition, record.offset)
            if request is None:
                self.offsets.finish(record.partition, record.offset)
                continue
            matched = self.express.record(request.task_id, record.partition, record.offset)
            if matched is Record.DONE:
                self.offsets.finish(record.partition, record.offset)
                self._commit_soon()  # its express copy was handed over already
                continue
            if matched is Record.HELD:
                continue
            if self.settings.models and request.model not in self.settings.models:
                # No worker will ever take it: holding it would pin its partition's commit point
                # until its deadline. (Gateways reject unknown models; this guards other producers.)
                unknown.append(record)
                continue
            self.former.add(request.model, self._pending(request, record, now_s, now_ms))
            touched.add(request.model)
        for model in touched:
            self._ensure_dispatcher(model)
            if self.former.ready(model):
                self._wake[model].set()
            metrics.PENDING.labels(model=model).set(self.former.held(model))
        self._timer_wake.set()
        if sum(self.former.held(m) for m in self.former.models()) >= self.settings.max_held:
            self._room.clear()
        return unknown

    @staticmethod
    def _pending(
        request: InferenceRequest, record: Delivered[InferenceRequest], now_s: float, now_ms: int
    ) -> Pending[InferenceRequest]:
        deadline_s = now_s + (request.deadline_ms - now_ms) / 1000.0
        arrived_s = now_s - max(0, now_ms - request.enqueued_at_ms) / 1000.0
        return Pending(request, record.partition, record.offset, arrived_s, deadline_s)

    def _finish(self, pending: Pending[InferenceRequest]) -> None:
        """The request is on Kafka in a batch, or ended: its offset may be committed."""
        if pending.offset == UNKNOWN:  # a copy whose Kafka record has not come
            self.express.finished(pending.item.task_id)
        else:
            self.offsets.finish(pending.partition, pending.offset)

    async def _fail_unknown(self, records: list[Delivered[InferenceRequest]]) -> None:
        now = wall_ms()
        states = [
            TaskState(
                r.value.task_id,
                TaskStatus.FAILED,
                r.value.model,
                now,
                r.value.enqueued_at_ms,
                error_code="unknown_model",
                error_message=f"model {r.value.model!r} is not served here (served: {', '.join(self.settings.models)})",
                reply_to=r.value.reply_to,
            )
            for r in records
            if r.value is not None
        ]
        await self._retry(f"failing {len(states)} request(s) for unknown models", lambda: self.store.apply(states))
        async with self._handover:
            for record in records:
                self.offsets.finish(record.partition, record.offset)
            await self._commit()

    def _ensure_dispatcher(self, model: str) -> None:
        if model not in self._dispatchers:
            self._wake[model] = asyncio.Event()
            self._dispatchers[model] = asyncio.create_task(
                self._guard(self._dispatch_loop(model)), name=f"batcher-dispatch-{model}"
            )

    # timers ------------------------------------------------------------------------------------
    async def _timer_loop(self) -> None:
        while True:
            due = self.former.next_due_s()
            self._timer_wake.clear()
            timeout = None if due is None else max(0.0, due - self.clock())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._timer_wake.wait(), timeout)
            for model in self.former.tick():
                self._wake[model].set()
            expired = self.former.expire()
            if expired:
                await self._expire(expired)

    # dispatch ----------------------------------------------------------------------------------
    async def _dispatch_loop(self, model: str) -> None:
        kept: Credit | None = None
        try:
            while True:
                if not self.former.ready(model):
                    kept = await self._idle(model, kept)
                    continue
                claimed_from_s: float | None = None  # a kept credit was there before the items
                credit, kept = kept, None
                if credit is None:
                    claimed_from_s = self.clock()
                    pauses = self._pacing.pauses
                    self._claiming.add(model)
                    try:
                        credit = await self._claim(model)
                    finally:
                        self._claiming.discard(model)
                    if credit is None:
                        continue
                    await self._pacing.catch_up(pauses, self._catch_up_limit_s(credit))
                metrics.IDLE_WORKERS.labels(model=model).set(0)
                hold_s = self.former.reserve_s(model, credit.busy_ms / 1000.0, claimed_from_s)
                if hold_s > 0:
                    credit = await self._hold(model, credit, hold_s)
                elif self.settings.spacing_margin_ms >= 0 and self._alone(model):
                    await self._space(model, credit)
                await self._send(model, credit)
        finally:
            if kept is not None:
                await self._offer_back(kept)

    def _catch_up_limit_s(self, credit: Credit) -> float:
        """A catch-up may use the time until the credit's worker frees, less the batch's way there,
        and a little of an idle worker's (it ends sooner: the first read brings what waited)."""
        travel_s = max(0.0, self.settings.spacing_margin_ms) / 1000
        return min(self._pacing.pace_s, max(CATCH_UP_MIN_S, self._starts_in_s(credit) - travel_s))

    async def _claim(self, model: str) -> Credit | None:
        return await self._retry(
            f"claiming a credit for {model}", lambda: self.credits.claim(model, self.settings.claim_timeout_s)
        )

    async def _idle(self, model: str, kept: Credit | None) -> Credit | None:
        """Waits until ``model`` has something to send; returns the credit kept in hand meanwhile.

        Only a batcher that owns all of the model's request partitions keeps one (see
        ``BatcherSettings.request_partitions``), and not for long: the credit goes back to the pool
        well before its worker would renew it.
        """
        wake = self._wake[model]
        wake.clear()
        if kept is None and self._may_keep(model):
            kept = await self._claim(model)  # blocks while every worker is busy, like any claim
            if kept is None or self.former.ready(model):
                return kept
            starts_in_s = self._starts_in_s(kept)
            if starts_in_s > 0:  # a busy worker's early credit: an idle one may come first
                self._keep_after[model] = self.clock() + starts_in_s
                await self._offer_back(kept)
                kept = None
        if kept is None:
            await wake.wait()
            return None
        keep_s = min(self.settings.keep_credit_s, (kept.expires_at_ms - wall_ms()) / 4000.0)
        try:
            async with asyncio.timeout(keep_s):
                await wake.wait()
            return kept
        except TimeoutError:
            self._keep_after[model] = self.clock() + 0.1  # a credit near its renewal is not taken again at once
            await self._offer_back(kept)
            return None

    def _may_keep(self, model: str) -> bool:
        return (
            self.settings.keep_credit_s > 0
            and self._alone(model)
            and self.clock() >= self._keep_after.get(model, float("-inf"))
        )

    def _alone(self, model: str) -> bool:
        """Whether this batcher owns all of ``model``'s request partitions: no other sends to its workers."""
        owned = self._own_partitions.get(model)
        return owned is not None and owned <= self.consumer.assignment()

    def _starts_in_s(self, credit: Credit) -> float:
        """How long until the credit's worker is free (0 for an idle one)."""
        return max(0, credit.frees_at_ms - wall_ms()) / 1000.0

    async def _space(self, model: str, credit: Credit) -> None:
        """Seals the batch for a busy worker late enough to keep the workers' starts spread (see
        ``batcher.spacing``); a batch that fills up, or a deadline, ends the wait early."""
        starts_in_s = self._starts_in_s(credit)
        if starts_in_s <= 0:
            return  # an idle worker: never kept waiting
        now = self.clock()
        start_s = now + starts_in_s
        due_s = self._spacing[model].due_s(credit.worker_id, start_s, credit.busy_ms / 1000.0)
        until_s = due_s - self.settings.spacing_margin_ms / 1000.0
        if due_s <= start_s or until_s <= now:
            return
        metrics.SPACING_WAIT.labels(model=model).observe(until_s - now)
        wake = self._wake[model]
        while not self.former.sealed(model) and (left_s := until_s - self.clock()) > 0:
            wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left_s):
                    await wake.wait()

    async def _hold(self, model: str, credit: Credit, hold_s: float) -> Credit:
        """Keeps an idle worker in reserve for a fresh arrival (see ``BatchFormer.reserve_s``).

        Returns the credit to send what waits against: this one when a fresh request arrives or the
        hold runs out, or a second worker's if it frees first (this one then goes back to the pool,
        idle, for the next arrival).
        """
        wake = self._wake[model]
        wake.clear()
        arrival = asyncio.create_task(wake.wait())
        second = asyncio.create_task(self.credits.claim(model, hold_s))
        try:
            await asyncio.wait({arrival, second}, timeout=hold_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            arrival.cancel()
            if not second.done():
                second.cancel()
            await asyncio.gather(arrival, second, return_exceptions=True)
        other = second.result() if second.done() and not second.cancelled() and second.exception() is None else None
        if other is None:
            return credit
        await self._offer_back(credit)
        return other

    async def _send(self, model: str, credit: Credit) -> None:
        expired: list[Pending[InferenceRequest]] = []
        await self._send_locked(model, credit, expired)
        if expired:  # written outside the hand-over lock: a slow store must not hold up a rebalance
            await self._expire(expired)

    async def _send_locked(self, model: str, credit: Credit, expired: list[Pending[InferenceRequest]]) -> None:
        async with self._handover:
            taken = self.former.take(model, credit.max_batch)
            expired.extend(taken.expired)
            if not taken.items:
                await self._offer_back(credit)
                return
            batch = self._batch(model, taken, credit)
            # "batched" is written while Kafka takes the batch: a Redis write is faster than the
            # hand-over to the worker, so watchers see batched before running.
            marking = asyncio.create_task(self._mark_batched(model, batch))
            try:
                try:
                    await self.producer.send(batch, credit.partition)
                except TransportError as err:
                    log.warning("could not hand batch %s to %s: %s; will retry", batch.batch_id, credit.worker_id, err)
                    self.former.give_back(model, taken)
                    await self._offer_back(credit)
                    await asyncio.sleep(self.settings.send_retry_s)  # back off a failing bus, then try again
                    return
                for pending in taken.items:
                    self._finish(pending)
                starts_at_s = self.clock() + self._starts_in_s(credit)
                self._spacing[model].started(credit.worker_id, starts_at_s, credit.busy_ms / 1000.0)
                self.batches_sent += 1
                self._record(model, batch, taken)
                self._commit_soon()
            finally:
                await asyncio.gather(marking, return_exceptions=True)
        if self.former.held(model) < self.settings.max_held:
            self._room.set()

    async def _mark_batched(self, model: str, batch: Batch) -> None:
        now = wall_ms()
        batched = [
            TaskState(
                item.task_id,
                TaskStatus.BATCHED,
                model,
                now,
                item.enqueued_at_ms,
                batch_id=batch.batch_id,
                batch_size=len(batch.items),
                reply_to=item.reply_to,
            )
            for item in batch.items
        ]
        try:
            await self.store.apply(batched)
        except TransportError as err:  # informational: the worker's running/completed writes follow
            log.warning("could not mark batch %s's %d tasks batched: %s", batch.batch_id, len(batched), err)

    def _batch(self, model: str, taken: Taken[InferenceRequest], credit: Credit) -> Batch:
        reason = taken.reason.value if taken.reason is not None else "idle_worker"
        return Batch(
            batch_id=uuid.uuid4().hex,
            model=model,
            batcher_id=self.settings.batcher_id,
            created_at_ms=wall_ms(),
            flush_reason=reason,
            credit=credit.ref,
            items=tuple(BatchItem.of(p.item) for p in taken.items),
        )

    def _record(self, model: str, batch: Batch, taken: Taken[InferenceRequest]) -> None:
        metrics.FLUSHES.labels(model=model, reason=batch.flush_reason).inc()
        metrics.BATCH_SIZE.labels(model=model).observe(len(batch.items))
        wait = metrics.QUEUE_WAIT.labels(model=model)
        now = self.clock()
        for pending in taken.items:
            wait.observe(max(0.0, now - pending.arrived_s))
        metrics.PENDING.labels(model=model).set(self.former.held(model))

    async def _offer_back(self, credit: Credit) -> None:
        """Returns an unused credit; if that fails the worker re-offers it when it expires."""
        try:
            await self.credits.offer(credit)
        except TransportError as err:
            log.warning("could not hand back credit %s: %s (its worker re-offers it)", credit.ref, err)

    async def _retry(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """``op`` until it works; raises only an error that retrying cannot fix (or a cancellation)."""
        return await retry(log, f"batcher {self.settings.batcher_id}", what, op, self.settings.retry_max_s)

    async def _expire(self, expired: list[Pending[InferenceRequest]]) -> None:
        """Ends held requests whose deadline passed; their offsets are done once that is stored."""
        now = wall_ms()
        states = []
        for pending in expired:
            request = pending.item
            states.append(
                TaskState(
                    request.task_id,
                    TaskStatus.EXPIRED,
                    request.model,
                    now,
                    request.enqueued_at_ms,
                    error_code="deadline_exceeded",
                    error_message="the request's deadline passed before a GPU worker could take it; "
                    "retry, or send a longer timeout_ms",
                    reply_to=request.reply_to,
                )
            )
            metrics.TASKS_ENDED.labels(model=request.model, status="expired").inc()
        await self._retry(f"storing {len(states)} expired task(s)", lambda: self.store.apply(states))
        for pending in expired:
            self._finish(pending)

    def _commit_soon(self) -> None:
        """Commits in a task of its own, so the next hand-over need not wait for the round trip
        (committing what is finished is safe at any time: those requests are on Kafka in batches).
        Requests coalesce: one commit in flight, and one more after it if anything finished meanwhile."""
        self._commit_wanted = True
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._guard(self._commit_while_wanted()), name="batcher-commit")

    async def _commit_while_wanted(self) -> None:
        while self._commit_wanted:
            self._commit_wanted = False
            await self._commit()

    async def _commit(self) -> None:
        offsets = self.offsets.committable()
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except TransportError as err:
            log.warning("offset commit failed (%s); those requests may be read again", err)
            return
        self.offsets.committed(offsets)
