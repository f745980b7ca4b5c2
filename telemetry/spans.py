"""The spans each role records for a request, as one chain from the gateway to the answer.

A request's span is the gateway's ``gateway.accept``: its context is the ``traceparent`` the
request carries. Each later step is a span under it, or under the batch that carries it:

* ``gateway.accept`` (gateway): from the HTTP request's arrival until its record is built;
* ``bus.wait`` (batcher): from the record's ``enqueued_at_ms`` until the batcher takes it;
* ``batcher.queue`` (batcher): from then until its batch is sealed;
* ``batch.formed`` (batcher): one per batch, from the seal until the batch bus took it, under the
  first item's request span and linked to every item's (a batch has many parents);
* ``worker.run`` (worker, under ``batch.formed``): from the batch's ``created_at_ms`` until its
  results are ready, with ``backend`` (the model's call) as a child;
* ``result.store`` (worker, under ``worker.run``): from then until the results are stored;
* ``reply`` (gateway): from the result's ``updated_at_ms`` until the answer goes out.

A step that starts on another process starts at the record's own millisecond timestamp, at or
before the moment the step before it ended, so the chain has no gaps: together the spans cover the
time the caller waited, less the HTTP parsing and writing around the route. Every function here
is called only while ``tracing.ACTIVE``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextvars import ContextVar, Token
from dataclasses import replace
from typing import TYPE_CHECKING

from schemas.records import Batch
from telemetry import tracing

if TYPE_CHECKING:
    from opentelemetry.trace import Span

_MS = 1_000_000


class RequestSpans:
    """One HTTP submit's spans in the gateway, current (a context variable) while its route runs."""

    __slots__ = (
        "_accepted",
        "_failure",
        "_sent_ns",
        "_stored_ms",
        "_token",
        "accept",
        "task_id",
        "trace_id",
        "traceparent",
    )

    def __init__(self, incoming: str | None) -> None:
        self.accept: Span = tracing.open_span("gateway.accept", incoming, server=True)
        self.traceparent = tracing.traceparent_of(self.accept)
        self.trace_id = self.traceparent[3:35]
        self.task_id: str | None = None
        self._accepted = False
        self._sent_ns = 0
        self._stored_ms: int | None = None
        self._failure: BaseException | str | None = None
        self._token: Token[RequestSpans | None] = _current.set(self)

    def sent(self, task_id: str) -> str:
        """Ends ``gateway.accept`` as the request's record is built; returns its ``traceparent``."""
        if not self._accepted:
            self._accepted = True
            self.task_id = task_id
            self.accept.set_attribute("task.id", task_id)
            self._sent_ns = time.time_ns()
            self.accept.end(end_time=self._sent_ns)
        return self.traceparent

    def answered(self, stored_ms: int) -> None:
        """The result the answer carries was stored around ``stored_ms`` (its ``updated_at_ms``)."""
        self._stored_ms = stored_ms

    def failed(self, err: BaseException | str) -> None:
        """An answer streamed after the route returned failed, or the stream was cut before its end."""
        self._failure = err

    def end(self, status: int | None, err: BaseException | str | None = None) -> None:
        """The route is done (a streamed answer: its stream): ends what is still open and records ``reply``:
        from the stored end (a failed or expired task's too), or, where none came (the gateway's own
        deadline, a caller gone), from the send; an error marks it failed. A 202 records none: its answer
        is read elsewhere."""
        _current.reset(self._token)
        err = err if err is not None else self._failure
        if not self._accepted:  # refused, or answered without a new task (an idempotent replay)
            self._accepted = True
            if err is not None:
                tracing.failed(self.accept, err)
            if status is not None:
                self.accept.set_attribute("http.response.status_code", status)
            self.accept.end()
            return
        if (self._stored_ms is None and err is None) or not self.accept.get_span_context().trace_flags.sampled:
            return
        attributes: tracing.Attributes = {"task.id": self.task_id or "", "http.response.status_code": status or 0}
        start_ns = self._sent_ns if self._stored_ms is None else self._stored_ms * _MS
        reply = tracing.open_span("reply", self.traceparent, start_ns, attributes=attributes)
        if err is not None:
            tracing.failed(reply, err)
        reply.end(end_time=max(start_ns, time.time_ns()))


_current: ContextVar[RequestSpans | None] = ContextVar("batchwire_request_spans", default=None)


