"""The task states a worker writes for a batch's items, and the time its inputs spent waiting for and
in their call."""

from __future__ import annotations

import time

from gpu_worker.calls import Failure
from schemas.records import Batch, BatchItem, TaskState, TaskStatus
from telemetry import metrics


def count_stages(batch: Batch, inputs: int, started_ms: float, call_s: float) -> None:
    """Counts the input-seconds of ``batch``'s run in ``batchwire_request_stage_seconds``: from its
    sealing to its call's start (``started_ms``, wall clock), and in the call."""
    waited_s = max(0.0, started_ms - batch.created_at_ms) / 1000.0
    metrics.REQUEST_STAGE.labels(model=batch.model, stage="sealed_to_started").inc(inputs * waited_s)
    metrics.REQUEST_STAGE.labels(model=batch.model, stage="call").inc(inputs * call_s)
    metrics.REQUEST_STAGE_INPUTS.labels(model=batch.model).inc(inputs)


def wall_ms() -> int:
    return int(time.time() * 1000)


def task_state(
    worker_id: str,
    batch: Batch,
    item: BatchItem,
    status: TaskStatus,
    output: str | None = None,
    error: Failure | None = None,
    ran_with: int | None = None,
) -> TaskState:
    """``item``'s state as this worker writes it, stamped now. ``ran_with``: how many items its
    call ran (its ``batch_size``; by default the sealed batch's, before any was dropped)."""
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
        batch_size=len(batch.items) if ran_with is None else ran_with,
        worker_id=worker_id,
        reply_to=item.reply_to,
    )
