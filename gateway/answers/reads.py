"""Reading tasks: poll, long-poll, event streams and cancellation, each seen only by the task's owner.

A task created under one API key is invisible to every other key: it answers exactly like a task
that does not exist (404), so ids cannot be probed. A read of a task still waiting (queued, batched)
``reply_recheck_s`` past its deadline also ends it ``expired``: the batcher that would may be down, and
the caller learns the end when it reads, not when a batcher comes back.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import AsyncExitStack, aclosing, asynccontextmanager, contextmanager

from gateway.answers.changes import follow
from gateway.answers.replies import LAST_LOOK_S
from gateway.clock import Clock
from gateway.errors import (
    TRANSPORT_ERRORS,
    DeadlineExceeded,
    InvalidTaskId,
    NotCancellable,
    Overloaded,
    TaskNotFound,
    Unavailable,
    ValidationFailed,
)
from gateway.settings import GatewaySettings, env_name
from schemas.records import TaskState, TaskStatus
from telemetry.logs import ids
from telemetry.metrics import WATCHERS
from transport.ports import TaskStore

log = logging.getLogger(__name__)

# Task ids are ours (``secrets.token_urlsafe``), but a client may send anything: keep odd
# characters out of store keys and channel names.
TASK_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,128}")

CANCELLED_BY_OWNER = "cancelled"
PAST_DEADLINE = (
    "the request's deadline passed before a GPU worker took it (no batcher or worker reached it in time); "
    "retry, or send a longer timeout_ms"
)


class TaskReads:
    """The read side of the gateway over the task store, with its count of open watches; its one write
    ends a task it reads late (``_ended_if_late``), whoever reads it: a poll, a watch, a keyed retry."""

    def __init__(self, settings: GatewaySettings, store: TaskStore, clock: Clock) -> None:
        self.settings = settings
        self._store = store
        self._clock = clock
        self._watchers = 0
        self._by_client: dict[str, int] = {}
        """Open watches per client (``gateway.edge.callers.client_of``), for its share of the cap."""

    @property
    def watchers(self) -> int:
        """Long-polls and event streams open."""
        return self._watchers

    async def result(
        self, task_id: str, wait_s: float = 0.0, *, owner: str | None = None, client: str = "-"
    ) -> TaskState:
        """The task's state; with ``wait_s`` > 0, waits up to that long for it to end (long-poll).

        A task another API key created is reported unknown (``owner`` is the caller's); a wait counts
        against ``client``'s share of the open watches."""
        check_task_id(task_id)
        if not wait_s >= 0:  # NaN too
            raise ValidationFailed(f"wait is {wait_s:g}; send seconds, 0 or more")
        # A longer wait is cut to the deployment's longest, as long-polls are: the answer is the state
        # then, and a client that asked more polls again, knowing no server's setting.
        wait_s = min(wait_s, self.settings.max_poll_wait_s)
        try:
            if wait_s == 0:
                return await self._get(task_id, owner)
            until = asyncio.get_running_loop().time() + wait_s
            # A store that does not answer (a subscribe or a read stuck until its socket's timeout)
            # holds the caller no longer than its wait and a last look.
            stuck = asyncio.timeout_at(until + LAST_LOOK_S)
            try:
                async with stuck:
                    return await self._wait(task_id, owner, client, until)
            except TimeoutError:
                if not stuck.expired():
                    raise  # a transport's own
                raise Unavailable(
                    f"the task store did not answer within the wait of {wait_s:g} s; poll again"
                ) from None
        except TRANSPORT_ERRORS as err:
            raise Unavailable(f"the task store is unavailable: {err}") from err

    async def _wait(self, task_id: str, owner: str | None, client: str, until: float) -> TaskState:
        """The long-poll: the task's state once it ends, or at ``until`` (a loop time)."""
        if (ended := await self._ended_if_no_room(task_id, owner, client)) is not None:
            return ended
        with self.watching(client):
            async with self._watch(task_id, owner) as changes:
                if isinstance(changes, TaskState):
                    return changes
                state = await self._get(task_id, owner)
                async with aclosing(self._follow(changes, state, until)) as later:
                    async for change in later:
                        state = change
                if state.status.terminal:
                    return state
        # The wait ran out: read once more, in case a change message was lost on the way.
        return await self.read(task_id) or state

    async def events(
        self, task_id: str, *, owner: str | None = None, client: str = "-"
    ) -> AsyncGenerator[TaskState, None]:
        """The task's current state, then each later state, until it ends (or ``sse_max_s`` passes).

        Never yields a status twice nor goes back: only states of a higher rank than the last are
        yielded. Use with ``contextlib.aclosing`` so the store subscription ends with the consumer.
        """
        check_task_id(task_id)
        deadline = asyncio.get_running_loop().time() + self.settings.sse_max_s
        try:
            if (ended := await self._ended_if_no_room(task_id, owner, client)) is not None:
                yield ended
                return
            with self.watching(client):
                async with self._watch(task_id, owner) as changes:
                    if isinstance(changes, TaskState):
                        yield changes
                        return
                    state = await self._get(task_id, owner)
                    yield state
                    async with aclosing(self._follow(changes, state, deadline)) as later:
                        async for state in later:
                            yield state
        except TRANSPORT_ERRORS as err:
            raise Unavailable(f"the task store is unavailable: {err}") from err

    async def cancel(self, task_id: str, *, owner: str | None = None) -> TaskState:
        """Cancels a task no worker has started yet; returns its cancelled state.

        Cancelling a cancelled task answers the same (DELETE is idempotent); a running or otherwise
        ended task raises ``NotCancellable``, naming its status, and so does a synchronous task recorded
        only when its caller was answered (``TaskPublisher.record_late``): it reads ``queued`` while a
        worker may be running it.
        """
        check_task_id(task_id)
        try:
            stored = await self._owned(task_id, owner)  # as stored: a late task is still the owner's to cancel
            if stored.status is TaskStatus.QUEUED and stored.deadline_ms is None:
                raise NotCancellable(
                    f"task {task_id} may be running: it was recorded as queued only when its synchronous caller "
                    "was answered (a 504, or a disconnect), and a worker's start of it is not recorded; poll its "
                    "result",
                    task_id=task_id,
                )
            state = await self._store.cancel(
                task_id, CANCELLED_BY_OWNER, "cancelled by DELETE /v1/result/{task_id} before a worker ran it"
            )
        except TRANSPORT_ERRORS as err:
            raise Unavailable(f"the task store is unavailable: {err}") from err
        if state is None:
            raise not_found(task_id)
        if state.status is not TaskStatus.CANCELLED:
            raise NotCancellable(
                f"task {task_id} is {state.status.value}; only queued or batched tasks can be cancelled",
                task_id=task_id,
            )
        return state

    @asynccontextmanager
    async def _watch(self, task_id: str, owner: str | None) -> AsyncIterator[AsyncIterator[TaskState] | TaskState]:
        """The task's changes; or, when the change feed cannot subscribe, its state if it has ended (an
        ended state never changes, and a plain poll answers it meanwhile). Otherwise the feed's error."""
        async with AsyncExitStack() as stack:
            feed: AsyncIterator[TaskState] | TaskState
            try:
                feed = await stack.enter_async_context(self._store.watch(task_id))
            except TRANSPORT_ERRORS:
                feed = await self._get(task_id, owner)
                if not feed.status.terminal:
                    raise
            yield feed

    async def _get(self, task_id: str, owner: str | None) -> TaskState:
        return await self._ended_if_late(await self._owned(task_id, owner))

    async def _owned(self, task_id: str, owner: str | None) -> TaskState:
        state = await self._store.get(task_id)
        if state is None or state.owner != owner:
            raise not_found(task_id)  # another key's task looks exactly like a missing one
        return state

    async def read(self, task_id: str) -> TaskState | None:
        """The stored state, ended if late (``_ended_if_late``); for a task whose owner was checked, or that
        the caller's Idempotency-Key names (``gateway.keys.replay``: a retry reads it as a poll would)."""
        state = await self._store.get(task_id)
        return None if state is None else await self._ended_if_late(state)

    def _follow(
        self, changes: AsyncIterator[TaskState], state: TaskState, until: float
    ) -> AsyncGenerator[TaskState, None]:
        """``follow`` with a read at the task's deadline, which ends it if it still waits."""
        return follow(self._reread, changes, state, until, self.settings.stream_recheck_s, self.late_in_s)

    async def _reread(self, task_id: str) -> TaskState | None:
        """A follow's re-read, a backstop for a lost change message: one that fails (a slow read, a
        store blip) reads as no change, and the wait goes on (its subscription re-reads the task when
        it reconnects, and the next re-read tries again)."""
        try:
            return await self.read(task_id)
        except TRANSPORT_ERRORS as err:
            log.debug(
                "re-reading task %s failed; the next re-read tries again: %s", task_id, err, extra=ids(task_id=task_id)
            )
            return None

    def late_in_s(self, state: TaskState) -> float | None:
        """Seconds until ``state`` is late: still waiting ``reply_recheck_s`` past its deadline, time for
        the batcher or worker that holds it to end it, as they do at the deadline, so that a crowd of
        watchers of tasks ending together costs the store nothing more. None when it has no deadline
        (a ``running`` or ended state, or one recorded after its deadline)."""
        if state.deadline_ms is None or state.status.rank > TaskStatus.BATCHED.rank:
            return None
        return (state.deadline_ms - self._clock.wall_ms()) / 1000 + self.settings.reply_recheck_s

    async def _ended_if_late(self, state: TaskState) -> TaskState:
        """``state``, or the task ended ``expired`` when it still waits (queued, batched) late
        (``late_in_s``). The batcher that would end it may be down (a worker drops such an item unrun), and
        its caller learns the end now, not when a batcher comes back. The store decides atomically:
        a worker's ``running`` that got there first stays, and once ended the task never runs. The end
        is a read's extra: a store that refuses it (full, failing) leaves the read its state."""
        late_in_s = self.late_in_s(state)
        if late_in_s is None or late_in_s > 0:
            return state
        try:
            ended = await self._store.cancel(state.task_id, DeadlineExceeded.code, PAST_DEADLINE, TaskStatus.EXPIRED)
        except TRANSPORT_ERRORS as err:  # each watcher of the task meets it at each re-read: one line, no traceback
            log.warning(
                "could not end late task %s (%s); read as stored", state.task_id, err, extra=ids(task_id=state.task_id)
            )
            return state
        return state if ended is None else ended

    async def _ended_if_no_room(self, task_id: str, owner: str | None, client: str) -> TaskState | None:
        """None while ``client`` may open a watch. At a limit, the task's state if it has ended (an
        ended task needs no watch: a plain poll would answer it), else the limit's refusal."""
        try:
            self._check_room(client)
        except Overloaded:
            state = await self._get(task_id, owner)
            if state.status.terminal:
                return state
            raise
        return None

    @contextmanager
    def watching(self, client: str) -> Iterator[None]:
        """Counts one open watch (a long-poll, an event stream) of ``client`` while inside; raises
        ``Overloaded`` past ``max_watchers``, or past ``client``'s share of them."""
        held = self._check_room(client)
        self._watchers += 1
        self._by_client[client] = held + 1
        WATCHERS.inc()
        try:
            yield
        finally:
            self._watchers -= 1
            left = self._by_client[client] - 1
            if left:
                self._by_client[client] = left
            else:
                del self._by_client[client]
            WATCHERS.dec()

    def _check_room(self, client: str) -> int:
        """Raises ``Overloaded`` past ``max_watchers`` or past ``client``'s share; the watches it holds."""
        if self._watchers >= self.settings.max_watchers:
            raise Overloaded(
                f"this gateway has {self._watchers} long-polls and event streams open, its limit "
                f"({env_name('max_watchers')}); retry after the Retry-After delay"
            )
        held = self._by_client.get(client, 0)
        if held >= self.settings.max_watchers_per_client:
            raise Overloaded(
                f"this client holds {held} long-polls and event streams open on this gateway, its share "
                f"({env_name('max_watchers_per_client')}); close one, or retry after the Retry-After delay"
            )
        return held


def not_found(task_id: str) -> TaskNotFound:
    """The one answer for an id that is unknown, expired, or another key's."""
    return TaskNotFound(
        f"no task {task_id!r}: it never existed here, it expired from the store, or another API key created it"
    )


def check_task_id(task_id: str) -> None:
    if not TASK_ID_PATTERN.fullmatch(task_id):
        raise InvalidTaskId("a task id is 1 to 128 characters from A-Z a-z 0-9 _ -; use the task_id a submit returned")
