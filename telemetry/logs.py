"""Log output: plain text for a terminal (the default), or one JSON object per line for collectors.

A JSON line carries the ids its record knows: ``task_id`` and ``batch_id`` when the call passed
them (``extra={"task_id": ...}``), and, inside a traced request, the request's ``trace_id`` and
``task_id`` (``telemetry.spans``).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

from telemetry import spans, tracing

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error", "critical")
LEVEL_NAMES = f"{', '.join(LEVELS[:-1])} or {LEVELS[-1]}"
"""The levels as a flag's help and its refusal name them."""
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_IDS = ("task_id", "batch_id", "trace_id")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the known ids, and the traceback."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in _IDS:
            value = record.__dict__.get(name)
            if value is not None:
                line[name] = value
        if tracing.ACTIVE and "trace_id" not in line:
            trace_id, task_id = spans.current_ids()
            if trace_id is not None:
                line["trace_id"] = trace_id
            if task_id is not None and "task_id" not in line:
                line["task_id"] = task_id
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def ids(*, task_id: str | None = None, batch_id: str | None = None, traceparent: str | None = None) -> dict[str, str]:
    """The ids a log call passes as ``extra=``: the JSON line carries them as fields."""
    fields = {"task_id": task_id, "batch_id": batch_id, "trace_id": tracing.trace_id_of(traceparent)}
    return {name: value for name, value in fields.items() if value is not None}


def check_format(fmt: str) -> str:
    """``fmt`` when it is a known format; else a ValueError naming the flag."""
    if fmt not in FORMATS:
        raise ValueError(f"--log-format is {fmt!r}; use text or json (BATCHWIRE_LOG_FORMAT)")
    return fmt


def check_level(level: str) -> str:
    """``level`` in lower case when it is a known level; else a ValueError naming the flag (uvicorn
    fails its start on an unknown one, and ``logging`` would quietly log at info)."""
    lowered = level.lower()
    if lowered not in LEVELS:
        raise ValueError(f"--log-level is {level!r}; use {LEVEL_NAMES} (BATCHWIRE_LOG_LEVEL)")
    return lowered


_structured = False


def configure(level: str, fmt: str = "text") -> None:
    """Sends the root logger's records to stderr in ``fmt`` at ``level`` (as ``logging.basicConfig``:
    a root logger that has handlers already keeps them)."""
    global _structured
    level = check_level(level)
    _structured = check_format(fmt) == "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if _structured else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])


def structured() -> bool:
    """True once ``configure`` chose JSON: servers then leave their loggers to the root's handler."""
    return _structured
