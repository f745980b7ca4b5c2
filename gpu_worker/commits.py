"""Storing a batch's results and committing it, one batch after another in the order they came.

Commits go in offset order: a batch's offset commits every offset before it, so each batch takes
its place in the commit order when it is fetched (``reserve``), and is committed only after every
batch fetched before it, whichever call ends first (a failing call is split and runs again behind
the call queued after it). Once one is left uncommitted (its results not stored or not on enough
Redis replicas, or its call never ended), no later one is committed: those batches are kept in
``given_back`` for a supervisor that sends them again (embedded mode). Stores and commits run in two
tasks of their own, which neither a cancelled loop nor a failed backend call cuts in half, while
the loop goes on: on a busy event loop, waiting for the store first would leave the GPU idle as
long. A store does not wait for the commits before it: a commit may wait for the group's coordinator
(a broker failing over), and callers must not wait with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_worker.calls import GroupResult
from schemas.records import Batch, TaskState
from telemetry import spans, tracing
from telemetry.logs import ids
from transport.cancelling import cancel_and_wait
from transport.deliveries import DeliveryLog
from transport.ports import BatchConsumer, Delivered, TaskStore, TransportError
from transport.replicas import ReplicaWait
from transport.retry import Retrying

log = logging.getLogger(__name__)


Timed = GroupResult | None
"""A batch's backend calls with their times (on ``time.monotonic``, the runner's clock), for its spans."""


@dataclass(slots=True)
class Slot:
    """A fetched batch's place in the commit order; its results come later (``Committer.fill``)."""

    delivered: Delivered[Batch]
    states: list[TaskState] = field(default_factory=list)
    call: Timed = None
    filled: bool = False
    handed_ns: int = 0
    """When the results were handed in (wall clock), only while tracing."""
    stored_ns: int = 0
    """When they were stored (wall clock), only while tracing."""
    safe: bool = False
    """Stored (on enough Redis replicas where asked): the batch may be committed."""
    stored: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    """Done once its store was tried (or it was given up): its commit may go."""
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    receipt: str | None = None
    """This worker's receipt of the delivery (``DeliveryLog.begin``), once it counts it: a hand-back names it."""


