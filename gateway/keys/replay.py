"""The store side of ``Idempotency-Key`` (rules in ``gateway.keys.idempotency``): binding a key to its
task, and giving a retry the task its key names.

A binding carries its task's deadline. Past it (and ``STALE_AFTER_MS``) a bound task that has not
ended never will: no batcher batches and no worker starts a request past its deadline. So a key whose
task was lost (its request never reached the bus and the store was down when the gateway tried to
unbind it, or that gateway died in between) names a new task from then on, instead of answering
every retry 504 until the key expires. A key bound to a task that is not stored at all is one whose
submit ended before it stored the task: a retry sends that task again (``Gateway._submit_keyed``).

A retry reads the bound task as a poll does (``TaskReads.read``): one still waiting late past its
deadline is ended ``expired`` by that read, so the retry starts a new task rather than replaying a
``queued`` that the next poll of it would end.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator
from contextlib import aclosing, suppress
from dataclasses import dataclass, replace

from gateway.answers.changes import follow
from gateway.answers.reads import TaskReads
from gateway.background import Background
from gateway.clock import Clock
from gateway.errors import TRANSPORT_ERRORS, DeadlineExceeded, IdempotencyKeyReused, Unavailable
from gateway.keys import idempotency
from schemas.records import TaskState, TaskStatus
from telemetry.logs import ids
from transport.ports import STALE_AFTER_MS, KeyClaim, TaskStore
from transport.retry import retry

log = logging.getLogger(__name__)

UNSTORED_GRACE_S = 1.0
"""How long a retry waits for the task its key names to be stored before it takes that task for one
whose submit ended first (``Gateway._submit_keyed``): a live submit stores it within a round trip."""

UNQUEUED = "the request never reached the request bus (the gateway could not send it); retry it"


@dataclass(frozen=True, slots=True)
class Bound:
    """A claimed key: the task it names and, when that is an earlier task, its stored state (None:
    not stored, see ``Gateway._submit_keyed``)."""

    claim: KeyClaim
    earlier: TaskState | None

    @property
    def task_id(self) -> str:
        return self.claim.task_id


class KeyedReplay:
    """Binds each Idempotency-Key to one task in the task store, and finds a retry the task its key names."""

    def __init__(self, store: TaskStore, clock: Clock, reads: TaskReads, *, recheck_s: float, name: str) -> None:
        """``reads``: how a retry reads the bound task (ended if late, as a poll reads it)."""
        self._store = store
        self._clock = clock
        self._reads = reads
        self._recheck_s = recheck_s
        self._settling = Background(f"{name}-key-settler")

    @property
    def alive(self) -> bool:
        return self._settling.alive

    async def start(self) -> None:
        await self._settling.start()

    async def close(self) -> None:
        """Stops unbinding keys whose tasks were lost (``STALE_AFTER_MS`` frees them later)."""
        await self._settling.close()

    async def claim(self, scope: str, key: str, task_id: str, fingerprint: str, deadline_ms: int) -> Bound:
        """Binds the key to ``task_id`` (whose deadline is ``deadline_ms``) when it is free, when the
        task it names ended without being computed (``idempotency.starts_anew``), or when that task is
        past its deadline and will never end; else returns the binding of the task to replay."""
        earlier: TaskState | None = None
        try:
            claim = await self._store.claim_key(scope, key, task_id, fingerprint, deadline_ms)
            if claim.task_id != task_id and claim.fingerprint == fingerprint:
                earlier = await self._reads.read(claim.task_id)  # None: its submit has not stored it
                if self._replaced(claim, earlier):
                    replaced = claim.task_id
                    claim = await self._store.rebind_key(scope, key, replaced, task_id, fingerprint, deadline_ms)
                    if claim.task_id != replaced:  # a racing retry's new task: ``earlier`` is not its state
                        earlier = None
        except TRANSPORT_ERRORS as err:
            raise Unavailable(f"the task store is unavailable: {err}") from err
        if claim.fingerprint != fingerprint:
            raise IdempotencyKeyReused(
                "this Idempotency-Key was used for a request with another input or model; send a new key for "
                "a new request (keys are kept as long as results)"
            )
        return Bound(claim, None if claim.task_id == task_id else earlier)

    async def stored(self, task_id: str, within_s: float) -> TaskState | None:
        """The task's stored state, waited for up to ``within_s``; None if it is still not stored."""
        until = asyncio.get_running_loop().time() + within_s
        try:
            async with self._store.watch(task_id) as changes:
                return await self._first_stored(task_id, changes, until)
        except TRANSPORT_ERRORS as err:
            raise Unavailable(f"the task store is unavailable: {err}") from err

    async def _first_stored(self, task_id: str, changes: AsyncIterator[TaskState], until: float) -> TaskState | None:
        """The task's state once it is stored (``changes``: its watch, opened before this read), or
        None if it is not stored by the loop time ``until``."""
        state = await self._store.get(task_id)
        with suppress(TimeoutError):
            async with asyncio.timeout_at(until):
                while state is None:
                    state = await anext(changes)
        # A synchronous task's end is published to its watchers only once it was stored
        # (``TaskStore.apply``): one that ended before its submit stored it is read, not heard.
        return state if state is not None else await self._store.get(task_id)

    async def release(self, scope: str, key: str, task_id: str, model: str, owner: str | None, deadline: float) -> None:
        """Unbinds the key from a task whose request never reached the bus, so that a retry creates
        the task anew. While the store is down, a task of its own ends that task ``failed``
        (``unavailable``: a retry waiting for it starts anew) and unbinds the key once the store is
        back, until ``deadline`` (loop time; the binding is stale from then on anyway)."""
        try:
            await self._store.release_key(scope, key, task_id)
        except TRANSPORT_ERRORS as err:
            log.info(
                "the idempotency key of task %s stays bound until the store is back: %s",
                task_id,
                err,
                extra=ids(task_id=task_id),
            )
            now_ms = self._clock.wall_ms()
            failed = TaskState(
                task_id,
                TaskStatus.FAILED,
                model,
                now_ms,
                now_ms,
                error_code=Unavailable.code,
                error_message=UNQUEUED,
                owner=owner,
            )
            if self._settling.alive:  # else the gateway is closing: the binding is freed once stale
                self._settling.spawn(self._settle(scope, key, failed, deadline), name=f"settle-{task_id}")

    async def _settle(self, scope: str, key: str, failed: TaskState, deadline: float) -> None:
        async def end_and_unbind() -> None:
            await self._store.apply([replace(failed, updated_at_ms=self._clock.wall_ms())])
            await self._store.release_key(scope, key, failed.task_id)

        loop = asyncio.get_running_loop()
        try:
            await retry(
                log,
                "gateway",
                f"ending unqueued task {failed.task_id}",
                end_and_unbind,
                1.0,
                give_up=lambda: loop.time() > deadline,
            )
        except TRANSPORT_ERRORS:
            log.warning(
                "could not end unqueued task %s before its deadline",
                failed.task_id,
                exc_info=True,
                extra=ids(task_id=failed.task_id),
            )

    async def ended(self, claim: KeyClaim, deadline: float, timeout_ms: int) -> TaskState | None:
        """A synchronous retry's answer: the bound task's terminal state, waited for up to this
        request's own ``deadline``; a task not stored yet is waited for rather than reported unknown.
        None when the task goes stale (see the module) first: the caller claims the key again."""
        task_id = claim.task_id
        until = min(deadline, asyncio.get_running_loop().time() + self._stale_in_s(claim))
        try:
            async with self._store.watch(task_id) as changes:
                state = await self._first_stored(task_id, changes, until)
                if state is not None and not state.status.terminal:
                    reads = self._reads
                    later_states = follow(reads.read, changes, state, until, self._recheck_s, reads.late_in_s)
                    async with aclosing(later_states) as later:
                        async for change in later:
                            state = change
        except TRANSPORT_ERRORS as err:
            raise Unavailable(f"the task store is unavailable: {err}") from err
        if state is not None and state.status.terminal:
            return state
        if until < deadline:
            return None
        raise DeadlineExceeded(
            f"no answer within timeout_ms={timeout_ms} from the task this Idempotency-Key names; it may still "
            "finish: poll its result",
            task_id=task_id,
            replayed=True,
        )

    def _replaced(self, claim: KeyClaim, earlier: TaskState | None) -> bool:
        """Whether a retry replaces the bound task: it ended uncomputed, or it is stale."""
        if earlier is not None and earlier.status.terminal:
            return idempotency.starts_anew(earlier)
        return self._stale_in_s(claim) <= 0

    def _stale_in_s(self, claim: KeyClaim) -> float:
        """Seconds until the bound task, not ended by then, never will (inf: a binding without a deadline)."""
        if claim.deadline_ms is None:
            return math.inf
        return (claim.deadline_ms + STALE_AFTER_MS - self._clock.wall_ms()) / 1000
