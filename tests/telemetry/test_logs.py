"""Structured logs: one JSON object per line, with the ids the line is about."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from telemetry import logs, tracing
from telemetry.logs import JsonFormatter, ids
from telemetry.spans import RequestSpans

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _line(message: str, *args: object, **extra: object) -> dict[str, object]:
    record = logging.LogRecord("batchwire.test", logging.WARNING, __file__, 1, message, args, None)
    record.__dict__.update(extra)
    line = JsonFormatter().format(record)
    assert "\n" not in line, "one record, one line"
    parsed = json.loads(line)
    assert isinstance(parsed, dict)
    return parsed


def test_a_line_has_time_level_logger_and_message() -> None:
    line = _line("batch %s sent", "b1")
    assert line["level"] == "warning" and line["logger"] == "batchwire.test" and line["message"] == "batch b1 sent"
    assert isinstance(line["time"], str) and line["time"].endswith("+00:00")
    assert "task_id" not in line and "trace_id" not in line


def test_ids_passed_as_extra_become_fields() -> None:
    line = _line("could not record task %s", "t1", **ids(task_id="t1", batch_id="b1", traceparent=TRACEPARENT))
    assert (line["task_id"], line["batch_id"], line["trace_id"]) == ("t1", "b1", "4bf92f3577b34da6a3ce929d0e0e4736")


def test_ids_leaves_out_what_is_not_known() -> None:
    assert ids(batch_id="b1", traceparent=None) == {"batch_id": "b1"}


def test_inside_a_traced_request_a_line_carries_its_trace_and_task() -> None:
    tracing.configure(None, "batchwire-test", exporter=InMemorySpanExporter())
    try:
        spans = RequestSpans(TRACEPARENT)
        spans.sent("t9")
        line = _line("something about this request")
        spans.end(200)
        after = _line("after the request")
    finally:
        tracing.shutdown()
    assert line["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736" and line["task_id"] == "t9"
    assert "trace_id" not in after, "the request's ids end with its route"


def test_an_unknown_format_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--log-format is 'xml'; use text or json"):
        logs.check_format("xml")


def test_an_unknown_level_names_the_flag_and_a_known_one_is_taken_in_any_case() -> None:
    with pytest.raises(ValueError, match="--log-level is 'verbose'; use debug, info, warning, error or critical"):
        logs.check_level("verbose")
    assert logs.check_level("WARNING") == "warning"


SOURCE_PACKAGES = ("gateway", "batcher", "gpu_worker", "transport", "telemetry", "schemas", "batchwire", "infra")


def _log_calls_naming_an_id_without_extra() -> list[str]:
    """Log calls whose arguments name a task or batch id but that pass no ``extra=`` (ids as fields)."""
    root = Path(__file__).resolve().parents[2]
    found: list[str] = []
    for package in SOURCE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("debug", "info", "warning", "error", "exception", "critical")
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in ("log", "logger")
                ):
                    continue
                names_an_id = any(
                    "task_id" in ast.unparse(arg) or "batch_id" in ast.unparse(arg) for arg in node.args[1:]
                )
                if names_an_id and not any(keyword.arg == "extra" for keyword in node.keywords):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)[:120]}")
    return found


def test_every_log_line_about_a_task_or_batch_carries_its_id_as_a_field() -> None:
    """A JSON line is found by its ids, not by parsing its message: ``extra=ids(...)`` wherever one is named."""
    assert _log_calls_naming_an_id_without_extra() == []
