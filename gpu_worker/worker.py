"""The GPU worker: takes batches from its partitions and carries each through admission, the
backend and the in-order commits.

Its parts, each in a module named for it: the credit that says it can take the next batch
(``credits``), the tasks moved to ``running`` first (``admission``), the backend calls in flight
beside the loop in one TaskGroup (``pipeline``), the blocking backend on a thread of its own
(``runner``: the event loop keeps heartbeats, credits and shutdown working while the GPU computes,
and a call that hangs is noticed), and the results stored and batches committed in order
(``commits``).

Faults, in the order a batch meets them:

* its tasks move to ``running`` *before* the backend sees them, and a task whose move is refused
  because it already ended (cancelled, expired, done by an earlier delivery) is not run at all;
* a batch delivered again (its last holder died or handed it back) runs carefully: suspects in
  halves, each group marked in flight first, results stored after each group; an input that kept
  killing workers goes to the dead-letter topic (``careful`` plans it, ``redelivery`` runs it);
  a worker that hands batches back alive (its drain ran out on a stop or a revocation) records it,
  and their inputs get no strike for it;
  fetched again while its own call runs here (a rebalance that outlasts ``drain_timeout_s`` hands a
  kept partition back at its committed offset), it waits for that call's stored results and runs
  none of the tasks they ended;
* a hung backend call makes the worker end ``expired`` the batch's items already past their
  deadline, give the batch back uncommitted, with every batch fetched after it, and stop (``hung``;
  ``given_back`` names them);
* Kafka or Redis unreachable: every step is retried with backoff until it works or the worker is
  told to stop; only errors that retrying cannot fix end the loop (and the process, non-zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gpu_worker.admission import Admission
from gpu_worker.backends.base import Backend
from gpu_worker.calls import BackendCalls, Failure, GroupResult, oversize
from gpu_worker.commits import Committer, Slot, Timed
from gpu_worker.credits import CreditOffer
from gpu_worker.journal import BatchJournal
from gpu_worker.pipeline import Pipeline
from gpu_worker.redelivery import Redelivery
from gpu_worker.runner import BackendHung, BackendRunner, NotStarted
from gpu_worker.settings import WorkerSettings
from gpu_worker.states import count_stages, task_state, wall_ms
from schemas.records import Batch, BatchItem, TaskState, TaskStatus
from telemetry import metrics
from transport.cancelling import cancel_and_wait
from transport.deliveries import DeadLetterSink, DeliveryLog, MemoryDeadLetters, MemoryDeliveryLog
from transport.ports import BatchConsumer, CreditPool, Delivered, TaskStore, TransportError
from transport.replicas import ReplicaWait
from transport.retry import pause, retry

log = logging.getLogger(__name__)

T = TypeVar("T")

HUNG_WRITE_S = 2.0
"""How long a worker whose backend hung waits for each of its two last writes (the delivery note,
the late items' ends) before it stops."""
HAND_BACK_WRITE_S = 2.0
"""How long a worker that hands batches back alive (stopping, or revoked) waits to record it."""
HUNG_PAST_DEADLINE = Failure(
    "deadline_exceeded",
    "the request's deadline passed while the GPU worker's backend call hung (the worker is replaced): "
    "retry, or send a longer timeout_ms",
)


class Worker:
    """Takes batches one at a time and carries each through admission, the backend and the commits."""

    def __init__(
        self,
        settings: WorkerSettings,
        consumer: BatchConsumer,
        credits: CreditPool,
        store: TaskStore,
        backend: Backend,
        journal: BatchJournal | None = None,
        *,
        deliveries: DeliveryLog | None = None,
        dead_letters: DeadLetterSink | None = None,
        replicas: ReplicaWait | None = None,
    ) -> None:
        self.settings = settings
        self.consumer = consumer
        self.store = store
        self.backend = backend
        self.journal = journal
        self.deliveries: DeliveryLog = deliveries if deliveries is not None else MemoryDeliveryLog()
        self.dead_letters: DeadLetterSink = dead_letters if dead_letters is not None else MemoryDeadLetters()
        self.replicas = replicas
        """When set, a batch is committed only once its results are on enough Redis replicas."""
        expected_s = None if settings.expected_latency_ms is None else settings.expected_latency_ms / 1000
        self.runner = BackendRunner(
            settings.worker_id, hang_factor=settings.hang_factor, hang_min_s=settings.hang_min_s, expected_s=expected_s
        )
        self.calls = BackendCalls(backend, self.runner, settings.model, settings.worker_id, settings.deterministic)
        self.pipeline = Pipeline(self.runner)
        self.offers = CreditOffer(settings, credits, consumer, backend, self.runner, self.pipeline.busy_for_s, replicas)
        self.admission = Admission(
            settings.worker_id, store, self.deliveries, self._retry, keep_ended=replicas is not None
        )
        self.redelivery = Redelivery(
            settings,
            store,
            self.deliveries,
            self.dead_letters,
            self._retry,
            self._run_group,
            self._end_late_now,
            self.runner.start_from,
        )
        self.commits = Committer(
            settings.worker_id,
            consumer,
            store,
            self.deliveries,
            replicas,
            self._retry,
            self._on_commits_failure,
            abandoned=lambda: self._abandon,
            stopping=lambda: self._stopping,
        )
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._closing: asyncio.Task[None] | None = None
        self._abandon = False
        self.failure: BaseException | None = None
        self.failed = asyncio.Event()
        """Set when the loop, a call or a store failed (or the backend hung): the supervisor should exit."""
        self.batches_run = 0

    @property
    def hung(self) -> bool:
        return self.runner.hung

    @property
    def state(self) -> str:
        """What the fleet's heartbeat shows: starting (loading its model, joining its group: not live yet),
        hung, failed (stopped by an error: not live, though an embedded process goes on beating for it),
        draining (closing), busy (a batch in hand) or idle."""
        if self.hung:
            return "hung"
        if self.failure is not None:
            return "failed"
        if self._stopping:
            return "draining"
        if self._task is None:
            return "starting"
        return "idle" if self.pipeline.idle else "busy"

    @property
    def given_back(self) -> list[Batch]:
        """The batches left uncommitted (a hung call's, and those fetched after it), once closed."""
        return self.commits.given_back

    @property
    def batches_done(self) -> int:
        """Batches finished with: results stored and commit attempted (or skipped as undecodable)."""
        return self.commits.batches_done

    # lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.runner.run(self.backend.load)
        await self.consumer.start(self.offers.on_assigned, self._on_revoked)
        self.commits.start()
        self._task = asyncio.create_task(self._guarded(), name=f"worker-{self.settings.worker_id}")

    async def close(self, drain_timeout_s: float | None = None) -> None:
        """Stops offering credits, finishes the batch in hand (or hands it back), then leaves the group.
        Once: embedded mode's shutdown closes a worker its watcher may have closed already, or begun to
        close as the shutdown cancelled it, so a later call waits for the first to end instead of returning
        with the backend, group and journal still open."""
        if self._closing is None:
            self._closing = asyncio.create_task(self._close(drain_timeout_s), name=f"close-{self.settings.worker_id}")
        await asyncio.shield(self._closing)

    async def _close(self, drain_timeout_s: float | None) -> None:
        self._stopping = True
        await self.offers.stop()
        drained = True
        if self._task is not None:
            timeout = self.settings.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
            try:
                async with asyncio.timeout(timeout):
                    await self.pipeline.drained()
                    await self.commits.drained()  # the last results, stored with retries
            except TimeoutError:
                drained = False
                log.warning(
                    "worker %s: batch still running after %.0f s; handing it back uncommitted",
                    self.settings.worker_id,
                    timeout,
                )
            handed = [] if drained else self.commits.holding()  # before the cancel lets any of them through
            self._abandon = True
            await cancel_and_wait(self._task)  # and the calls still in flight: the next owner runs their batches
            self._task = None
            await self._record_hand_back(handed)  # once nothing here marks them any more
        await self.commits.close()  # results being stored when the drain ran out: one last try
        await self.consumer.close()
        self.runner.close()
        try:
            if not self.runner.running:  # never under a call or a load still running (hung, or given up on)
                self.backend.close()
        finally:  # even when the backend raised: a gauge left registered keeps the backend (its model) alive
            if self.journal is not None:
                self.journal.close()
            self.calls.close()

    async def _on_revoked(self, partitions: frozenset[int]) -> None:
        """Withdraws the credit, then lets the batches in hand end and commit before the partitions go:
        the group's next assignment waits for this, and their next owner reads from the committed
        offset, so it runs none of them while they still run here. At most ``drain_timeout_s`` (a
        hung call fails the worker at its hang limit): past it they go uncommitted, and their next
        owner may run them again (each task is answered once)."""
        try:
            await self.offers.on_revoked(partitions)
            await self._drain_revoked(partitions)
        finally:
            self.offers.revoked(partitions)

    async def _drain_revoked(self, partitions: frozenset[int]) -> None:
        if not self.commits.in_hand:
            return
        log.info(
            "worker %s: partitions %s revoked with %d batch(es) in hand; they end and commit first",
            self.settings.worker_id,
            sorted(partitions),
            self.commits.in_hand,
        )
        try:
            async with asyncio.timeout(self.settings.drain_timeout_s):
                await self.commits.drained()
        except TimeoutError:
            log.warning(
                "worker %s: batches in hand still running %.0f s after partitions %s were revoked; they go "
                "uncommitted, and their next owner may run them again",
                self.settings.worker_id,
                self.settings.drain_timeout_s,
                sorted(partitions),
            )
            await self._record_hand_back(self.commits.holding(partitions))

    async def _record_hand_back(self, slots: list[Slot]) -> None:
        """Tells the delivery log that these batches go back from a live worker, so that their next
        holder strikes none of their inputs for it (``DeliveryLog.hand_back``). Not for a worker that
        failed or hung: that is a death. One bounded try: a hand-back not recorded counts as a death."""
        if self.failure is not None or self.hung:
            return
        try:
            async with asyncio.timeout(HAND_BACK_WRITE_S):
                for slot in slots:
                    batch = slot.delivered.value
                    if batch is not None and slot.receipt is not None:
                        await self.deliveries.hand_back(batch.batch_id, slot.receipt)
        except (TransportError, TimeoutError) as err:
            log.warning(
                "worker %s: could not record that it hands its batches back alive (%s): their next holder "
                "counts it as a death of their inputs",
                self.settings.worker_id,
                str(err) or "timed out",
            )

    async def _guarded(self) -> None:
        try:
            await self.pipeline.run(self._loop)
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            self._fail(_first(err), "crashed; it no longer takes batches")
            raise

    def _fail(self, err: BaseException, what: str) -> None:
        """Records the first failure; the supervisor sees ``failed`` and ends the process."""
        if self.failure is not None:
            return
        self.failure = err
        self.failed.set()
        if isinstance(err, BackendHung):
            log.error("worker %s stops: %s", self.settings.worker_id, err)
        else:
            log.error("worker %s %s: %r", self.settings.worker_id, what, err, exc_info=err)

    def _on_commits_failure(self, err: BaseException) -> None:
        self._fail(err, "could not store a batch's results")
        if self._task is not None:
            self._task.cancel()  # take no further batch; a queued call never starts

    def healthy(self) -> bool:
        return self.failure is None and self._task is not None and not self._task.done()

    # the loop ----------------------------------------------------------------------------------
    async def _loop(self) -> None:
        failures = 0
        while not self._stopping:
            await self.pipeline.until_free_soon(self.offers.lead_s)
            try:
                delivered = await self._next_batch()
            except TransportError as err:
                if not err.retriable:
                    raise
                failures += 1
                await self._pause("reading batches", err, failures)
                continue
            failures = 0
            if delivered is None:
                continue
            if self._stopping:  # fetched while shutting down: left uncommitted for the next owner
                log.info("worker %s: stopping; batch at %d/%d goes to the next owner", *self._where(delivered))
                return
            with self.pipeline.handling():
                await self._handle(delivered)

    async def _next_batch(self) -> Delivered[Batch] | None:
        """A batch already here first, with no new credit: one that came against an earlier credit
        (two can be on their way to a worker while its group forms: one against a credit claimed
        before a rebalance, one against the credit offered after). Offering a credit before taking it
        would keep the worker one batch behind, each batch waiting a call longer than it needs."""
        waiting = await self.consumer.next(0)
        if waiting is not None:
            return waiting
        await self.offers.offer()
        return await self.consumer.next(self.settings.poll_timeout_s)

    def _where(self, delivered: Delivered[Batch]) -> tuple[str, int, int]:
        return self.settings.worker_id, delivered.partition, delivered.offset

    async def _pause(self, what: str, err: TransportError, failures: int) -> None:
        await pause(log, f"worker {self.settings.worker_id}", what, err, failures, self.settings.retry_max_s)

    async def _retry(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """``op`` until it works; a failure that retrying cannot fix, or a shutdown past its drain time, raises."""
        who = f"worker {self.settings.worker_id}"
        return await retry(log, who, what, op, self.settings.retry_max_s, give_up=lambda: self._abandon)

    async def _handle(self, delivered: Delivered[Batch]) -> None:
        slot = self.commits.reserve(delivered)  # committed after every batch fetched before it
        try:
            batch = delivered.value
            await self.offers.taken(batch)
            if batch is None:
                log.warning("worker %s: undecodable batch at partition %d offset %d skipped", *self._where(delivered))
                await self.commits.fill(slot, [])
                return
            try:
                await self._process(slot, batch)
            except BackendHung as err:
                await self._hung(batch, err)
                raise
        except BaseException:
            self.commits.give_up(slot)  # before any call started: a started call owns its slot (``_start_call``)
            raise
        await asyncio.sleep(0)  # a call just started reaches the backend's thread before the next fetch

    async def _hung(self, batch: Batch, err: BackendHung) -> None:
        """Before the worker stops: notes why on the batch's delivery log, for its next holder, and
        ends ``expired`` its items already past their deadline, which would read ``running`` until
        another worker takes the batch (there may be none). Items still in time go back with it.
        Each write has one bounded try: the worker is stopping because something hangs."""
        with contextlib.suppress(TransportError, TimeoutError):
            async with asyncio.timeout(HUNG_WRITE_S):
                note = f"worker {self.settings.worker_id}: {err}"
                await self.deliveries.note(batch.batch_id, note, self.runner.expected_s)
        now, worker_id = wall_ms(), self.settings.worker_id
        late = [
            task_state(worker_id, batch, item, TaskStatus.EXPIRED, error=HUNG_PAST_DEADLINE)
            for item in batch.items
            if item.deadline_ms <= now
        ]
        if not late:
            return
        with contextlib.suppress(TransportError, TimeoutError):
            async with asyncio.timeout(HUNG_WRITE_S):
                await self.store.apply(late)  # forward only: an end written first stays

    # one batch ---------------------------------------------------------------------------------
    async def _process(self, slot: Slot, batch: Batch) -> None:
        """Admits the batch, then starts a first delivery's call behind the one in flight; a
        redelivered batch runs carefully once the backend is free. The results go to the commits."""
        now = wall_ms()
        metrics.BATCH_WAIT.labels(model=batch.model).observe(max(0, now - batch.created_at_ms) / 1000.0)
        call_ms = (self.runner.expected_s or 0.0) * 1000
        ends_by_ms = now + round(self.pipeline.busy_for_s() * 1000 + call_ms)
        ended, live = self.admission.expire_late(batch, ends_by_ms, call_ms)
        # The same on each retry: a count or read whose reply was lost is not done twice.
        receipt = slot.receipt = uuid.uuid4().hex
        count, todo = await self.admission.count_and_admit(batch, live, receipt)
        if not todo or count != 1:
            # A careful run waits for the calls in flight (one at a time), and every batch's
            # results are stored after those of the batches before it (``commits``).
            late, todo = await self._backend_free_for(batch, todo)
            if todo:
                # Its tasks are admitted again once the results in hand are stored: a batch fetched again
                # while its first delivery ran here (a rebalance hands a kept partition back at its
                # committed offset) has ended by then, and runs no task twice. That store may take a
                # while (replicas, retries): what can no longer be answered in time ends first.
                await self.commits.stored()
                todo = await self.admission.admit(batch, todo)
                stale, todo = await self._end_late_now(batch, todo)
                late += stale
            stored, calls = await self.redelivery.run(batch, todo, count, receipt) if todo else ([], None)
            self._fill(slot, batch, ended + late + stored, calls)  # stored again (no-ops) to wait for replicas
            return
        self._start_call(slot, batch, todo, ended)

    async def _backend_free_for(self, batch: Batch, todo: list[BatchItem]) -> tuple[list[TaskState], list[BatchItem]]:
        """Waits until no call runs or waits on the backend: (the states of the items that ended
        ``expired`` meanwhile, already stored; those still to run). Should the call in flight overrun
        (or hang), an admitted item whose call can no longer end by its deadline ends then, as a
        first delivery's does (``_run_first``), not when the backend frees (and runs it late) or
        the worker gives up on the call."""
        expired: list[TaskState] = []
        if self.pipeline.running(batch.batch_id):  # fetched again: the call in flight answers its items
            await self.pipeline.backend_free()
            return expired, todo
        while todo:
            call_ms = (self.runner.expected_s or 0.0) * 1000
            start_in_s = (min(item.deadline_ms for item in todo) - call_ms - wall_ms()) / 1000
            try:
                async with asyncio.timeout(max(0.0, start_in_s)):
                    await self.pipeline.backend_free()
                free = True
            except TimeoutError:
                free = False
            late, todo = await self._end_late(batch, todo, wall_ms() + math.ceil(call_ms), call_ms)
            expired += late
            if free:
                break
        await self.pipeline.backend_free()  # every item expired: still after the calls in flight
        return expired, todo

    async def _end_late(
        self, batch: Batch, todo: list[BatchItem], ends_by_ms: int, call_ms: float
    ) -> tuple[list[TaskState], list[BatchItem]]:
        """Ends ``expired`` (stored) the items of ``todo`` that a call ending at ``ends_by_ms`` would
        answer past their deadline: (their states, the items still to run)."""
        late, todo = self.admission.expire_late(batch, ends_by_ms, call_ms, todo)
        if late:
            await self._retry("ending expired tasks", functools.partial(self.store.apply, late))
        return late, todo

    async def _end_late_now(self, batch: Batch, todo: list[BatchItem]) -> tuple[list[TaskState], list[BatchItem]]:
        """``_end_late`` for a call that starts now and takes the expected time."""
        call_ms = (self.runner.expected_s or 0.0) * 1000
        return await self._end_late(batch, todo, wall_ms() + math.ceil(call_ms), call_ms)

    def _fill(self, slot: Slot, batch: Batch, states: list[TaskState], call: Timed = None) -> None:
        self.commits.fill(slot, states + self.admission.ended_before(batch.batch_id), call)

    def _start_call(self, slot: Slot, batch: Batch, todo: list[BatchItem], ended: list[TaskState]) -> None:
        """Starts the call behind the ones in flight; its results fill the batch's slot when it ends.
        A call that fails or is cancelled (even before it began) gives the slot up."""
        result = GroupResult()
        task = self.pipeline.start(batch.batch_id, result, len(todo), self._compute(slot, batch, todo, ended, result))
        task.add_done_callback(lambda _: self.commits.give_up(slot))

    async def _compute(
        self,
        slot: Slot,
        batch: Batch,
        todo: list[BatchItem],
        ended: list[TaskState],
        result: GroupResult,
    ) -> None:
        try:
            expired, states = await self._run_first(batch, todo, result)
        except BackendHung as err:
            await self._hung(batch, err)
            raise
        self._fill(slot, batch, ended + expired + states, result)  # ``expired`` again: a no-op, but for replicas

    async def _run_first(
        self, batch: Batch, todo: list[BatchItem], result: GroupResult
    ) -> tuple[list[TaskState], list[TaskState]]:
        """Runs a first delivery's call, queued behind the one in flight: (the states of the items
        that ended ``expired`` waiting, already stored; those of the items that ran). Should the call
        in flight overrun (or hang), an item whose call can no longer end by its deadline ends then,
        not when its call ends (or the batch's next owner admits it), and its call runs without it."""
        expired: list[TaskState] = []
        while todo:
            call_ms = (self.runner.expected_s or 0.0) * 1000
            now_ms, now_s = wall_ms(), self.runner.clock()
            start_by = now_s + (min(item.deadline_ms for item in todo) - call_ms - now_ms) / 1000
            try:
                return expired, await self._run_group(batch, todo, 1, result, start_by)
            except NotStarted:
                ends_by_ms = now_ms + math.ceil((self.runner.clock() - now_s) * 1000 + call_ms)
                late, todo = await self._end_late(batch, todo, ends_by_ms, call_ms)
                expired += late
                result.outputs.clear()
        return expired, []

    async def _run_group(
        self,
        batch: Batch,
        items: list[BatchItem],
        delivery: int,
        result: GroupResult | None = None,
        start_by: float | None = None,
    ) -> list[TaskState]:
        result = await self.calls.run([item.input for item in items], result, start_by)
        outputs = result.outputs
        self.batches_run += 1
        outcome = "ok" if all(isinstance(r, str) for r in outputs.values()) else "partial"
        metrics.WORKER_BATCHES.labels(worker=self.settings.worker_id, outcome=outcome).inc()
        metrics.WORKER_ITEMS.labels(worker=self.settings.worker_id).inc(len(items))
        if result.started is not None and result.ended is not None:
            started_ms = wall_ms() - (self.runner.clock() - result.started) * 1000.0  # runner clock to wall
            count_stages(batch, len(items), started_ms, result.ended - result.started)
            if self.journal is not None:
                ids = [item.task_id for item in items]  # the thread's times: a call may have waited behind another
                self.journal.record(
                    self.settings.worker_id, batch.batch_id, ids, result.started, result.ended, outcome, delivery
                )
        states = []
        limit, worker_id = self.settings.max_output_bytes, self.settings.worker_id
        for index, item in enumerate(items):
            output = outputs[index]
            if isinstance(output, str):
                output = oversize(output, limit) or output
            if isinstance(output, str):
                states.append(task_state(worker_id, batch, item, TaskStatus.COMPLETED, output, ran_with=len(items)))
            else:
                states.append(task_state(worker_id, batch, item, TaskStatus.FAILED, error=output, ran_with=len(items)))
        return states


def _first(err: BaseException) -> BaseException:
    """The first error in a TaskGroup's group of errors (nested groups included), else ``err``."""
    while isinstance(err, BaseExceptionGroup) and err.exceptions:
        err = err.exceptions[0]
    return err
