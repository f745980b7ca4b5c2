"""The task states the batcher writes: a batch's items batched, held requests expired, requests for
models nobody serves failed. Pure builders; the writes happen where the states are made."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from schemas.records import Batch, InferenceRequest, TaskState, TaskStatus


def wall_ms() -> int:
    """Wall time in milliseconds: the time base of the records' timestamps and deadlines."""
    return int(time.time() * 1000)


def batched(model: str, batch: Batch, now_ms: int) -> list[TaskState]:
    """The ``batched`` states of the items someone may read them for: not a synchronous request's
    (``reply_to``), whose caller waits for the answer alone and learns its id with it (a 504 or a
    disconnect records the task then, ``TaskPublisher.record_late``)."""
    return [
        TaskState(
            item.task_id,
            TaskStatus.BATCHED,
            model,
            now_ms,
            item.enqueued_at_ms,
            batch_id=batch.batch_id,
            batch_size=len(batch.items),
            deadline_ms=item.deadline_ms,
        )
        for item in batch.items
        if item.reply_to is None
    ]


def expired(requests: Iterable[InferenceRequest], now_ms: int) -> list[TaskState]:
    return [
        TaskState(
            request.task_id,
            TaskStatus.EXPIRED,
            request.model,
            now_ms,
            request.enqueued_at_ms,
            error_code="deadline_exceeded",
            error_message="the request's deadline passed before a GPU worker could take it; "
            "retry, or send a longer timeout_ms",
            reply_to=request.reply_to,
        )
        for request in requests
    ]


def unknown_model(requests: Iterable[InferenceRequest], served: Sequence[str], now_ms: int) -> list[TaskState]:
    return [
        TaskState(
            request.task_id,
            TaskStatus.FAILED,
            request.model,
            now_ms,
            request.enqueued_at_ms,
            error_code="unknown_model",
            error_message=f"model {request.model!r} is not served here (served: {', '.join(served)})",
            reply_to=request.reply_to,
        )
        for request in requests
    ]
