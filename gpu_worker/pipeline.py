"""The batches whose backend calls run or wait on the backend's thread, as tasks of one TaskGroup.

A first delivery's call is queued behind the running one at once, so the thread starts it the
moment the running call returns: back to back, the GPU waits for neither the batcher, the bus, nor
an event loop busy with the last batch's answers. At most two calls are in flight: the next credit
is offered only once the running call is about to end (``until_free_soon``).

The worker's loop runs in the same TaskGroup: a call that fails (or hangs) cancels the loop, so
no further batch is taken, and the calls still queued, whose batches go back uncommitted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

from gpu_worker.calls import GroupResult
from gpu_worker.runner import BackendRunner

HAND_OVER_POLL_S = 0.001
"""How often ``until_free_soon`` looks again while a call is being handed to the backend's thread
(its start time unknown yet): the next credit goes out no sooner than this after the hand-over."""


@dataclass(frozen=True, slots=True)
class InFlight:
    """A batch whose backend call runs or waits on the thread."""

    batch_id: str
    task: asyncio.Task[None]
    result: GroupResult
    """Filled as the call runs: ``result.first.started`` is when the thread began it."""
    size: int


class Pipeline:
    """Owns the loop and the in-flight calls in one TaskGroup, and says when the backend frees."""

    def __init__(self, runner: BackendRunner) -> None:
        self.runner = runner
        self._group: asyncio.TaskGroup | None = None
        self._started: list[InFlight] = []
        """Oldest first (at most two in flight); an entry whose task is done is pruned when read."""
        self._loop_idle = asyncio.Event()
        self._loop_idle.set()

    async def run(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Runs ``loop`` until it returns and every call it started has ended; an error in either
        cancels the rest and comes out (grouped, as a TaskGroup raises it)."""
        async with asyncio.TaskGroup() as group:
            self._group = group
            try:
                await loop()
            finally:
                self._group = None

    @property
    def _in_flight(self) -> list[InFlight]:
        self._started = [entry for entry in self._started if not entry.task.done()]
        return self._started

    @property
    def empty(self) -> bool:
        """No call runs or waits on the backend's thread."""
        return not self._in_flight

    @property
    def idle(self) -> bool:
        """No batch in hand: the loop handles none (a redelivered batch runs its calls there, outside the
        calls in flight) and no call runs or waits."""
        return self._loop_idle.is_set() and self.empty

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """Marks the loop busy with a batch while the block runs (see ``drained``)."""
        self._loop_idle.clear()
        try:
            yield
        finally:
            self._loop_idle.set()

    async def drained(self) -> None:
        """Returns once the loop handles no batch and no call is in flight."""
        while not self.idle:
            await self._loop_idle.wait()
            await self.backend_free()

    def start(
        self, batch_id: str, result: GroupResult, size: int, call: Coroutine[Any, Any, None]
    ) -> asyncio.Task[None]:
        """Starts ``call`` (which fills ``result``) beside the loop, behind the calls in flight."""
        assert self._group is not None, "calls start from the loop, inside run()"
        try:
            task = self._group.create_task(call, name="backend-call")
        except RuntimeError:  # the group is shutting down (a call failed or hung): ``call`` never runs
            call.close()
            raise
        self._started.append(InFlight(batch_id, task, result, size))
        return task

    def running(self, batch_id: str) -> bool:
        """Whether a call of batch ``batch_id`` runs or waits on the backend's thread."""
        return any(entry.batch_id == batch_id for entry in self._in_flight)

    async def backend_free(self) -> None:
        """Waits until no call runs or waits on the backend's thread."""
        while self._in_flight:
            await asyncio.wait([self._in_flight[0].task])

    def busy_for_s(self) -> float:
        """How long until the backend should be idle: 0 unless a call is in flight."""
        expected_s = self.runner.expected_s
        if not self._in_flight or expected_s is None:
            return 0.0
        started = self._in_flight[-1].result.first.started
        if started is None:
            return expected_s
        return max(0.0, started + expected_s - self.runner.clock())

    async def until_free_soon(self, lead_s: Callable[[int], float]) -> None:
        """Returns once the backend is idle, or runs one call expected to end within its lead
        (``lead_s`` of its batch size)."""
        while self._in_flight:
            oldest = self._in_flight[0]
            lead = lead_s(oldest.size)
            expected_s = self.runner.expected_s
            started = oldest.result.first.started
            wait_s: float | None = None  # until the oldest call ends
            if len(self._in_flight) == 1 and lead > 0 and expected_s is not None:
                if started is None:
                    wait_s = HAND_OVER_POLL_S  # its call is being handed to the thread
                else:
                    wait_s = started + expected_s - lead - self.runner.clock()
                    if wait_s <= 0:
                        return
            await asyncio.wait([oldest.task], timeout=wait_s)
