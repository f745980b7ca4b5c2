"""The GPU worker: one batch at a time, results to the task store, offsets committed after.

The worker announces that it is idle by offering a credit (see ``batcher.service``), and offers
the next one as soon as the backend returns, so the next batch travels while this one's results
are stored. The blocking backend runs in a dedicated thread: the event loop keeps heartbeats,
credits and shutdown working while the GPU computes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from batchwire import metrics
from batchwire.transport.base import BatchConsumer, CreditPool, Delivered, TaskStore, TransportError
from gpu_worker.backends.base import Backend, InputError
from gpu_worker.journal import BatchJournal
from gpu_worker.settings import WorkerSettings
from schemas.records import Batch, BatchItem, Credit, TaskState, TaskStatus

log = logging.getLogger(__name__)


def wall_ms() -> int:
    return int(time.time() * 1000)


class _Failure:
    """Why one input got no output."""

    __slots__ = ("code", "message")

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        consumer: BatchConsumer,
        credits: CreditPool,
        store: TaskStore,
        backend: Backend,
        journal: BatchJournal | None = None,
    ) -> None:
        self.settings = settings
        self.consumer = consumer
        self.credits = credits
        self.store = store
        self.backend = backend
        self.journal = journal
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=settings.worker_id)
        self._credit: Credit | None = None
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = False
        self.failure: BaseException | None = None
        self.failed = asyncio.Event()
        """Set when a background loop crashed: the process supervisor should exit."""
        self.batches_run = 0

    # lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.backend.load)
        await self.consumer.start(self._on_assigned, self._on_revoked)
        self._task = asyncio.create_task(self._guarded(), name=f"worker-{self.settings.worker_id}")

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Stops offering credits, finishes the batch in hand (or hands it back), then leaves the group."""
        self._stopping = True
        await self._withdraw()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
            except TimeoutError:
                log.warning(
                    "worker %s: batch still running after %.0f s; handing it back uncommitted",
                    self.settings.worker_id,
                    drain_timeout_s,
                )
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.consumer.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
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
        """Offers a credit when idle, and refreshes one that is about to expire unclaimed."""
        if self._stopping:
            return
        now = wall_ms()
        if self._credit is not None and self._credit.expires_at_ms - now > 1000:
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
        )
        try:
            await self.credits.offer(credit)
        except TransportError as err:
            log.warning("could not offer a credit: %s; retrying", err)
            return
        self._credit = credit

    # the loop ----------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while not self._stopping:
            await self._offer()
            delivered = await self.consumer.next(self.settings.poll_timeout_s)
            if delivered is None:
                continue
            self._idle.clear()
            try:
                await self._handle(delivered)
            finally:
                self._idle.set()

    async def _handle(self, delivered: Delivered[Batch]) -> None:
        batch = delivered.value
        if self._credit is not None and (batch is None or batch.credit != self._credit.ref):
            await self._withdraw()  # this batch was not sent against our open credit: keep one at a time
        self._credit = None
        if batch is None:
            log.warning(
                "worker %s: undecodable batch at partition %d offset %d skipped",
                self.settings.worker_id,
                delivered.partition,
                delivered.offset,
            )
            await self.consumer.commit(delivered)
            return
        states = await self._process(batch)
        # storing results and committing must not be cut in half by a cancellation
        await asyncio.shield(self._finish(delivered, states))

    async def _finish(self, delivered: Delivered[Batch], states: list[TaskState]) -> None:
        await self.store.apply(states)
        await self._commit(delivered)

    async def _commit(self, delivered: Delivered[Batch]) -> None:
        try:
            await self.consumer.commit(delivered)
        except TransportError as err:
            # The results are stored; if the batch comes again (its partition moved on), the store
            # refuses the second copy of every result, so callers still see each answer once.
            log.warning(
                "worker %s: commit of batch at %d/%d failed: %s",
                self.settings.worker_id,
                delivered.partition,
                delivered.offset,
                err,
            )

    async def _process(self, batch: Batch) -> list[TaskState]:
        model = batch.model
        now = wall_ms()
        metrics.BATCH_WAIT.labels(model=model).observe(max(0, now - batch.created_at_ms) / 1000.0)
        live = [item for item in batch.items if item.deadline_ms > now]
        ended: list[TaskState] = [
            self._state(
                batch,
                item,
                TaskStatus.EXPIRED,
                error=_Failure(
                    "deadline_exceeded",
                    "the request's deadline passed before the GPU could run it; retry, or send a longer timeout_ms",
                ),
            )
            for item in batch.items
            if item.deadline_ms <= now
        ]
        results: dict[int, str | _Failure] = {}
        if live:
            running = asyncio.create_task(
                self.store.apply([self._state(batch, item, TaskStatus.RUNNING) for item in live])
            )
            start = time.monotonic()
            try:
                results = await self._run([item.input for item in live])
            finally:
                end = time.monotonic()
                await running
            self.batches_run += 1
            outcome = "ok" if all(isinstance(r, str) for r in results.values()) else "partial"
            metrics.WORKER_BATCHES.labels(worker=self.settings.worker_id, outcome=outcome).inc()
            if self.journal is not None:
                self.journal.record(
                    self.settings.worker_id, batch.batch_id, [i.task_id for i in live], start, end, outcome
                )
        await self._offer()  # the next batch travels while this one's results are stored
        for index, item in enumerate(live):
            result = results[index]
            if isinstance(result, str):
                ended.append(self._state(batch, item, TaskStatus.COMPLETED, output=result))
            else:
                ended.append(self._state(batch, item, TaskStatus.FAILED, error=result))
        for state in ended:
            metrics.TASKS_ENDED.labels(model=model, status=state.status.value).inc()
        return ended

    def _state(
        self,
        batch: Batch,
        item: BatchItem,
        status: TaskStatus,
        output: str | None = None,
        error: _Failure | None = None,
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

    # the backend -------------------------------------------------------------------------------
    async def _run(self, inputs: list[str]) -> dict[int, str | _Failure]:
        """Outputs by input index. Inputs the backend rejects up front never reach it; when a call
        fails, the batch is split in halves until the inputs that fail are alone (bisection), so
        the healthy ones still get answers."""
        results: dict[int, str | _Failure] = {}
        rejected: dict[int, InputError] = self.backend.input_errors(inputs)
        for index, err in rejected.items():
            results[index] = _Failure(err.code, str(err))
        todo = [index for index in range(len(inputs)) if index not in rejected]
        if todo:
            await self._bisect(inputs, todo, results)
        return results

    async def _bisect(self, inputs: list[str], indices: list[int], results: dict[int, str | _Failure]) -> None:
        try:
            outputs = await self._call([inputs[i] for i in indices])
        except Exception as err:
            if len(indices) == 1:
                results[indices[0]] = _Failure("backend_error", f"the model failed on this input: {err}")
                return
            middle = len(indices) // 2
            await self._bisect(inputs, indices[:middle], results)
            await self._bisect(inputs, indices[middle:], results)
            return
        for index, output in zip(indices, outputs, strict=True):
            results[index] = output

    async def _call(self, inputs: list[str]) -> list[str]:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        try:
            outputs = await loop.run_in_executor(self._executor, self.backend.batchstring, inputs)
        finally:
            elapsed = time.perf_counter() - start
            metrics.BACKEND_CALL.labels(model=self.settings.model, backend=self.backend.name).observe(elapsed)
            metrics.WORKER_BUSY.labels(worker=self.settings.worker_id).inc(elapsed)
        if len(outputs) != len(inputs):
            raise RuntimeError(f"backend returned {len(outputs)} outputs for {len(inputs)} inputs")
        return outputs
