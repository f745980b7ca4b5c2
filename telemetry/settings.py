"""Settings of what every role reports about itself: its log format and where its traces go."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ObservabilitySettings:
    log_format: str = "text"
    """``text`` for a terminal, ``json`` for one object per line (``telemetry.logs``)."""
    otlp_endpoint: str | None = None
    """OTLP/HTTP collector base URL (``telemetry.tracing``); None: no tracing, at no cost."""
    trace_sample_ratio: float = 1.0
    """Share of new traces recorded; a caller's ``traceparent`` decides for its own request."""
