"""The worker's spans of a batch, recorded after the fact from the times the worker kept."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from schemas.records import Batch, BatchItem
from telemetry import spans, tracing
from tests.support.trace_checks import from_sdk

MS = 1_000_000


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.configure(None, "batchwire-test", exporter=exporter)
    yield exporter
    tracing.shutdown()


def test_a_batchs_backend_span_keeps_its_call_times_however_long_recording_takes(
    exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call's times are on the monotonic clock and move to the wall clock by one reading of each:
    a slow start of the worker span in between (a busy process) must not shift the call later."""
    wall_ns = time.time_ns()
    now_s = time.monotonic()
    monkeypatch.setattr(time, "time_ns", lambda: wall_ns)  # the wall clock as the call ended
    opened = tracing.open_span

    def slow_open(*args: Any, **kwargs: Any) -> Any:
        nonlocal wall_ns
        wall_ns += 5 * MS  # the worker span took 5 ms to start
        return opened(*args, **kwargs)

    monkeypatch.setattr(tracing, "open_span", slow_open)
    created_ms = wall_ns // MS - 300
    item = BatchItem("t0", "a", created_ms, created_ms + 30_000, "gw")
    batch = Batch("b1", "sim", "batcher", created_ms, "idle_worker", None, (item,), f"00-{'1' * 32}-{'2' * 16}-01")
    handed_ns = time.time_ns()  # the results were handed in as the call ended
    spans.batch_ran(batch, (now_s - 0.1, now_s), now_s, handed_ns, handed_ns + MS)
    recorded = {span.name: span for span in from_sdk(exporter.get_finished_spans())}
    call = recorded["backend"]
    assert (call.start_ns, call.end_ns) == (handed_ns - 100 * MS, handed_ns), (
        f"the call is recorded {(call.end_ns - handed_ns) / MS:.3f} ms later than it ended"
    )
    assert call.end_ns <= recorded["worker.run"].end_ns, "the call ends within the worker's run"