def request_sent(task_id: str) -> str | None:
    """The ``traceparent`` for a request being published from the current route (None outside one)."""
    spans = _current.get()
    return None if spans is None else spans.sent(task_id)


def request_answered(stored_ms: int) -> None:
    """Notes when the current route's answer was stored, the start of its ``reply`` span."""
    spans = _current.get()
    if spans is not None:
        spans.answered(stored_ms)


def request_failed(err: BaseException | str) -> None:
    """Notes that the answer the current route streams failed or was cut short: its ``reply`` ends failed."""
    spans = _current.get()
    if spans is not None:
        spans.failed(err)


def current_ids() -> tuple[str | None, str | None]:
    """Trace id and task id of the request the current code serves, for log lines."""
    spans = _current.get()
    return (None, None) if spans is None else (spans.trace_id, spans.task_id)


class BatchSpans:
    """A batch's spans in the batcher: ``batch.formed`` opens at the seal, so that its context
    travels in the batch, and the items' ``bus.wait`` and ``batcher.queue`` are recorded once the
    batch bus took the batch."""

    def __init__(self, batch: Batch, read_s: Sequence[float], now_s: float) -> None:
        """``read_s``: when the batcher read each item, on the monotonic clock that gave ``now_s``."""
        self.sealed_ns = time.time_ns()
        self._taken_ns = [self.sealed_ns - round((now_s - read) * 1e9) for read in read_s]
        parents = [item.traceparent for item in batch.items if item.traceparent]
        recorded = [parent for parent in parents if tracing.sampled(parent)]
        self.span: Span | None = None
        if parents and not recorded:  # none of its requests is recorded: the batch is not either
            self.batch = replace(batch, traceparent=parents[0])
            return
        first = recorded[0] if recorded else None
        self.span = tracing.open_span(
            "batch.formed",
            first,  # a recorded request's trace holds the batch span, if the batch has one
            self.sealed_ns,
            links=recorded,
            attributes={
                "batch.id": batch.batch_id,
                "batch.size": len(batch.items),
                "batch.flush_reason": batch.flush_reason,
                "model": batch.model,
            },
        )
        self.batch = replace(batch, traceparent=tracing.traceparent_of(self.span))

    def sent(self) -> None:
        """The batch bus took the batch: ends ``batch.formed`` and records each item's wait."""
        if self.span is None:
            return
        for item, taken_ns in zip(self.batch.items, self._taken_ns, strict=True):
            if not tracing.sampled(item.traceparent):
                continue
            attributes: tracing.Attributes = {"task.id": item.task_id, "batch.id": self.batch.batch_id}
            tracing.record("bus.wait", item.traceparent, item.enqueued_at_ms * _MS, taken_ns, attributes=attributes)
            tracing.record("batcher.queue", item.traceparent, taken_ns, self.sealed_ns, attributes=attributes)
        self.span.end()

    def failed(self, err: BaseException) -> None:
        """The batch bus refused the batch (its items go back to be batched again)."""
        if self.span is not None:
            tracing.failed(self.span, err)
            self.span.end()


def batch_ran(batch: Batch, call_s: tuple[float, float] | None, now_s: float, handed_ns: int, stored_ns: int) -> None:
    """Records a batch's spans in the worker once its results are stored: ``worker.run`` from the
    batch's seal until its results were handed to the commits (``handed_ns``), its ``backend`` call
    (``call_s``: start and end on the monotonic clock that gave ``now_s``), and ``result.store``."""
    wall_ns = time.time_ns()  # next to ``now_s``: what runs between the two would shift the call later
    if batch.traceparent is not None and not tracing.sampled(batch.traceparent):
        return
    attributes: tracing.Attributes = {"batch.id": batch.batch_id, "batch.size": len(batch.items), "model": batch.model}
    run = tracing.open_span("worker.run", batch.traceparent, batch.created_at_ms * _MS, attributes=attributes)
    run_context = tracing.traceparent_of(run)
    if call_s is not None:
        started_ns, ended_ns = (wall_ns - round((now_s - t) * 1e9) for t in call_s)
        tracing.record("backend", run_context, started_ns, ended_ns, attributes=attributes)
    run.end(end_time=handed_ns)
    tracing.record("result.store", run_context, handed_ns, stored_ns, attributes=attributes)
