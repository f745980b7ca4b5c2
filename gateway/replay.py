"""The store side of ``Idempotency-Key`` (rules in ``gateway.idempotency``): binding a key to its
task, and giving a retry the task its key names."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

from gateway import idempotency
from gateway.answers import Accepted
from gateway.changes import follow
from gateway.clock import Clock
from gateway.errors import TRANSPORT_ERRORS, DeadlineExceeded, IdempotencyKeyReused, Unavailable
from schemas.records import TaskState, TaskStatus
from transport.ports import KeyClaim, TaskStore

log = logging.getLogger(__name__)


class KeyedReplay:
    """Binds each Idempotency-Key to one task in the task store, and finds a retry the task its key names."""

    def __init__(self, store: TaskStore, clock: Clock, *, recheck_s: float) -> None:
        self._store = store
        self._clock = clock
        self._recheck_s = recheck_s

    async def claim(self, scope: str, key: str, task_id: str, fingerprint: str) -> KeyClaim:
        """Binds the key to ``task_id`` when it is free, or when the task it names ended without being
        computed (``idempotency.starts_anew``); else returns the binding of the task to replay."""
        try:
            claim = await self._store.claim_key(scope, key, task_id, fingerprint)
            if claim.task_id != task_id and claim.fingerprint == fingerprint:
                earlier = await self._store.get(claim.task_id)  # None: its submit has not stored it yet
                if earlier is not None and idempotency.starts_anew(earlier):
                    claim = await self._store.rebind_key(scope, key, claim.task_id, task_id, fingerprint)
        except TRANSPORT_ERRORS as err:
            raise Unavailable(f"the task store is unavailable: {err}") from err
        if claim.fingerprint != fingerprint:
            raise IdempotencyKeyReused(
                "this Idempotency-Key was used for a request with another input or model; send a new key for "
                "a new request (keys are kept as long as results)"
            )
        return claim

    async def release(self, scope: str, key: str, task_id: str) -> None:
        """Unbinds the key from a task that was never queued, so that a retry may create it."""
        try:
            await self._store.release_key(scope, key, task_id)
        except TRANSPORT_ERRORS:
            log.warning("could not release the idempotency key of task %s", task_id, exc_info=True)

    async def accepted(self, task_id: str, model: str, owner: str | None) -> Accepted:
        """An asynchronous retry's answer: the earlier task, recorded as queued if it is not stored yet.

        The earlier task may not be stored yet (its submit is between claiming the key and storing
        the task, or its record was lost to a store outage after its request was sent). ``create``
        keeps whatever a batcher or worker stored first, and the original submit's own create then
        finds it: the id handed out is then one GET can find.
        """
        try:
            state = await self._store.get(task_id)
            if state is None:
                now_ms = self._clock.wall_ms()
                await self._store.create(TaskState(task_id, TaskStatus.QUEUED, model, now_ms, now_ms, owner=owner))
        except TRANSPORT_ERRORS as err:
            raise Unavailable(f"the task store is unavailable: {err}") from err
        return Accepted(task_id, model, replayed=True, status=state.status if state else TaskStatus.QUEUED)

    async def ended(self, task_id: str, deadline: float, timeout_ms: int) -> TaskState:
        """A synchronous retry's answer: the earlier task's terminal state, waited for up to this
        request's own ``deadline``; a task not stored yet is waited for rather than reported unknown."""
        try:
            async with self._store.watch(task_id) as changes:
                state = await self._store.get(task_id)
                try:
                    async with asyncio.timeout_at(deadline):
                        while state is None:
                            state = await anext(changes)
                except TimeoutError:
                    state = None
                if state is not None and not state.status.terminal:
                    async with aclosing(follow(self._store, changes, state, deadline, self._recheck_s)) as later:
                        async for change in later:
                            state = change
        except TRANSPORT_ERRORS as err:
            raise Unavailable(f"the task store is unavailable: {err}") from err
        if state is None or not state.status.terminal:
            raise DeadlineExceeded(
                f"no answer within timeout_ms={timeout_ms} from the task this Idempotency-Key names; it may still "
                "finish: poll its result",
                task_id=task_id,
            )
        return state
