"""The gateway's side of the result cache: answer a request from it, fill it, and bypass it on failure.

A hit answers without the bus or a worker: the caller still gets a task id of its own, stored
``completed`` with the cached output, so polls, events and ``DELETE`` behave as for any ended task.
Only completed answers are written, so a failure is never served from the cache. Every failure of
the cache's store is a bypass: the request goes the normal way, and the failure is counted.
"""

from __future__ import annotations

import logging

from gateway.clock import Clock
from gateway.errors import TRANSPORT_ERRORS
from schemas.records import TaskState, TaskStatus
from telemetry.logs import ids
from telemetry.metrics import CACHE_BYPASSED, CACHE_HITS, CACHE_MISSES
from transport.ports import ResultCache, TaskStore

log = logging.getLogger(__name__)


class CachedAnswers:
    """Reads and writes completed answers under their keys (``gateway.sharing.answer_keys``) for ``ttl_s``."""

    def __init__(self, cache: ResultCache, store: TaskStore, clock: Clock, *, ttl_s: float) -> None:
        if not ttl_s > 0:
            raise ValueError(f"a result cache needs ttl_s > 0, got {ttl_s}")
        self._cache = cache
        self._store = store
        self._clock = clock
        self._ttl_s = ttl_s

    async def answer(self, key: str, task_id: str, model: str, owner: str | None, *, wait: bool) -> TaskState | None:
        """The completed state of a new task ``task_id`` from the cache, or None (a miss or a bypass).

        Its record is stored first; a synchronous caller is answered even when that write fails
        (it holds the answer), or without it while the store is full; an asynchronous one, who must
        poll for it, goes the normal way.
        """
        try:
            output = await self._cache.get(key)
        except TRANSPORT_ERRORS:
            CACHE_BYPASSED.labels(model=model).inc()
            log.debug(
                "result cache unreadable; request %s goes the normal way",
                task_id,
                exc_info=True,
                extra=ids(task_id=task_id),
            )
            return None
        if output is None:
            CACHE_MISSES.labels(model=model).inc()
            return None
        now_ms = self._clock.wall_ms()
        state = TaskState(task_id, TaskStatus.COMPLETED, model, now_ms, now_ms, output=output, owner=owner)
        if wait and self._store.refuses_writes() is not None:
            CACHE_HITS.labels(model=model).inc()
            return state  # a store that refuses writes: the write would fail, and the caller holds the answer
        try:
            await self._store.create(state)
        except TRANSPORT_ERRORS:
            if not wait:
                CACHE_BYPASSED.labels(model=model).inc()
                return None
            log.warning("could not record cached answer of task %s", task_id, exc_info=True, extra=ids(task_id=task_id))
        CACHE_HITS.labels(model=model).inc()
        return state

    async def keep(self, key: str, state: TaskState) -> None:
        """Writes a completed answer; any other end is never written."""
        if state.status is not TaskStatus.COMPLETED or state.output is None:
            return
        try:
            await self._cache.put(key, state.output, self._ttl_s)
        except TRANSPORT_ERRORS:
            CACHE_BYPASSED.labels(model=state.model).inc()
            log.debug(
                "result cache unwritable; answer of %s not kept",
                state.task_id,
                exc_info=True,
                extra=ids(task_id=state.task_id),
            )