class Committer:
    """Stores results as they are handed in, and commits batches in the order they were fetched
    (``reserve``), in two tasks it owns."""

    def __init__(
        self,
        worker_id: str,
        consumer: BatchConsumer,
        store: TaskStore,
        deliveries: DeliveryLog,
        replicas: ReplicaWait | None,
        retry: Retrying,
        on_failure: Callable[[BaseException], None],
        *,
        abandoned: Callable[[], bool],
        stopping: Callable[[], bool],
    ) -> None:
        self.worker_id = worker_id
        self.consumer = consumer
        self.store = store
        self.deliveries = deliveries
        self.replicas = replicas
        """When set, a batch is committed only once its results are on enough Redis replicas."""
        self.retry = retry
        self.on_failure = on_failure
        """Told of a batch that could not be stored (the worker stops); later batches stay uncommitted."""
        self.abandoned = abandoned
        self.stopping = stopping
        self.batches_done = 0
        """Batches finished with: results stored and commit attempted (or skipped as undecodable)."""
        self._stores: asyncio.Queue[Slot] = asyncio.Queue()
        self._commits: asyncio.Queue[Slot] = asyncio.Queue()
        self._held_back = False
        """A batch was left uncommitted: no later one is committed."""
        self.given_back: list[Batch] = []
        """The batches left uncommitted, in the order they came."""
        self._tasks: list[asyncio.Task[None]] = []
        self._in_hand: list[Slot] = []
        """Batches fetched and not yet through (committed, or held back), in the order they came."""

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._store_loop(), name=f"stores-{self.worker_id}"),
            asyncio.create_task(self._commit_loop(), name=f"commits-{self.worker_id}"),
        ]

    def reserve(self, delivered: Delivered[Batch]) -> Slot:
        """The batch's place in the commit order, behind every batch reserved before it. It must be
        filled or given up, or no later batch is committed."""
        slot = Slot(delivered)
        self._commits.put_nowait(slot)
        self._in_hand.append(slot)
        return slot

    @property
    def in_hand(self) -> int:
        """Batches fetched and not yet through (committed, or held back)."""
        return len(self._in_hand)

    def holding(self, partitions: frozenset[int] | None = None) -> list[Slot]:
        """The slots of the batches in hand (of ``partitions``, else all)."""
        return [slot for slot in self._in_hand if partitions is None or slot.delivered.partition in partitions]

    def fill(self, slot: Slot, states: list[TaskState], call: Timed = None) -> asyncio.Future[None]:
        """Queues the batch's results (none for an undecodable one) to be stored at once; the future
        is done once the batch is through, stored and committed or held back."""
        if slot.filled:
            raise RuntimeError(f"the results of batch at {slot.delivered.offset} were handed in twice")
        slot.filled = True
        slot.states, slot.call = states, call
        slot.handed_ns = time.time_ns() if tracing.ACTIVE else 0
        self._stores.put_nowait(slot)
        return slot.done

    def give_up(self, slot: Slot) -> None:
        """The batch will have no results (its call failed or was cancelled): it goes back uncommitted,
        and every batch after it with it. Nothing once it was filled."""
        if not slot.filled:
            slot.filled = True
            slot.stored.set_result(None)

    async def stored(self) -> None:
        """Returns once the results of every batch handed in are stored (or their store was given up)."""
        await self._stores.join()

    async def drained(self) -> None:
        """Returns once every batch handed in is through."""
        await self.stored()
        await self._commits.join()

    async def close(self) -> None:
        """Lets the batches handed in go through (their retries give up once ``abandoned()``), then stops."""
        if not self._tasks:
            return
        await self.drained()
        await asyncio.gather(*(cancel_and_wait(task) for task in self._tasks))
        self._tasks = []

    async def _store_loop(self) -> None:
        while True:
            handed = await self._stores.get()
            try:
                await self._store(handed)
                if handed.stored_ns and handed.handed_ns and handed.delivered.value is not None:
                    _traced(handed.delivered.value, handed.call, handed.handed_ns, handed.stored_ns)
            except asyncio.CancelledError:
                raise
            except BaseException as err:
                handed.safe = False
                self.on_failure(err)
            finally:
                handed.stored.set_result(None)
                self._stores.task_done()

    async def _commit_loop(self) -> None:
        while True:
            handed = await self._commits.get()
            try:
                await handed.stored
                await self._through(handed)
            except asyncio.CancelledError:
                raise
            except BaseException as err:
                self._held_back = True
                self.on_failure(err)
            finally:
                if not handed.done.done():  # a waiter that was cancelled cancelled it
                    handed.done.set_result(None)
                self._in_hand.remove(handed)
                self._commits.task_done()

    async def _store(self, handed: Slot) -> None:
        states, batch = handed.states, handed.delivered.value
        if (
            self.replicas is not None and batch is not None
        ):  # every state again: earlier writes may be on a lost primary
            handed.safe = await self.replicas.store_results(states, give_up=self.abandoned, stopping=self.stopping)
        else:
            if states:
                await self.retry("storing results", lambda: self.store.apply(states))
            handed.safe = True
        if tracing.ACTIVE:
            handed.stored_ns = time.time_ns()  # what the callers wait for; the commit follows

    async def _through(self, handed: Slot) -> None:
        delivered, batch = handed.delivered, handed.delivered.value
        self._held_back = self._held_back or not handed.safe
        if self._held_back:  # committing this batch's offset would also commit one left uncommitted before it
            if batch is not None:
                self.given_back.append(batch)
            log.info(
                "worker %s: batch at %d/%d goes back uncommitted (its results, or an earlier batch's, are not safe)",
                self.worker_id,
                delivered.partition,
                delivered.offset,
            )
            return
        # Forgotten only once committed: one that comes again (maybe to a worker that holds it now)
        # still counts its deliveries, marks and strikes.
        if await self._commit(delivered) and batch is not None:
            try:
                await self.deliveries.finish(batch.batch_id)
            except TransportError as err:  # it expires on its own
                log.debug(
                    "worker %s: could not forget batch %s: %s",
                    self.worker_id,
                    batch.batch_id,
                    err,
                    extra=ids(batch_id=batch.batch_id, traceparent=batch.traceparent),
                )
        self.batches_done += 1

    async def _commit(self, delivered: Delivered[Batch]) -> bool:
        """Whether the batch was committed."""
        try:
            await self.consumer.commit(delivered)
        except TransportError as err:
            # The results are stored; if the batch comes again (its partition moved on), its tasks
            # have ended, so the next holder runs none of them and callers see each answer once.
            log.warning(
                "worker %s: commit of batch at %d/%d failed: %s",
                self.worker_id,
                delivered.partition,
                delivered.offset,
                err,
            )
            return False
        return True


def _traced(batch: Batch, call: Timed, handed_ns: int, stored_ns: int) -> None:
    """Records the batch's worker spans (``telemetry.spans.batch_ran``) once its results are stored."""
    started, ended = (None, None) if call is None else (call.started, call.ended)
    call_s = None if started is None or ended is None else (started, ended)
    try:
        spans.batch_ran(batch, call_s, time.monotonic(), handed_ns, stored_ns)
    except Exception:  # a trace is worth less than the batch: its commit has happened, and goes on
        log.warning(
            "could not record the spans of batch %s", batch.batch_id, exc_info=True, extra=ids(batch_id=batch.batch_id)
        )
