"""What a submit returns: a synchronous caller's ``Answer``, an asynchronous one's ``Accepted``."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import DeadlineExceeded, TaskCancelled, TaskFailed, TimeoutBelowCall
from schemas.records import TaskState, TaskStatus, call_ms_named


@dataclass(frozen=True, slots=True)
class Answer:
    """A synchronous request's output."""

    task_id: str
    model: str
    output: str
    latency_ms: float
    batch_size: int | None
    replayed: bool = False
    """The answer of a task an earlier request with the same Idempotency-Key created."""


@dataclass(frozen=True, slots=True)
class Accepted:
    """An asynchronous request, stored and on the bus."""

    task_id: str
    model: str
    replayed: bool = False
    """An earlier request with the same Idempotency-Key created this task."""
    status: TaskStatus = TaskStatus.QUEUED


def answer_of(state: TaskState, latency_s: float, timeout_ms: int, replayed: bool = False) -> Answer:
    """A completed task's ``Answer``; any other end raises the error its caller gets (``replayed`` on both).
    An expired task whose worker found a call longer than what was left of the timeout is ``TimeoutBelowCall``
    only when the whole ``timeout_ms`` the request ran under is no longer than that call either: what was
    left had lost admission's waits, so a longer timeout may be met next time."""
    if state.status is TaskStatus.COMPLETED:
        return Answer(
            state.task_id, state.model, state.output or "", round(latency_s * 1000, 3), state.batch_size, replayed
        )
    if state.status is TaskStatus.CANCELLED:
        raise TaskCancelled(state.error_message or "the task was cancelled", task_id=state.task_id, replayed=replayed)
    if state.status is TaskStatus.EXPIRED or state.error_code == DeadlineExceeded.code:
        message = state.error_message or "the task expired before a worker ran it"
        if (call_ms := call_ms_named(message)) is not None and timeout_ms <= call_ms:
            raise TimeoutBelowCall(
                message, model=state.model, call_ms=call_ms, task_id=state.task_id, replayed=replayed
            )
        raise DeadlineExceeded(message, task_id=state.task_id, replayed=replayed)
    raise TaskFailed(
        state.error_message or f"the task ended {state.status.value}",
        task_id=state.task_id,
        task_code=state.error_code,
        replayed=replayed,
    )
