"""Typed records that travel between the roles; each maps 1:1 onto an Avro schema in ``avro/``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class TaskStatus(StrEnum):
    """Lifecycle of one task. Order matters: a status never moves back to a lower rank."""

    QUEUED = "queued"
    BATCHED = "batched"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def rank(self) -> int:
        return _RANK[self]


_TERMINAL = frozenset({TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.EXPIRED, TaskStatus.CANCELLED})
_RANK = {
    TaskStatus.QUEUED: 0,
    TaskStatus.BATCHED: 1,
    TaskStatus.RUNNING: 2,
    TaskStatus.COMPLETED: 3,
    TaskStatus.FAILED: 3,
    TaskStatus.EXPIRED: 3,
    TaskStatus.CANCELLED: 3,
}


class Priority(StrEnum):
    """A request's tier: batches take higher tiers first, and admission sheds lower tiers first."""

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"

    @property
    def rank(self) -> int:
        """0 for the highest tier: lower ranks go first."""
        return _PRIORITY_RANK[self]

    @classmethod
    def of(cls, name: str | None) -> Priority:
        """The tier named ``name``; a name this version does not know (a newer writer's) reads as normal."""
        try:
            return cls(name) if name is not None else cls.NORMAL
        except ValueError:
            return cls.NORMAL


_PRIORITY_RANK = {Priority.HIGH: 0, Priority.NORMAL: 1, Priority.LOW: 2}


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    task_id: str
    model: str
    input: str
    enqueued_at_ms: int
    deadline_ms: int
    reply_to: str | None = None
    owner: str | None = None
    priority: Priority = Priority.NORMAL
    traceparent: str | None = None
    """W3C trace context of the request's ``gateway.accept`` span; None while tracing is off."""


@dataclass(frozen=True, slots=True)
class BatchItem:
    task_id: str
    input: str
    enqueued_at_ms: int
    deadline_ms: int
    reply_to: str | None = None
    priority: Priority = Priority.NORMAL
    traceparent: str | None = None

    @classmethod
    def of(cls, request: InferenceRequest) -> BatchItem:
        return cls(
            request.task_id,
            request.input,
            request.enqueued_at_ms,
            request.deadline_ms,
            request.reply_to,
            request.priority,
            request.traceparent,
        )


@dataclass(frozen=True, slots=True)
class Batch:
    batch_id: str
    model: str
    batcher_id: str
    created_at_ms: int
    flush_reason: str
    credit: str | None = None
    items: tuple[BatchItem, ...] = field(default_factory=tuple)
    traceparent: str | None = None
    """W3C trace context of the batch's ``batch.formed`` span; None while tracing is off."""


@dataclass(frozen=True, slots=True)
class Credit:
    """A worker's promise to run the next batch that lands on ``partition``."""

    worker_id: str
    model: str
    partition: int
    seq: int
    issued_at_ms: int
    expires_at_ms: int
    max_batch: int = 0
    """Largest batch the worker's backend takes; 0 when it sets no limit of its own."""
    busy_ms: int = 0
    """The worker's recent backend call duration (moving average); 0 before its first call."""
    free_at_ms: int = 0
    """When the worker expects to be idle: now when it is, its running call's expected end when it
    offers early (``--credit-lead-ms``). Claims take the credit that frees soonest."""

    @property
    def idle_from_ms(self) -> int:
        """``free_at_ms``, or ``issued_at_ms`` for a credit from a writer that did not set it."""
        return self.free_at_ms or self.issued_at_ms

    @property
    def rate_per_s(self) -> float | None:
        """Requests/s the worker takes in full batches at its recent call time; None while either
        is unknown. An upper bound: calls of full batches may take longer than its recent ones."""
        if self.max_batch <= 0 or self.busy_ms <= 0:
            return None
        return self.max_batch * 1000 / self.busy_ms

    @property
    def ref(self) -> str:
        """Names this credit inside the batch sent against it."""
        return f"{self.worker_id}:{self.seq}"


INPUT_TOO_LONG = "input_too_long"
INPUT_EMPTY = "input_empty"
INPUT_REFUSED = frozenset({INPUT_TOO_LONG, INPUT_EMPTY})
"""The error codes of a task whose input the model cannot take (a backend's ``input_errors``): the
request's fault, not the model's, which the OpenAI routes answer 400 as OpenAI does."""


def shorter_than_call(call_ms: float) -> str:
    """How an ``expired`` task's message says its timeout was shorter than one call of its model (``call_ms``),
    so no answer could be in time: the worker writes it, and ``call_ms_named`` reads the call's length back for
    the routes that take no ``timeout_ms`` (the OpenAI ones), to say what to change their way."""
    return f"shorter than one call of the model (about {call_ms:.0f} ms)"


_SHORTER_THAN_CALL = re.compile(r"shorter than one call of the model \(about (\d+) ms\)")


def call_ms_named(message: str | None) -> int | None:
    """The call's length an ``expired`` task's message names (``shorter_than_call``), else None."""
    found = _SHORTER_THAN_CALL.search(message or "")
    return None if found is None else int(found.group(1))


@dataclass(frozen=True, slots=True)
class TaskState:
    task_id: str
    status: TaskStatus
    model: str
    updated_at_ms: int
    enqueued_at_ms: int
    output: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    batch_id: str | None = None
    batch_size: int | None = None
    worker_id: str | None = None
    reply_to: str | None = None
    owner: str | None = None
    """Hash of the API key that created the task (None without API keys); never shown to clients."""
    deadline_ms: int | None = None
    """The request's deadline (wall-clock ms) on a ``queued`` or ``batched`` state: past it, a gateway
    that reads the task ends it ``expired`` (``TaskReads``), since no other role may be up to. None on
    a record written once the deadline had passed; ignored on the states after those (an end built
    from a waiting state carries it over)."""

    def to_public(self) -> dict[str, Any]:
        """The JSON shape clients see for ``GET /v1/result/{task_id}`` and SSE events."""
        doc: dict[str, Any] = {"task_id": self.task_id, "status": self.status.value, "model": self.model}
        if self.output is not None:
            doc["output"] = self.output
        if self.error_code is not None:
            doc["error"] = {"code": self.error_code, "message": self.error_message or ""}
        if self.batch_size is not None:
            doc["batch_size"] = self.batch_size
        return doc
