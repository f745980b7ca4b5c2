"""The ``results.json`` schema, run metadata, and reading and writing result files.

The JSON is the durable record of a run: the table, the plots and ``--compare`` are all made from
it, so a figure can be redrawn or compared months later without sending load again.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, NotRequired, TypedDict, cast

from batchwire.bench.kafka_log import KafkaWrites
from batchwire.bench.lone import LoneReport
from batchwire.bench.procstats import GroupStats
from batchwire.bench.prom import ServerStats
from batchwire.bench.redis_info import RedisCommands

SCHEMA = "batchwire-bench/1"


class GeneratorStats(TypedDict):
    """The load generator's own health: if it lags or saturates a core, the latencies are suspect."""

    cpu_s: float
    cores: float
    us_per_request: float | None
    max_outstanding: int
    event_loop: str
    client: str


class After504(TypedDict):
    """The requests of the window answered 504, and what the service did with their tasks after."""

    answered: int
    without_task_id: int
    statuses: dict[str, int]
    """Each task's status read back after the run (``completed``: computed for nobody)."""
    computed: int
    share_of_computed: float | None
    """``computed`` over everything computed for the window: 200 answers plus ``computed``."""


class RateReport(TypedDict):
    offered_rps: float
    window_s: float
    warmup_s: float
    scheduled: int
    sent: int
    ok: int
    errors: dict[str, int]
    error_total: int
    unfinished: int
    warmup_sent: int
    answers_in_window: int
    throughput_rps: float
    drained_answers: int
    drain_s: float
    latency_ms: dict[str, float]
    latency_all_ms: dict[str, float]
    latency_hdr: str
    latency_by_second_ms: list[float | None]
    """Mean latency of the 200 answers due in each second of the window (``batchwire.bench.settle``)."""
    lag_ms: dict[str, float]
    sends: str
    """Each measured send's due time and lag (``batchwire.bench.sends``), which the simulation replays."""
    warmup_sends: str
    """The warm-up's sends, the same way (due before the window), replayed first: near capacity the
    window starts with whatever queue the warm-up left."""
    calls: str
    """The backend calls that started in the window: their starts, sizes and durations
    (``batchwire.bench.calls``; empty: the service kept no batch journal that the bench could read)."""
    refused_ms: dict[str, float]
    """503 and 429 answers, timed from the scheduled send like every latency."""
    refused_from_send_ms: dict[str, float]
    """The same refusals timed from when the send ran: without the generator's lag."""
    after_504: After504
    generator: GeneratorStats
    server: ServerStats | None
    processes: dict[str, GroupStats]
    redis_commands: NotRequired[RedisCommands]
    """Commands the deployment's Redis ran in the window (``batchwire.bench.redis_info``), where the
    bench knows it."""
    redis_bytes_per_request: NotRequired[float | None]
    """The deployment's Redis memory growth over the window per answered request
    (``batchwire.bench.redis_info.bytes_per_request``), where the bench knows it."""
    kafka_writes: NotRequired[KafkaWrites]
    """Records and bytes the brokers appended in the window (``batchwire.bench.kafka_log``), where the
    bench knows their pids and can read their logs."""
    notes: list[str]


class RunReport(TypedDict):
    label: str
    policy: str | None
    sut: dict[str, Any] | None
    rates: list[RateReport]
    lone: NotRequired[LoneReport]
    """The lone-request probe, run after the rates (absent when it did not run)."""
    warm: NotRequired[LoneReport]
    """The warm-path probe, the same with no idle gap, run after the lone one (absent when it did not run)."""


class Results(TypedDict):
    schema: str
    label: str
    config: dict[str, Any]
    metadata: dict[str, Any]
    runs: list[RunReport]


def _git(*args: str) -> str | None:
    # Asked where batchwire's code lives, not in the working directory: the commit under test is
    # the code's, wherever the bench was started from.
    source = Path(__file__).resolve().parent
    try:
        done = subprocess.run(["git", "-C", str(source), *args], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _version() -> str | None:
    try:
        return importlib.metadata.version("batchwire")
    except importlib.metadata.PackageNotFoundError:
        return None


def metadata(started: dt.datetime) -> dict[str, Any]:
    """Where and when the numbers were taken; a result without its machine cannot be compared."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "started_at": started.isoformat(timespec="seconds"),
        "finished_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "batchwire_version": _version(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "argv": sys.argv,
    }


def write(results: Results, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
    return path


class ResultsError(Exception):
    """A results file could not be read as batchwire bench output."""


def load(path: Path) -> Results:
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ResultsError(f"cannot read {path}: {err}") from err
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        raise ResultsError(f"{path} is not a batchwire bench result (expected schema {SCHEMA!r})")
    return cast(Results, document)
