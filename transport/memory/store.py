"""The embedded mode's task store: task states and idempotency keys in dicts, bounded by age, count
and bytes.

With ``max_bytes`` the store keeps what it holds, plus the inputs that wait for a worker (``queued``:
the request bus), under one budget. Ended tasks are dropped oldest-ended first to make room. Once
only tasks not yet ended are left, ``full`` says so and the gateway refuses new submits: those for
a model whose queued inputs fill its share of the budget (the budget over the models served, so a
model that cannot keep up does not shut out the others), and every submit once the whole budget is
held. An idempotency key lives as long as its task (kept ``ttl_s`` from its binding, and from its
task's end once that comes later), so a retry after its task was dropped starts a new one instead of
waiting for a state that will never come, and one while its result is kept replays it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Protocol

from schemas.records import TaskState, TaskStatus
from telemetry import metrics
from transport.ports import KeyClaim, ReplyHandler, binding_ttl_ms

ENTRY_BYTES = 600
"""What one stored task or key costs beyond its large strings: its objects, short ids, dict slots."""

BUDGET_VARIABLE = "BATCHWIRE_MAX_STORE_BYTES"

_Key = tuple[str, str]  # (scope, key)


def state_bytes(state: TaskState) -> int:
    """The memory one stored task state holds (its output and error text counted as Python keeps them)."""
    size = ENTRY_BYTES
    if state.output is not None:
        size += sys.getsizeof(state.output)
    if state.error_message is not None:
        size += sys.getsizeof(state.error_message)
    return size


class QueuedInputs(Protocol):
    """Where inputs wait for a worker, and what they hold."""

    @property
    def models(self) -> tuple[str, ...]: ...
    def queued_bytes(self, model: str | None = None) -> int:
        """Bytes the inputs waiting for a worker hold: ``model``'s, else all."""
        ...


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(slots=True)
class _Stored:
    expires_s: float
    state: TaskState
    size: int


@dataclass(slots=True)
class _Bound:
    expires_s: float
    claim: KeyClaim
    size: int


