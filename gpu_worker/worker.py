"""The GPU worker: one batch at a time, results to the task store, offsets committed after.

The worker announces that it is idle by offering a credit (see ``batcher.service``), and offers
the next one ``credit_lead_ms`` before the running call is expected to end (or when it ends, if
sooner), so the next batch is formed and travels while the GPU finishes this one. That batch is
admitted (its tasks move to ``running``) and its call queued on the backend's thread at once, so
the thread starts it the moment the running call returns: back to back, the GPU waits for neither
the batcher, the bus, nor an event loop busy with the last batch's answers. The lead is short next
to a call, so a batch sent against an early credit waits at most about that long.

The blocking backend runs in a thread of its own (``runner.BackendRunner``): the event
loop keeps heartbeats, credits and shutdown working while the GPU computes, and a call that hangs
is noticed.

Faults, in the order a batch meets them:

* its tasks move to ``running`` *before* the backend sees them, and a task whose move is refused
  because it already ended (cancelled, expired, done by an earlier delivery) is not run at all;
  the exception is an express copy (a first delivery) reaching an idle backend: its call starts
  first and its tasks are admitted while it runs, and a refused task's result is dropped;
* a batch delivered again (its last holder died or handed it back) runs carefully: suspects in
  halves, each group marked in flight first, results stored after each group; an input that kept
  killing workers goes to the dead-letter topic (``careful``);
* a hung backend call makes the worker give the batch back uncommitted and stop (``hung``);
* Kafka or Redis unreachable: every step is retried with backoff until it works or the worker is
  told to stop; only errors that retrying cannot fix end the loop (and the process, non-zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from gpu_worker import careful
from gpu_worker.backends.base import Backend
from gpu_worker.calls import BackendCalls, Failure, Ran, oversize
from gpu_worker.journal import BatchJournal
from gpu_worker.replicas import ReplicaWait
from gpu_worker.runner import BackendHung, BackendRunner
from gpu_worker.settings import WorkerSettings
from schemas.deadletter import DEAD_LETTERED
from schemas.records import Batch, BatchItem, Credit, TaskState, TaskStatus
from telemetry import metrics
from transport.deliveries import (
    DeadLetterSink,
    DeliveryLog,
    MemoryDeadLetters,
    MemoryDeliveryLog,
    Suspects,
)
from transport.ports import BatchConsumer, CreditPool, Delivered, TaskStore, TransportError
from transport.retry import pause, retry

log = logging.getLogger(__name__)

T = TypeVar("T")


def wall_ms() -> int:
    return int(time.time() * 1000)


class Worker:
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
        self.credits = credits
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
        self.calls = BackendCalls(backend, self.runner, settings.model, settings.worker_id)
        self._credit: Credit | None = None
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self._finishing: asyncio.Task[None] | None = None
        self._runs: deque[_Run] = deque()
        """Batches whose backend calls run or wait on the thread, oldest first (at most two)."""
        self._handling = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = False
        self._abandon = False
        self._held_back = False
        """A batch was left uncommitted (its results not stored or not replicated): no later one is committed."""
        self._ended_before: dict[str, list[TaskState]] = {}
        """Per batch id, the stored states of its tasks that had ended before it ran (with replicas only)."""
        self._credit_failures = 0
        self.failure: BaseException | None = None
        self.failed = asyncio.Event()
        """Set when a background loop crashed (or the backend hung): the process supervisor should exit."""
        self.hung_batch: Batch | None = None
        """The batch whose backend call hung; it was given back uncommitted."""
        self.batches_run = 0
        self.batches_done = 0
        """Batches finished with: results stored and commit attempted (or skipped as undecodable)."""

    @property
    def hung(self) -> bool:
        return self.runner.hung

    # lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.runner.run(self.backend.load)
        await self.consumer.start(self._on_assigned, self._on_revoked)
        self._task = asyncio.create_task(self._guarded(), name=f"worker-{self.settings.worker_id}")

    async def close(self, drain_timeout_s: float | None = None) -> None:
        """Stops offering credits, finishes the batch in hand (or hands it back), then leaves the group."""
        self._stopping = True
        await self._withdraw()
        drained = True
        if self._task is not None:
            timeout = self.settings.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
            try:
                async with asyncio.timeout(timeout):
                    await self._idle.wait()
                    if self._finishing is not None:  # the last results, stored with retries
                        await asyncio.gather(asyncio.shield(self._finishing), return_exceptions=True)
            except TimeoutError:
                drained = False
                log.warning(
                    "worker %s: batch still running after %.0f s; handing it back uncommitted",
                    self.settings.worker_id,
                    timeout,
                )
            self._abandon = True
            self._task.cancel()
            runs = [run.task for run in self._runs]
            for task in runs:
                task.cancel()  # given back uncommitted: the next owner runs them
            await asyncio.gather(self._task, *runs, return_exceptions=True)
            self._task = None
        if self._finishing is not None:  # results being stored when the drain ran out: one last try
            await asyncio.gather(self._finishing, return_exceptions=True)
        await self.consumer.close()
        self.runner.close()
        if drained and not self.runner.hung:  # never close a backend under a call that still runs
            self.backend.close()
        if self.journal is not None:
            self.journal.close()

    async def _guarded(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            self.failure = err
            self.failed.set()
            if isinstance(err, BackendHung):
                log.error("worker %s stops: %s", self.settings.worker_id, err)
            else:
                log.exception("worker %s crashed; it no longer takes batches", self.settings.worker_id)
            raise

    def healthy(self) -> bool:
        return self.failure is None and self._task is not None and not self._task.done()

    # credits -----------------------------------------------------------------------------------
    async def _on_assigned(self, partitions: frozenset[int]) -> None:
        log.info("worker %s owns batch partitions %s", self.settings.worker_id, sorted(partitions))
        if self._credit is not None and self._credit.partition not in partitions:
            await self._withdraw()

    async def _on_revoked(self, partitions: frozenset[int]) -> None:
        if self._credit is not None and self._credit.partition in partitions:
            await self._withdraw()

    async def _withdraw(self) -> None:
        credit, self._credit = self._credit, None
        if credit is not None:
            try:
                await self.credits.withdraw(credit)
            except TransportError as err:
                log.warning("could not withdraw credit %s: %s (it expires on its own)", credit.ref, err)

    async def _offer(self) -> None:
        """Offers a credit when idle, and replaces one that is about to expire unclaimed."""
        if self._stopping:
            return
        if self.replicas is not None and self.replicas.waiting:
            await self._withdraw()  # results wait for Redis replicas: no new batch until they are safe
            return
        now = wall_ms()
        if self._credit is not None and self._credit.expires_at_ms - now > self.settings.refresh_margin_s * 1000:
            return
        assignment = self.consumer.assignment()
        if not assignment:
            return
        await self._withdraw()
        self._seq += 1
        credit = Credit(
            worker_id=self.settings.worker_id,
            model=self.settings.model,
            partition=min(assignment),
            seq=self._seq,
            issued_at_ms=now,
            expires_at_ms=now + int(self.settings.credit_ttl_s * 1000),
            max_batch=self.backend.max_batch,
            busy_ms=round((self.runner.expected_s or 0.0) * 1000),
            free_at_ms=now + round(self._busy_for_s() * 1000),
        )
        try:
            await self.credits.offer(credit)
        except TransportError as err:
            self._credit_failures += 1
            if self._credit_failures == 1 or self._credit_failures % 20 == 0:
                log.warning("could not offer a credit (%d tries so far): %s; retrying", self._credit_failures, err)
            return
        if self._credit_failures:
            log.info(
                "worker %s offers credits again after %d failed tries", self.settings.worker_id, self._credit_failures
            )
            self._credit_failures = 0
        self._credit = credit
        if self._stopping:  # close() withdrew while this offer was on its way
            await self._withdraw()

    def _busy_for_s(self) -> float:
        """How long until the backend should be idle: 0 unless an early credit is being offered."""
        expected_s = self.runner.expected_s
        if not self._runs or expected_s is None:
            return 0.0
        started = self._runs[-1].ran.first.started
        if started is None:
            return expected_s
        return max(0.0, started + expected_s - self.runner.clock())

    def _lead_s(self, run: _Run) -> float:
        full = 2 * run.size >= (self.backend.max_batch or 0) > 0
        return (self.settings.credit_lead_full_ms if full else self.settings.credit_lead_ms) / 1000

    async def _until_free_soon(self) -> None:
        """Returns once the backend is idle, or runs one call expected to end within the lead."""
        while self._runs:
            oldest = self._runs[0]
            lead_s = self._lead_s(oldest)
            expected_s = self.runner.expected_s
            started = oldest.ran.first.started
            wait_s: float | None = None  # until the oldest run ends
            if len(self._runs) == 1 and lead_s > 0 and expected_s is not None:
                if started is None:
                    wait_s = 0.001  # its call is being handed to the thread
                else:
                    wait_s = started + expected_s - lead_s - self.runner.clock()
                    if wait_s <= 0:
                        return
            await asyncio.wait([oldest.task], timeout=wait_s)

    # the loop ----------------------------------------------------------------------------------
    async def _loop(self) -> None:
        failures = 0
        while not self._stopping:
            await self._until_free_soon()
            await self._offer()
            try:
                delivered = await self.consumer.next(self.settings.poll_timeout_s)
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
            self._handling = True
            self._idle.clear()
            try:
                await self._handle(delivered)
            finally:
                self._handling = False
                self._note_idle()

    def _note_idle(self) -> None:
        if not self._handling and not self._runs:
            self._idle.set()

    def _where(self, delivered: Delivered[Batch]) -> tuple[str, int, int]:
        return self.settings.worker_id, delivered.partition, delivered.offset

    async def _pause(self, what: str, err: TransportError, failures: int) -> None:
        await pause(log, f"worker {self.settings.worker_id}", what, err, failures, self.settings.retry_max_s)

    async def _retry(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """``op`` until it works; a failure that retrying cannot fix, or a shutdown past its drain time, raises."""
        who = f"worker {self.settings.worker_id}"
        return await retry(log, who, what, op, self.settings.retry_max_s, give_up=lambda: self._abandon)

    async def _handle(self, delivered: Delivered[Batch]) -> None:
        batch = delivered.value
        if self._credit is not None and (batch is None or batch.credit != self._credit.ref):
            await self._withdraw()  # this batch was not sent against our open credit: keep one at a time
        self._credit = None
        if batch is None:
            log.warning("worker %s: undecodable batch at partition %d offset %d skipped", *self._where(delivered))
            await self._backend_free()
            await self._previous_finished()  # commits go in offset order
            await self._commit(delivered)
            self.batches_done += 1
            return
        try:
            await self._process(delivered, batch)
        except BackendHung as err:
            await self._hung(batch, err)
            raise

    async def _hung(self, batch: Batch, err: BackendHung) -> None:
        self.hung_batch = batch
        with contextlib.suppress(TransportError, TimeoutError):
            async with asyncio.timeout(2.0):
                await self.deliveries.note(batch.batch_id, f"worker {self.settings.worker_id}: {err}")

    def _store(self, delivered: Delivered[Batch], batch: Batch, states: list[TaskState]) -> None:
        """Stores the results (and commits the batch) in a task of their own, which a cancellation does
        not cut in half, while the loop goes on: on a busy event loop, waiting for the store first
        would leave the GPU idle for as long."""
        self._finishing = asyncio.create_task(self._finish(delivered, batch, states, self._finishing))
        self._finishing.add_done_callback(self._finished)

    async def _backend_free(self) -> None:
        """Waits until no call runs or waits on the backend's thread (their results then get stored)."""
        while self._runs:
            await asyncio.wait([self._runs[0].task])

    async def _previous_finished(self) -> None:
        """Waits until the batch before has been stored and committed (its failure ends the loop)."""
        if self._finishing is not None:
            await asyncio.shield(self._finishing)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._fail_on(task, "could not store a batch's results")

    def _fail_on(self, task: asyncio.Task[None], what: str) -> None:
        """A storing or running task's error (the first one) stops the worker."""
        if task.cancelled() or (err := task.exception()) is None or self.failure is not None:
            return
        self.failure = err
        self.failed.set()
        if isinstance(err, BackendHung):
            log.error("worker %s stops: %s", self.settings.worker_id, err)
        else:
            log.error("worker %s %s: %r", self.settings.worker_id, what, err)
        self._stop_taking()

    def _stop_taking(self) -> None:
        if self._task is not None:
            self._task.cancel()  # take no further batch
        for run in self._runs:
            run.task.cancel()  # a queued call never starts: its batch goes back uncommitted

    def _ran(self, task: asyncio.Task[None]) -> None:
        self._runs = deque(run for run in self._runs if run.task is not task)
        self._note_idle()
        self._fail_on(task, "ran a batch that failed")

    async def _finish(
        self,
        delivered: Delivered[Batch],
        batch: Batch,
        states: list[TaskState],
        previous: asyncio.Task[None] | None,
    ) -> None:
        if previous is not None:  # commits go in offset order
            await asyncio.gather(previous, return_exceptions=True)
            if previous.cancelled() or previous.exception() is not None:
                self._held_back = True
        if self.replicas is not None:  # every state again: the earlier writes may be on a lost primary
            # With the tasks an earlier delivery ended: their states may also be on that primary alone.
            states = states + self._ended_before.pop(batch.batch_id, [])
            replicated = await self.replicas.store_results(
                states, give_up=lambda: self._abandon, stopping=lambda: self._stopping
            )
            self._held_back = self._held_back or not replicated
        elif states:
            await self._retry("storing results", lambda: self.store.apply(states))
        if self._held_back:  # committing this batch's offset would also commit one left uncommitted before it
            log.info(
                "worker %s: batch at %d/%d goes back uncommitted (its results, or an earlier batch's, are not safe)",
                *self._where(delivered),
            )
            return
        await self._commit(delivered)
        try:
            await self.deliveries.finish(batch.batch_id)
        except TransportError as err:  # it expires on its own
            log.debug("worker %s: could not forget batch %s: %s", self.settings.worker_id, batch.batch_id, err)
        self.batches_done += 1

    async def _commit(self, delivered: Delivered[Batch]) -> None:
        try:
            await self.consumer.commit(delivered)
        except TransportError as err:
            # The results are stored; if the batch comes again (its partition moved on), its tasks
            # have ended, so the next holder runs none of them and callers see each answer once.
            log.warning("worker %s: commit of batch at %d/%d failed: %s", *self._where(delivered), err)

    # one batch ---------------------------------------------------------------------------------
    async def _process(self, delivered: Delivered[Batch], batch: Batch) -> None:
        """Admits the batch, then queues a first delivery's call behind the running one (``_runs``); a
        redelivered batch runs carefully once the backend is free. The results are stored after."""
        now = wall_ms()
        metrics.BATCH_WAIT.labels(model=batch.model).observe(max(0, now - batch.created_at_ms) / 1000.0)
        # A call that would end after an item's deadline computes an answer nobody may receive: the
        # item ends expired instead, and the GPU's time goes to items that can still be answered.
        ends_by_ms = now + round((self._busy_for_s() + (self.runner.expected_s or 0.0)) * 1000)
        expired = Failure(
            "deadline_exceeded",
            "the request's deadline would pass before the GPU could finish it (the model's queue was long): "
            "retry later, or send a longer timeout_ms",
        )
        ended = [
            self._state(batch, item, TaskStatus.EXPIRED, error=expired)
            for item in batch.items
            if item.deadline_ms <= ends_by_ms
        ]
        live = [item for item in batch.items if item.deadline_ms > ends_by_ms]
        if live and delivered.via == "express" and not self._runs:
            # Straight from its batcher to an idle backend: an express copy is pushed once and popped
            # once, and the push counted this delivery, so the call starts while the tasks move to
            # running (a round trip less before the GPU starts). A task that ended meanwhile
            # (cancelled within those milliseconds) is computed but its result is dropped. Should
            # this call kill the worker, Kafka's copy comes again as a second delivery and runs carefully.
            self._start_run(delivered, batch, live, ended, admit_once_started=True)
        else:
            count, todo = await self._admission(delivered, batch, live)
            if not todo or count != 1:
                # A careful run waits for the running call (one at a time), and every batch's results
                # are stored after those of the batches before it (commits go in offset order).
                await self._backend_free()
                stored = await self._run_careful(batch, todo, count) if todo else []
                self._count(batch, ended)
                self._store(delivered, batch, ended + stored)  # stored again (no-ops) to wait for replicas
                return
            self._start_run(delivered, batch, todo, ended)
        await asyncio.sleep(0)  # let it hand its call to the thread before the loop goes on

    async def _admission(
        self, delivered: Delivered[Batch], batch: Batch, live: list[BatchItem]
    ) -> tuple[int, list[BatchItem]]:
        """Counts this delivery and admits the live items: (deliveries so far, the items to run).

        An express copy's delivery was counted by the push that brought it (``RedisExpress.push``)."""
        if delivered.via == "express":
            return 1, await self._admit(batch, live)
        return await asyncio.gather(  # one round trip's wait, not two
            self._retry("counting a delivery", lambda: self.deliveries.begin(batch.batch_id)),
            self._admit(batch, live),
        )

    async def _admit_after(self, began: asyncio.Event, batch: Batch, live: list[BatchItem]) -> list[BatchItem]:
        """``_admit`` once the thread has begun the call (an express batch's; see ``_start_run``)."""
        await began.wait()
        return await self._admit(batch, live)

    def _start_run(
        self,
        delivered: Delivered[Batch],
        batch: Batch,
        todo: list[BatchItem],
        ended: list[TaskState],
        *,
        admit_once_started: bool = False,
    ) -> None:
        """Queues the call behind the running one (``_runs``); its results are stored when it ends.

        With ``admit_once_started`` the tasks are admitted once the thread has begun the call: the
        event loop sends nothing meanwhile, so the thread gets the GIL at once.
        """
        ran = Ran()
        admitting = None
        if admit_once_started:
            began = asyncio.Event()
            ran.first.on_start = functools.partial(_set_from_thread, asyncio.get_running_loop(), began)
            admitting = asyncio.ensure_future(self._admit_after(began, batch, todo))
        run = self._run(delivered, batch, todo, ended, ran, admitting)
        task = asyncio.create_task(run, name=f"run-{batch.batch_id}")
        self._runs.append(_Run(task, ran, len(todo)))
        task.add_done_callback(self._ran)

    async def _run(
        self,
        delivered: Delivered[Batch],
        batch: Batch,
        todo: list[BatchItem],
        ended: list[TaskState],
        ran: Ran,
        admitting: asyncio.Future[list[BatchItem]] | None,
    ) -> None:
        try:
            states = await self._run_group(batch, todo, 1, ran)
            if admitting is not None:
                admitted = await admitting
                kept = {item.task_id for item in admitted}
                states = [state for state in states if state.task_id in kept]  # the rest had ended
        except BackendHung as err:
            await self._hung(batch, err)
            raise
        finally:
            if admitting is not None and not admitting.done():
                admitting.cancel()
                await asyncio.gather(admitting, return_exceptions=True)
        ended.extend(states)
        self._count(batch, ended)
        self._store(delivered, batch, ended)

    async def _admit(self, batch: Batch, live: list[BatchItem]) -> list[BatchItem]:
        """Moves the live items to ``running`` before any reaches the backend; drops those already ended."""
        if not live:
            return []
        running = [self._state(batch, item, TaskStatus.RUNNING) for item in live]
        applied = await self._retry("marking tasks running", lambda: self.store.apply(running))
        refused = [item.task_id for item, ok in zip(live, applied, strict=True) if not ok]
        if not refused:
            return live
        # Refused: the task ended (cancelled, expired, done by an earlier delivery), or it is already
        # running because this is a redelivery; only the ended ones are dropped.
        current = await self._retry("reading tasks", lambda: self.store.get_many(refused))
        ended = {task_id for task_id, state in current.items() if state.status.terminal}
        if ended and self.replicas is not None:  # stored again with the batch's results (see _finish)
            self._ended_before.setdefault(batch.batch_id, []).extend(current[task_id] for task_id in ended)
        if ended:
            log.info(
                "worker %s: %d task(s) of batch %s already ended (cancelled, expired or answered); not running them",
                self.settings.worker_id,
                len(ended),
                batch.batch_id,
            )
        return [item for item in live if item.task_id not in ended]

    async def _run_group(
        self, batch: Batch, items: list[BatchItem], delivery: int, ran: Ran | None = None
    ) -> list[TaskState]:
        ran = await self.calls.run([item.input for item in items], ran)
        results = ran.results
        self.batches_run += 1
        outcome = "ok" if all(isinstance(r, str) for r in results.values()) else "partial"
        metrics.WORKER_BATCHES.labels(worker=self.settings.worker_id, outcome=outcome).inc()
        if self.journal is not None and ran.started is not None and ran.ended is not None:
            ids = [item.task_id for item in items]  # the thread's times: a call may have waited behind another
            self.journal.record(self.settings.worker_id, batch.batch_id, ids, ran.started, ran.ended, outcome, delivery)
        states = []
        limit = self.settings.max_output_bytes
        for index, item in enumerate(items):
            result = results[index]
            if isinstance(result, str):
                result = oversize(result, limit) or result
            if isinstance(result, str):
                states.append(self._state(batch, item, TaskStatus.COMPLETED, output=result))
            else:
                states.append(self._state(batch, item, TaskStatus.FAILED, error=result))
        return states

    async def _run_careful(self, batch: Batch, todo: list[BatchItem], count: int) -> list[TaskState]:
        """A redelivered batch: suspects in halves, each group marked and its results stored at once;
        returns every state it stored."""
        ids = [item.task_id for item in todo]
        suspects = await self._retry(
            "reading what was in flight", lambda: self.deliveries.suspects(batch.batch_id, ids)
        )
        decided = careful.plan(todo, lambda item: item.task_id, suspects, self.settings.max_deliveries)
        log.warning(
            "worker %s: batch %s is delivered for the %s time (%s); %d of %d tasks were in flight then; "
            "running %s, dead-lettering %d",
            self.settings.worker_id,
            batch.batch_id,
            _ordinal(count),
            suspects.note or "its last holder died or handed it back",
            len(suspects.task_ids),
            len(todo),
            "+".join(str(len(group)) for group in decided.groups) or "nothing",
            len(decided.dead),
        )
        stored = await self._dead_letter(batch, decided.dead, suspects, count) if decided.dead else []
        for group in decided.groups:
            mark = functools.partial(self.deliveries.mark, batch.batch_id, [item.task_id for item in group])
            await self._retry("marking tasks in flight", mark)
            states = await self._run_group(batch, group, count)
            await self._retry("storing results", functools.partial(self.store.apply, states))
            self._count(batch, states)
            stored.extend(states)
        return stored

    async def _dead_letter(
        self, batch: Batch, items: list[BatchItem], suspects: Suspects, count: int
    ) -> list[TaskState]:
        ids = [item.task_id for item in items]
        # Marked first: if this worker dies before the letter is stored, the next one sees it again.
        await self._retry("marking tasks in flight", lambda: self.deliveries.mark(batch.batch_id, ids))
        letter = careful.dead_letter(batch, items, suspects, count, self.settings.worker_id, wall_ms())
        await self._retry("sending to the dead-letter topic", lambda: self.dead_letters.send(letter))
        log.error(
            "worker %s: dead-lettered %s of batch %s: %s", self.settings.worker_id, ids, batch.batch_id, letter.error
        )
        failure = Failure(DEAD_LETTERED, careful.dead_lettered_message(letter))
        states = [self._state(batch, item, TaskStatus.FAILED, error=failure) for item in items]
        await self._retry("storing dead-lettered tasks", lambda: self.store.apply(states))
        metrics.WORKER_BATCHES.labels(worker=self.settings.worker_id, outcome="dead_lettered").inc()
        self._count(batch, states)
        return states

    def _count(self, batch: Batch, states: list[TaskState]) -> None:
        ended = Counter(state.status.value for state in states)  # one labels() lookup per status, not per task
        for status, count in ended.items():
            metrics.TASKS_ENDED.labels(model=batch.model, status=status).inc(count)

    def _state(
        self,
        batch: Batch,
        item: BatchItem,
        status: TaskStatus,
        output: str | None = None,
        error: Failure | None = None,
    ) -> TaskState:
        return TaskState(
            task_id=item.task_id,
            status=status,
            model=batch.model,
            updated_at_ms=wall_ms(),
            enqueued_at_ms=item.enqueued_at_ms,
            output=output,
            error_code=error.code if error else None,
            error_message=error.message if error else None,
            batch_id=batch.batch_id,
            batch_size=len(batch.items),
            worker_id=self.settings.worker_id,
            reply_to=item.reply_to,
        )


@dataclass(frozen=True, slots=True)
class _Run:
    task: asyncio.Task[None]
    ran: Ran
    """Filled as the call runs: ``ran.first.started`` is when the thread began it."""
    size: int


def _set_from_thread(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
        loop.call_soon_threadsafe(event.set)


def _ordinal(n: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")
