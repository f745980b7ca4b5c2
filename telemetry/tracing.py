"""Distributed tracing: W3C trace context between the roles, OpenTelemetry spans exported over OTLP/HTTP.

Off unless ``configure`` gets an endpoint. While off, the only cost on the hot path is reading
``ACTIVE``: the OpenTelemetry SDK is never imported and no span, id or context is made, so the
records carry no ``traceparent``. While on, spans are recorded with explicit start and end times
(most are recorded after the fact, from the timestamps the records carry) and exported in batches
by the SDK's own thread.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

# The API only (declared by the core install): no provider, no SDK.
from opentelemetry import trace
from opentelemetry.trace import Span, SpanContext, Status, StatusCode, TraceFlags, Tracer

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

ACTIVE = False
"""True once ``configure`` set up an exporter; every hook checks this flag first."""

TRACES_PATH = "/v1/traces"
EXPORT_DELAY_MS = 500
"""How long the exporter gathers finished spans before it sends them."""

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")

_provider: TracerProvider | None = None
_tracer: Tracer | None = None

Attributes = Mapping[str, str | int]


class TracingError(ValueError):
    """The tracing configuration cannot work (the message names the flag)."""


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL for ``endpoint``: a base URL gets ``/v1/traces``, a full one stays."""
    if not endpoint.startswith(("http://", "https://")):
        raise TracingError(
            f"--otlp-endpoint {endpoint!r} is not an http(s) URL; pass the collector's OTLP/HTTP base URL, "
            "e.g. http://localhost:4318 (BATCHWIRE_OTLP_ENDPOINT)"
        )
    base = endpoint.rstrip("/")
    return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


def configure(
    endpoint: str | None, service: str, *, sample_ratio: float = 1.0, exporter: SpanExporter | None = None
) -> None:
    """Starts exporting this process's spans to ``endpoint`` as ``service``; does nothing without one.

    ``sample_ratio`` of the requests that come without a caller's trace start a recorded trace (by
    trace id, so every role decides alike); a caller's ``traceparent`` decides for its own request.
    ``exporter`` (tests) takes each span as it ends, instead of an OTLP endpoint.
    """
    global ACTIVE, _provider, _tracer
    if not 0.0 <= sample_ratio <= 1.0:  # without an endpoint too: not first refused once one is added
        raise TracingError(
            f"--trace-sample-ratio is {sample_ratio}; give a share from 0 to 1 (BATCHWIRE_TRACE_SAMPLE_RATIO)"
        )
    if not (endpoint or exporter) or ACTIVE:
        return
    url = traces_url(endpoint) if endpoint else ""
    # The [tracing] extra: imported only when tracing is configured, so the core install needs none of it.
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ModuleNotFoundError as err:
        raise TracingError(
            f"--otlp-endpoint needs the tracing extra: pip install 'batchwire[tracing]' (missing module: {err.name})"
        ) from err

    provider = TracerProvider(
        resource=Resource.create({"service.name": service}), sampler=ParentBased(TraceIdRatioBased(sample_ratio))
    )
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=url), schedule_delay_millis=EXPORT_DELAY_MS)
        provider.add_span_processor(processor)
    _provider = provider
    _tracer = provider.get_tracer("batchwire")
    ACTIVE = True


def shutdown() -> None:
    """Exports the spans still held and stops tracing (a no-op when it was off)."""
    global ACTIVE, _provider, _tracer
    provider, _provider, _tracer, ACTIVE = _provider, None, None, False
    if provider is not None:
        provider.shutdown()


def provider() -> TracerProvider | None:
    """The SDK provider, None while tracing is off."""
    return _provider


def parse(traceparent: str | None) -> tuple[int, int, int] | None:
    """Trace id, span id and flags of a W3C ``traceparent``; None when absent or malformed (a new
    trace starts instead, as the W3C spec asks of a receiver)."""
    if not traceparent:
        return None
    match = _TRACEPARENT.match(traceparent.strip().lower())
    if match is None:
        return None
    trace_id, span_id, flags = (int(group, 16) for group in match.groups())
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id, flags


def sampled(traceparent: str | None) -> bool:
    """Whether the trace ``traceparent`` names is recorded (its sampled flag)."""
    parsed = parse(traceparent)
    return parsed is not None and bool(parsed[2] & 1)


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id (32 hex digits) a ``traceparent`` names, for log lines."""
    parsed = parse(traceparent)
    return None if parsed is None else f"{parsed[0]:032x}"


def traceparent_of(span: Span) -> str:
    """The W3C ``traceparent`` naming ``span`` as the parent of what follows."""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def open_span(
    name: str,
    parent: str | None,
    start_ns: int | None = None,
    *,
    links: Iterable[str] = (),
    attributes: Attributes | None = None,
    server: bool = False,
) -> Span:
    """Starts a span under the remote ``parent`` (a new trace without one), linked to ``links``.

    The caller ends it (``span.end(end_time=...)``); its ``traceparent_of`` travels meanwhile.
    """
    tracer = _tracer
    if tracer is None:
        raise RuntimeError("tracing is not configured; check tracing.ACTIVE before recording spans")
    context = None
    remote = _remote(parent)
    if remote is not None:
        context = trace.set_span_in_context(trace.NonRecordingSpan(remote))
    span_links = [trace.Link(ctx) for ctx in map(_remote, links) if ctx is not None]
    return tracer.start_span(
        name,
        context=context,
        kind=trace.SpanKind.SERVER if server else trace.SpanKind.INTERNAL,
        attributes=attributes,
        links=span_links,
        start_time=time.time_ns() if start_ns is None else start_ns,
    )


def record(name: str, parent: str | None, start_ns: int, end_ns: int, *, attributes: Attributes | None = None) -> str:
    """Records a span after the fact, from ``start_ns`` to ``end_ns`` (wall clock); returns its context."""
    span = open_span(name, parent, start_ns, attributes=attributes)
    span.end(end_time=max(start_ns, end_ns))
    return traceparent_of(span)


def failed(span: Span, err: BaseException | str) -> None:
    """Marks ``span`` as ended in an error."""
    span.set_status(Status(StatusCode.ERROR, str(err)))


def _remote(traceparent: str | None) -> SpanContext | None:
    parsed = parse(traceparent)
    if parsed is None:
        return None
    trace_id, span_id, flags = parsed
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))