class MemoryTaskStore:
    """Task states in a dict, bounded by age (``ttl_s``), count (``max_tasks``, ended tasks only)
    and, with ``max_bytes``, by bytes (see the module docstring)."""

    def __init__(
        self,
        ttl_s: float = 3600.0,
        max_tasks: int = 200_000,
        *,
        max_bytes: int | None = None,
        queued: QueuedInputs | None = None,
    ) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.ttl_s = ttl_s
        self.max_tasks = max_tasks
        self.max_bytes = max_bytes
        self._queued = queued
        self._pinned: Callable[[], int] = queued.queued_bytes if queued is not None else (lambda: 0)
        self._tasks: OrderedDict[str, _Stored] = OrderedDict()  # by last write: expiry order
        self._ended: OrderedDict[str, None] = OrderedDict()  # ended tasks, in the order they ended
        self._keys: OrderedDict[_Key, _Bound] = OrderedDict()  # by binding: expiry order
        self._key_of: dict[str, _Key] = {}  # task id -> the key bound to it
        self._bytes = 0
        self._feed_return: list[Callable[[], None]] = []
        self._watchers: dict[str, set[asyncio.Queue[TaskState]]] = {}
        self._replies: dict[str, ReplyHandler] = {}
        self._closed = asyncio.Event()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        self._closed.set()

    def reachable(self) -> bool:
        return not self._closed.is_set()

    def on_feed_return(self, callback: Callable[[], None]) -> None:
        """The feed is in-process and never drops: ``callback`` is kept and never called."""
        self._feed_return.append(callback)

    @property
    def held_bytes(self) -> int:
        """What the stored tasks and keys hold, by this store's count."""
        return self._bytes

    def refuses_writes(self) -> str | None:
        return None  # its budget is per model (``full``)

    def full(self, model: str) -> str | None:
        live = len(self._tasks) - len(self._ended)
        if live >= self.max_tasks:  # the count limit drops ended tasks only (``_evict``)
            return (
                f"the embedded service holds {live} tasks not yet ended, the most it keeps; nothing was queued: "
                "retry after the Retry-After delay"
            )
        if self.max_bytes is None:
            return None
        self._shrink()
        if self._queued is not None:
            models = len(self._queued.models) or 1
            queued = self._queued.queued_bytes(model)
            if queued >= self.max_bytes // models:
                share = f"{BUDGET_VARIABLE} = {self.max_bytes}" + (f", over {models} models" if models > 1 else "")
                return (
                    f"model {model!r} has {_mib(queued)} of inputs waiting for a worker, its share of the "
                    f"embedded service's memory ({share}); nothing was queued: retry after the Retry-After delay"
                )
        held = self._bytes + self._pinned()
        if held < self.max_bytes:
            return None
        return (
            f"the embedded service holds {_mib(held)} for tasks not yet ended, its memory limit "
            f"({BUDGET_VARIABLE} = {self.max_bytes}); nothing was queued: retry after the Retry-After delay"
        )

    # bounds ------------------------------------------------------------------------------------

    def _evict(self) -> None:
        """Drops tasks past their TTL (oldest write first), then beyond ``max_tasks`` ended ones
        (oldest-ended first, as for bytes: a task waiting in a backlog is older than the results that
        ended since; a live one is never dropped, ``full`` refuses submits instead), then shrinks."""
        now = time.monotonic()
        while self._tasks:
            task_id, stored = next(iter(self._tasks.items()))
            if stored.expires_s > now:
                break
            # A task past its TTL that has not ended may still end (a missing task takes any state): its
            # key stays bound until its binding expires (``binding_ttl_ms``), as a Redis key outlives its hash.
            self._drop(task_id, unbind=task_id in self._ended)
        while len(self._tasks) > self.max_tasks and self._ended:
            self._drop(next(iter(self._ended)))
        self._shrink()

    def _shrink(self) -> None:
        """Drops ended tasks, the oldest-ended first, until the store is under its budget (``full`` refuses at it)."""
        if self.max_bytes is None:
            return
        while self._ended and self._bytes + self._pinned() >= self.max_bytes:
            self._drop(next(iter(self._ended)))

    def _drop(self, task_id: str, *, unbind: bool = True) -> None:
        stored = self._tasks.pop(task_id, None)
        if stored is not None:
            self._bytes -= stored.size
        self._ended.pop(task_id, None)
        bound = self._key_of.get(task_id)
        if bound is not None and unbind:
            self._unbind(bound)

    def _put(self, state: TaskState) -> None:
        size = state_bytes(state)
        previous = self._tasks.pop(state.task_id, None)
        if previous is not None:
            self._bytes -= previous.size
        expires_s = time.monotonic() + self.ttl_s
        self._tasks[state.task_id] = _Stored(expires_s, state, size)
        self._bytes += size
        if state.status.terminal:
            self._ended[state.task_id] = None
            if (bound := self._key_of.get(state.task_id)) is not None:
                held = self._keys[bound]
                held.expires_s = max(held.expires_s, expires_s)  # kept as long as the result it names
                self._keys.move_to_end(bound)
        else:  # a task that ended and expired takes any state again: live now, not one to drop for bytes
            self._ended.pop(state.task_id, None)

    # tasks -------------------------------------------------------------------------------------

    async def create(self, state: TaskState) -> bool:
        self._evict()
        current = self._lookup(state.task_id)
        if current is not None:
            if current.status.rank <= state.status.rank:
                return False
            if current.owner is None and state.owner is not None:
                self._put(replace(current, owner=state.owner))
            return True
        self._put(state)
        self._publish(state)
        return True

    async def apply(self, updates: Sequence[TaskState], *, counted: bool = True) -> list[bool]:
        applied: list[bool] = []
        for state in updates:
            current = self._lookup(state.task_id)
            if current is not None and (current.status.terminal or state.status.rank <= current.status.rank):
                applied.append(False)
                continue
            if current is None and state.reply_to is not None and not state.status.terminal:
                applied.append(True)  # an unstored synchronous task's progress: checked, not written
                continue
            if current is not None and current.owner is not None and state.owner is None:
                state = replace(state, owner=current.owner)  # the owner is set once, at create
            self._write(state)
            applied.append(True)
        self._evict()  # a plain synchronous task is never created: its end is its first write
        if counted:
            metrics.count_ended(state for state, ok in zip(updates, applied, strict=True) if ok)
        return applied

    def _write(self, state: TaskState) -> None:
        self._put(state)
        self._publish(state)
        if state.status.terminal and state.reply_to is not None:
            handler = self._replies.get(state.reply_to)
            if handler is not None:
                handler(state)

    async def cancel(
        self, task_id: str, reason_code: str, message: str, status: TaskStatus = TaskStatus.CANCELLED
    ) -> TaskState | None:
        current = self._lookup(task_id)
        if current is None or current.status.rank > TaskStatus.BATCHED.rank:
            return current
        cancelled = replace(
            current,
            status=status,
            updated_at_ms=_now_ms(),
            error_code=reason_code,
            error_message=message,
        )
        self._write(cancelled)
        self._evict()
        metrics.count_ended([cancelled])
        return cancelled

    def _lookup(self, task_id: str) -> TaskState | None:
        stored = self._tasks.get(task_id)
        if stored is None or stored.expires_s <= time.monotonic():
            return None
        return stored.state

    def _publish(self, state: TaskState) -> None:
        for queue in self._watchers.get(state.task_id, ()):
            queue.put_nowait(state)

    async def get(self, task_id: str) -> TaskState | None:
        return self._lookup(task_id)

    async def get_many(self, task_ids: Collection[str]) -> dict[str, TaskState]:
        found = {task_id: self._lookup(task_id) for task_id in task_ids}
        return {task_id: state for task_id, state in found.items() if state is not None}

    # idempotency keys --------------------------------------------------------------------------

    async def claim_key(
        self, scope: str, key: str, task_id: str, fingerprint: str, deadline_ms: int | None = None
    ) -> KeyClaim:
        self._evict_keys()
        held = self._held((scope, key))
        if held is not None:
            return held.claim
        return self._bind((scope, key), KeyClaim(task_id, fingerprint, deadline_ms))

    async def rebind_key(
        self,
        scope: str,
        key: str,
        ended_task_id: str,
        task_id: str,
        fingerprint: str,
        deadline_ms: int | None = None,
    ) -> KeyClaim:
        self._evict_keys()
        held = self._held((scope, key))
        if held is not None:
            if held.claim.task_id != ended_task_id:
                return held.claim
            self._unbind((scope, key))
        return self._bind((scope, key), KeyClaim(task_id, fingerprint, deadline_ms))

    async def release_key(self, scope: str, key: str, task_id: str) -> None:
        held = self._held((scope, key))
        if held is not None and held.claim.task_id == task_id:
            self._unbind((scope, key))

    def _held(self, bound: _Key) -> _Bound | None:
        """The binding of ``bound`` unless it expired: bindings made with a deadline expire out of
        their order, so the sweep (``_evict_keys``) may not have reached an expired one yet."""
        held = self._keys.get(bound)
        if held is None:
            return None
        if held.expires_s <= time.monotonic():
            self._unbind(bound)
            return None
        return held

    def _bind(self, bound: _Key, claim: KeyClaim) -> KeyClaim:
        size = ENTRY_BYTES + len(bound[0]) + len(bound[1])
        ttl_s = binding_ttl_ms(int(self.ttl_s * 1000), claim.deadline_ms, _now_ms()) / 1000
        self._keys[bound] = _Bound(time.monotonic() + ttl_s, claim, size)
        self._key_of[claim.task_id] = bound
        self._bytes += size
        self._shrink()
        return claim

    def _unbind(self, bound: _Key) -> None:
        held = self._keys.pop(bound)
        self._bytes -= held.size
        if self._key_of.get(held.claim.task_id) == bound:
            del self._key_of[held.claim.task_id]

    def _evict_keys(self) -> None:
        """Drops expired bindings. None goes for the count: a key goes with its task (``_drop``), so the
        tasks' bounds hold the keys too, and one dropped before its task would start a second computation
        of it (at the count of live tasks, keyed submits still claim before ``full`` refuses them)."""
        now = time.monotonic()
        while self._keys:  # oldest binding first (``_held`` drops an expired one the sweep has not reached)
            oldest, held = next(iter(self._keys.items()))
            if held.expires_s > now:
                break
            self._unbind(oldest)

    # changes -----------------------------------------------------------------------------------

    @asynccontextmanager
    async def watch(self, task_id: str) -> AsyncIterator[AsyncIterator[TaskState]]:
        queue: asyncio.Queue[TaskState] = asyncio.Queue()
        self._watchers.setdefault(task_id, set()).add(queue)
        try:
            yield _drain(queue)
        finally:
            watchers = self._watchers.get(task_id)
            if watchers is not None:
                watchers.discard(queue)
                if not watchers:
                    del self._watchers[task_id]

    async def listen_replies(self, gateway_id: str, handler: ReplyHandler) -> None:
        self._replies[gateway_id] = handler

    async def ready(self) -> bool:
        return not self._closed.is_set()


async def _drain(queue: asyncio.Queue[TaskState]) -> AsyncIterator[TaskState]:
    while True:
        yield await queue.get()
