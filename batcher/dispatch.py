"""Dispatch: each model's held requests go to idle workers, one batch per claimed credit.

An idle worker offers one credit naming its batch-topic partition; a model's dispatch loop claims a
credit only when it has something to send, and sends exactly one batch against it. So a batch
always goes to a worker that is idle right now, never queues behind a busy one, and the first
worker to free up gets the next batch, whichever batcher holds it.

What to do with a claimed credit is ``batcher.scheduler``'s decision: send at once, hold an idle
worker in reserve for a fresh arrival at light load (``--reserve-ms``), or, in a batcher that alone
serves a model, seal a busy worker's batch late enough to keep the workers' calls spread
(``--spacing-margin-ms``). Where the loop stands is pure code too (``batcher.scheduler.DispatchLoop``):
this module carries out its commands.

A sealed batch lands on the bus in a task of its own (``_land``): the loop goes on to the next credit
(another worker's) without waiting for the acknowledgement (``acks=all`` over Kafka), which hands its
requests over. A failed claim is retried with backoff; a failed send is given back and tried again
after a pause, its credit queued behind the others for that pause; a failed ``batched`` write is logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from batcher import states
from batcher.policy import BatchFormer, Pending, Taken
from batcher.scheduler import Claim, Claimed, Command, DispatchLoop, Hold, Scheduler, Send, Space
from batcher.settings import BatcherSettings
from batcher.states import wall_ms
from schemas.records import Batch, BatchItem, Credit, InferenceRequest, TaskState
from telemetry import metrics, tracing
from telemetry.logs import ids
from telemetry.spans import BatchSpans
from transport.cancelling import cancel_and_wait
from transport.ports import BatchProducer, CreditPool, TaskStore, TransportError
from transport.retry import retry
from transport.routing import Partitioner

log = logging.getLogger(__name__)

Held = Pending[InferenceRequest]


class Landings:
    """The batches on their way to the bus, and the unused credits on their way back to the pool: the
    tasks that carry them, owned and awaited here. How many land at once needs no cap of its own:
    each holds a credit, and a worker offers its next credit only after a batch reached it."""

    def __init__(self) -> None:
        self._tasks: defaultdict[str, set[asyncio.Task[None]]] = defaultdict(set)

    def add(self, key: str, task: asyncio.Task[None]) -> None:
        tasks = self._tasks[key]
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def under_way(self, key: str | None = None) -> int:
        """How many tasks (of ``key``, or of every key) are under way."""
        if key is not None:
            return len(self._tasks[key])
        return sum(len(tasks) for tasks in self._tasks.values())

    async def landed(self) -> None:
        """Returns once every batch started so far is on the bus or given back (landings started
        meanwhile included)."""
        while self.under_way():
            await asyncio.gather(*self._all(), return_exceptions=True)

    def _all(self) -> set[asyncio.Task[None]]:
        return set[asyncio.Task[None]]().union(*self._tasks.values())


class Dispatcher:
    """Runs one loop per model that sends its ready batches to idle workers against claimed credits.

    The ``Batcher`` owns it: the batcher feeds the ``BatchFormer`` and says when a model has
    something (``arrived``, ``wake``); the dispatcher tells it what was handed over (``handed_over``)
    or ended (``expire``).
    """

    def __init__(
        self,
        settings: BatcherSettings,
        former: BatchFormer[InferenceRequest],
        credits: CreditPool,
        producer: BatchProducer,
        store: TaskStore,
        *,
        handover: asyncio.Lock,
        freed: Callable[[], None],
        requeued: Callable[[], None],
        assignment: Callable[[], frozenset[int]],
        handed_over: Callable[[Sequence[Held]], None],
        expire: Callable[[list[Held]], None],
        spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.former = former
        self.credits = credits
        self.producer = producer
        self.store = store
        self.clock = clock
        self._handover = handover
        self._freed = freed
        """Told after a send took held requests: the reader may read again."""
        self._requeued = requeued
        """Told after a refused send put its requests back: the timer that ends held requests at their
        deadlines looks at them again (it last looked while they were on their way)."""
        self._assignment = assignment
        self._handed_over = handed_over
        self._expire = expire
        self._spawn = spawn
        self._loops: dict[str, asyncio.Task[None]] = {}
        self._wake: dict[str, asyncio.Event] = {}
        margin_s = settings.spacing_margin_ms / 1000.0 if settings.spacing_margin_ms >= 0 else None
        self.scheduler = Scheduler(former, clock, margin_s)
        self._own_partitions: dict[str, frozenset[int]] = {}
        if settings.request_partitions > 0:
            partitioner = Partitioner(settings.models, settings.request_partitions)
            self._own_partitions = {m: frozenset(partitioner.partitions_for(m)) for m in settings.models}
        self.landings = Landings()
        """Batches sealed and on their way to the bus (``_land``)."""
        self._resend_after: dict[str, float] = {}
        self.batches_sent = 0

    # the batcher's side ------------------------------------------------------------------------
    def arrived(self, model: str) -> None:
        """``model`` holds new requests: starts its loop if it has none, wakes it if a batch is ready."""
        if model not in self._loops:
            self._wake[model] = asyncio.Event()
            self._loops[model] = self._spawn(self._loop(model), f"batcher-dispatch-{model}")
        if self.former.ready(model):
            self._wake[model].set()

    def wake(self, model: str) -> None:
        """A timer sealed ``model``'s batch."""
        self._wake[model].set()

    def cancel(self) -> None:
        """Cancels every loop (the caller holds the hand-over lock: no send is cut in half)."""
        for loop in self._loops.values():
            loop.cancel()

    async def cancelled(self) -> None:
        """Waits for the cancelled loops to end, then for the
        batches they sent to land: a batch whose worker may run it already is not cut off its bus."""
        await asyncio.gather(*(cancel_and_wait(loop) for loop in self._loops.values()))
        self._loops.clear()
        await self.landings.landed()

    # the loop ----------------------------------------------------------------------------------
    async def _loop(self, model: str) -> None:
        """Carries out ``model``'s ``DispatchLoop`` commands, reporting back what happened."""
        loop = DispatchLoop[Credit](self.scheduler, model)
        try:
            await self._drive(model, loop)
        except asyncio.CancelledError:
            if (held := loop.release()) is not None:
                self._give_back(model, held)  # the batcher closes: the worker is not kept from the others
            raise

    async def _drive(self, model: str, loop: DispatchLoop[Credit]) -> None:
        wake = self._wake[model]
        command = await self._poke(model, loop)
        while True:
            if isinstance(command, Claim):
                credit = await self._claim(model)
                if credit is None:
                    loop.unclaimed()
                    command = await self._poke(model, loop)
                    continue
                command = loop.claimed(credit, self._claimed(credit), alone=self.alone(model))
                if isinstance(command, Space):
                    metrics.SPACING_WAIT.labels(model=model).observe(max(0.0, command.until_s - self.clock()))
            elif isinstance(command, Hold):
                command = await self._hold(model, loop, command.until_s)
            elif isinstance(command, Space):
                command = await self._wait(model, loop, command.until_s)
            elif isinstance(command, Send):
                if command.back is not None:
                    self._give_back(model, command.back)
                await self._send(model, loop, command.credit)
                command = await self._poke(model, loop)
            else:
                wake.clear()  # no await since ``poke`` found nothing ready: ``arrived`` sets it only for a ready model
                await wake.wait()
                command = await self._poke(model, loop)

    async def _poke(self, model: str, loop: DispatchLoop[Credit]) -> Command[Credit]:
        """``loop.poke()``, once the bus has had its moment after a failed send."""
        if (pause_s := self._resend_after.pop(model, 0.0) - self.clock()) > 0:
            await asyncio.sleep(pause_s)
        return loop.poke()

    async def _claim(self, model: str) -> Credit | None:
        """A credit for ``model``, retried while the pool is unreachable (None: none came in time)."""
        return await retry(
            log,
            f"batcher {self.settings.batcher_id}",
            f"claiming a credit for {model}",
            lambda: self.credits.claim(model, self.settings.claim_timeout_s),
            self.settings.retry_max_s,
        )

    # spacing and reserve -----------------------------------------------------------------------
    def alone(self, model: str) -> bool:
        """Whether this batcher owns all of ``model``'s request partitions: no other sends to its workers."""
        owned = self._own_partitions.get(model)
        return owned is not None and owned <= self._assignment()

    def _claimed(self, credit: Credit) -> Claimed:
        """The credit as the scheduler sees it: its worker's idle time moved onto this batcher's clock."""
        free_s = self.clock() + (credit.idle_from_ms - wall_ms()) / 1000.0
        return Claimed(credit.worker_id, free_s, credit.busy_ms / 1000.0)

    async def _woken(self, wake: asyncio.Event, until_s: float) -> bool:
        """Whether ``wake`` (an arrival, or a timer that sealed the batch) came before ``until_s``. The
        caller clears it first, with no await since it last asked the ``DispatchLoop``."""
        try:
            async with asyncio.timeout(until_s - self.clock()):
                await wake.wait()
        except TimeoutError:
            return False
        return True

    async def _wait(self, model: str, loop: DispatchLoop[Credit], until_s: float) -> Command[Credit]:
        """Spacing: waits to seal a busy worker's batch until ``until_s`` (see ``Spacing``)."""
        wake = self._wake[model]
        wake.clear()
        return loop.poke() if await self._woken(wake, until_s) else loop.woke()

    async def _hold(self, model: str, loop: DispatchLoop[Credit], until_s: float) -> Command[Credit]:
        """Keeps an idle worker in reserve (see ``BatchFormer.reserve_s``) while claiming a second
        credit: a fresh arrival, a second worker that frees first, or the end of the hold ends it."""
        wake = self._wake[model]
        wake.clear()
        woken = asyncio.create_task(self._woken(wake, until_s))
        second = asyncio.create_task(self.credits.claim(model, max(0.0, until_s - self.clock())))
        try:
            try:
                await asyncio.wait({woken, second}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                woken.cancel()
                second.cancel()
                # even cancelled again (a closing batcher's cancel_and_wait), gather ends only once both
                # have: ``second`` is done below, and a credit it got is not lost
                await asyncio.gather(woken, second, return_exceptions=True)
        except asyncio.CancelledError:
            if (other := _credit_of(second)) is not None:
                self._give_back(model, other)  # the batcher closes: a second credit claimed meanwhile goes back
            raise
        if (other := _credit_of(second)) is not None:
            return loop.second(other, self._claimed(other))
        if not woken.cancelled() and woken.result():
            return loop.poke()
        return loop.woke()

    # the send ----------------------------------------------------------------------------------
    async def _send(self, model: str, loop: DispatchLoop[Credit], credit: Credit) -> None:
        """Seals ``model``'s batch against ``credit`` and starts its landing (``_land``)."""
        async with self._handover:
            loop.sent()  # no await until the landing starts: from here the credit is this send's
            taken = self.former.take(model, credit.max_batch, self.settings.max_batch_bytes)
            if taken.items:
                batch, now = self._batch(model, taken, credit), self.clock()
                reads = [p.read_s or p.arrived_s for p in taken.items]
                traced = BatchSpans(batch, reads, now) if tracing.ACTIVE else None
                batch = batch if traced is None else traced.batch
                self.scheduler.sent(model, self._claimed(credit))
                landing = self._land(model, credit, batch, taken, traced, now)
                self.landings.add(model, self._spawn(landing, f"land-{model}"))
        if not taken.items:
            self._give_back(model, credit)
        self._expire(taken.expired)  # stored by the batcher's own loop: a slow store holds up no send
        self._freed()

    async def _land(
        self,
        model: str,
        credit: Credit,
        batch: Batch,
        taken: Taken[InferenceRequest],
        spans: BatchSpans | None,
        at: float,
    ) -> None:
        """Puts the batch on the bus; once it is there its requests are handed over (their offsets may
        be committed). A failed send gives the requests back for the next batch, and the credit back."""
        # "batched" is written while the bus takes the batch: watchers see it before "running". Spawned as
        # the batcher's other tasks are: an error other than a transport's is a bug, and fails the batcher.
        batched = states.batched(model, batch, wall_ms())
        marking = self._spawn(self._mark_batched(batch, batched), f"mark-batched-{model}") if batched else None
        try:
            try:
                await self.producer.send(batch, credit.partition)
            except TransportError as err:
                log.warning(
                    "could not hand batch %s to %s: %s; will retry",
                    batch.batch_id,
                    credit.worker_id,
                    err,
                    extra=ids(batch_id=batch.batch_id, traceparent=batch.traceparent),
                )
                if spans is not None:
                    spans.failed(err)
                self.former.give_back(model, taken)
                self._requeued()
                self._resend_after[model] = self.clock() + self.settings.send_retry_s  # back off a failing bus
                # queued after the pause: the retry, here or in another batcher, goes to an idle worker
                # whose partition may take it before this one again
                await self._offer_back(credit, after_ms=wall_ms() + round(self.settings.send_retry_s * 1000))
                self._wake[model].set()
                return
            if spans is not None:
                spans.sent()
            self._handed_over(taken.items)
            self.batches_sent += 1
            self._record(model, batch, taken, at)
        finally:
            if marking is not None:
                await asyncio.gather(marking, return_exceptions=True)

    async def _mark_batched(self, batch: Batch, batched: list[TaskState]) -> None:
        try:
            await self.store.apply(batched)
        except TransportError as err:  # informational: the worker's running/completed writes follow
            log.warning(
                "could not mark batch %s's %d tasks batched: %s",
                batch.batch_id,
                len(batched),
                err,
                extra=ids(batch_id=batch.batch_id, traceparent=batch.traceparent),
            )

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

    def _record(self, model: str, batch: Batch, taken: Taken[InferenceRequest], sealed_s: float) -> None:
        metrics.FLUSHES.labels(model=model, reason=batch.flush_reason).inc()
        metrics.BATCH_SIZE.labels(model=model).observe(len(batch.items))
        wait = metrics.QUEUE_WAIT.labels(model=model)
        for pending in taken.items:
            wait.observe(max(0.0, sealed_s - pending.arrived_s))
        metrics.PENDING.labels(model=model).set(self.former.held(model))

    def _give_back(self, model: str, credit: Credit) -> None:
        """Returns an unused credit in a task of its own (``landings``, awaited at close): a loop that is
        being cancelled cannot cut the offer short, and does not wait for it."""
        self.landings.add(model, self._spawn(self._offer_back(credit), f"give-back-{model}"))

    async def _offer_back(self, credit: Credit, after_ms: int = 0) -> None:
        """Returns an unused credit (queued no earlier than ``after_ms``); if that fails the worker
        re-offers it when it expires."""
        try:
            await self.credits.offer(credit, after_ms=after_ms)
        except TransportError as err:
            log.warning("could not hand back credit %s: %s (its worker re-offers it)", credit.ref, err)


def _credit_of(claim: asyncio.Task[Credit | None]) -> Credit | None:
    """The credit a finished claim returned (None when it timed out, failed or was cancelled)."""
    return claim.result() if not claim.cancelled() and claim.exception() is None else None
