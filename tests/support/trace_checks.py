"""Spans as plain records, from the SDK (in process) or from OTLP protobuf (a receiver), and the
checks the tracing tests make of one request's chain of spans."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

CHAIN = ("gateway.accept", "bus.wait", "batcher.queue", "batch.formed", "worker.run", "result.store", "reply")
"""The spans that one after another cover a synchronous request (``telemetry.spans``)."""

MS = 1_000_000


@dataclass(frozen=True)
class SpanRecord:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_id: str | None
    start_ns: int
    end_ns: int
    links: tuple[tuple[str, str], ...]
    attributes: dict[str, Any]


def from_sdk(spans: Iterable[Any]) -> list[SpanRecord]:
    """``ReadableSpan``s (an in-memory exporter's) as records."""
    records = []
    for span in spans:
        context = span.context
        records.append(
            SpanRecord(
                span.name,
                str(span.resource.attributes.get("service.name", "")),
                f"{context.trace_id:032x}",
                f"{context.span_id:016x}",
                None if span.parent is None else f"{span.parent.span_id:016x}",
                span.start_time,
                span.end_time,
                tuple((f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") for link in span.links),
                dict(span.attributes or {}),
            )
        )
    return records


def from_otlp(request: Any) -> list[SpanRecord]:
    """An ``ExportTraceServiceRequest``'s spans as records."""
    records = []
    for resource_spans in request.resource_spans:
        service = next(
            (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"), ""
        )
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                attributes = {a.key: a.value.string_value or a.value.int_value for a in span.attributes}
                records.append(
                    SpanRecord(
                        span.name,
                        service,
                        span.trace_id.hex(),
                        span.span_id.hex(),
                        span.parent_span_id.hex() or None,
                        span.start_time_unix_nano,
                        span.end_time_unix_nano,
                        tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                        attributes,
                    )
                )
    return records


def request_chain(spans: Sequence[SpanRecord], trace_id: str) -> dict[str, SpanRecord]:
    """The chain of spans of the request traced as ``trace_id``, by name: its own spans in its trace,
    then the batch span that links to its request span and that batch's worker spans (in the trace
    of the batch's first request)."""
    own = {
        span.name: span
        for span in spans
        if span.trace_id == trace_id and span.name in ("gateway.accept", "bus.wait", "batcher.queue", "reply")
    }
    assert "gateway.accept" in own, f"trace {trace_id} has no gateway.accept span; it has {sorted(own)}"
    accept = own["gateway.accept"]
    batches = [s for s in spans if s.name == "batch.formed" and (accept.trace_id, accept.span_id) in s.links]
    assert len(batches) == 1, f"{len(batches)} batch.formed spans link to request span {accept.span_id}"
    chain = {**own, "batch.formed": batches[0]}
    for name, parent in (("worker.run", "batch.formed"), ("result.store", "worker.run")):
        children = [s for s in spans if s.name == name and s.parent_id == chain[parent].span_id]
        assert len(children) == 1, f"{len(children)} {name} spans under {parent} {chain[parent].span_id}"
        chain[name] = children[0]
    missing = [name for name in CHAIN if name not in chain]
    assert not missing, f"trace {trace_id} lacks {missing}; it has {sorted(chain)}"
    for name in ("bus.wait", "batcher.queue", "reply"):
        assert chain[name].parent_id == accept.span_id, f"{name} is not under the request span"
    return chain


def check_batch_links(spans: Sequence[SpanRecord]) -> int:
    """Each batch span links to the request span of every item of its batch (their ``batcher.queue``
    spans name the batch), and to nothing else; returns how many batches were checked."""
    accepts = {s.attributes.get("task.id"): s for s in spans if s.name == "gateway.accept"}
    checked = 0
    for batch in (s for s in spans if s.name == "batch.formed"):
        batch_id = batch.attributes["batch.id"]
        tasks = [
            s.attributes["task.id"]
            for s in spans
            if s.name == "batcher.queue" and s.attributes.get("batch.id") == batch_id
        ]
        assert len(tasks) == batch.attributes["batch.size"], f"batch {batch_id}: {len(tasks)} items traced"
        expected = {(accepts[t].trace_id, accepts[t].span_id) for t in tasks}
        assert set(batch.links) == expected, f"batch {batch_id} links {batch.links}, expected {expected}"
        checked += 1
    return checked


def uncovered_ns(chain: Iterable[SpanRecord], start_ns: int, end_ns: int) -> int:
    """How much of ``[start_ns, end_ns]`` (the caller's wait) no span of ``chain`` covers."""
    covered = 0
    reach = start_ns
    for span in sorted(chain, key=lambda s: s.start_ns):
        lo, hi = max(span.start_ns, reach), min(span.end_ns, end_ns)
        if hi > lo:
            covered += hi - lo
            reach = hi
    return (end_ns - start_ns) - covered


def check_covers(chain: dict[str, SpanRecord], client_start_ns: int, client_end_ns: int, slack_ms: float) -> None:
    """The chain starts within the caller's wait and its ``reply`` ends within it (1 ms of clock slack;
    ``result.store`` may end later: the store's acknowledgement reaches the worker after the reply
    reached the gateway), and together its spans cover all of the wait but ``slack_ms``."""
    timeline = ", ".join(
        f"{s.name} {(s.start_ns - client_start_ns) / MS:.2f}..{(s.end_ns - client_start_ns) / MS:.2f}"
        for s in sorted(chain.values(), key=lambda s: s.start_ns)
    )
    latency_ms = (client_end_ns - client_start_ns) / MS
    first = min(span.start_ns for span in chain.values())
    assert first >= client_start_ns - MS, f"the chain starts before the call ({latency_ms:.2f} ms): {timeline}"
    assert chain["reply"].end_ns <= client_end_ns + MS, f"reply ends after the answer ({latency_ms:.2f} ms): {timeline}"
    gap_ms = uncovered_ns(chain.values(), client_start_ns, client_end_ns) / MS
    assert gap_ms <= slack_ms, (
        f"the spans leave {gap_ms:.2f} ms of the {latency_ms:.2f} ms call uncovered (at most {slack_ms}): {timeline}"
    )
