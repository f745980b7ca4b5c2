"""CPU seconds of the processes under test and of the generator itself, by group.

CPU time per answered request is the cost figure that survives a change of machine; it is taken
from the kernel's user+system counters of each process and all its descendants at the window
bounds. Groups keep batchwire apart from Kafka and Redis, which a user may or may not count.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict
from urllib.parse import urlsplit

import psutil


class GroupStats(TypedDict):
    pids: list[int]
    cpu_s: float
    cores: float
    us_per_request: float | None


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _cpu_seconds(process: psutil.Process) -> float | None:
    """Own CPU plus that of reaped children: a helper that exited between samples still counts."""
    try:
        times = process.cpu_times()
    except psutil.Error:
        return None
    return float(times.user + times.system + times.children_user + times.children_system)


@dataclass(frozen=True, slots=True)
class CpuSnapshot:
    """CPU seconds per pid for each group, plus this process's own, at one moment."""

    groups: dict[str, dict[int, float]]
    generator_s: float


class CpuSampler:
    """Samples named groups of root pids (each with its descendants, found anew at every sample)."""

    def __init__(self, groups: Mapping[str, Sequence[int]]) -> None:
        self.groups = {name: list(pids) for name, pids in groups.items() if pids}

    def sample(self) -> CpuSnapshot:
        out: dict[str, dict[int, float]] = {}
        for name, roots in self.groups.items():
            per_pid: dict[int, float] = {}
            for root in roots:
                for process in _tree(root):
                    seconds = _cpu_seconds(process)
                    if seconds is not None:
                        per_pid[process.pid] = seconds
            out[name] = per_pid
        return CpuSnapshot(groups=out, generator_s=time.process_time())


def group_stats(before: CpuSnapshot, after: CpuSnapshot, window_s: float, answers: int) -> dict[str, GroupStats]:
    """CPU used by each group in the window; a process born inside it counts from 0."""
    out: dict[str, GroupStats] = {}
    for name, now in after.groups.items():
        earlier = before.groups.get(name, {})
        cpu_s = sum(seconds - earlier.get(pid, 0.0) for pid, seconds in now.items())
        out[name] = GroupStats(
            pids=sorted(now),
            cpu_s=round(cpu_s, 4),
            cores=round(cpu_s / window_s, 4) if window_s > 0 else 0.0,
            us_per_request=round(cpu_s * 1e6 / answers, 1) if answers else None,
        )
    return out


def _ports(value: str) -> set[int]:
    """Ports named in a bootstrap list (``h1:9092,h2:9093``) or a URL (``redis://h:6379/0``)."""
    ports: set[int] = set()
    for part in value.split(","):
        netloc = urlsplit(part if "://" in part else f"//{part}").netloc
        with contextlib.suppress(ValueError):
            port = urlsplit(f"//{netloc}").port
            if port is not None:
                ports.add(port)
    return ports


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=value`` lines (as ``batchwire stack up`` writes them); a missing file reads as empty."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in lines:
        key, sep, value = line.strip().partition("=")
        if sep and not key.startswith("#"):
            out[key.strip()] = value.strip().strip("'\"")
    return out


def _listening(ports: set[int]) -> list[int]:
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return []
    return sorted(
        {
            c.pid
            for c in connections
            if c.status == psutil.CONN_LISTEN and c.pid is not None and c.laddr and c.laddr.port in ports
        }
    )


def _pid_file(path: Path) -> list[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return []
    return [int(text)] if text.isdigit() and psutil.pid_exists(int(text)) else []


def _pid_files(state_dir: Path, kind: str) -> list[int]:
    """The live pids of a kind's pid files: ``kafka.pid`` for a single stack, ``kafka-1.pid``... for a cluster."""
    paths = [state_dir / f"{kind}.pid", *sorted(state_dir.glob(f"{kind}-*.pid"))]
    return [pid for path in paths for pid in _pid_file(path)]


def discover_infra_pids(state_dir: Path, settings: Mapping[str, str]) -> tuple[dict[str, list[int]], str]:
    """Kafka and Redis server pids (and Sentinels', where there are any), and how they were found.

    Best first: the pid files ``batchwire stack up`` keeps in ``state_dir``; then whoever listens
    on the ports in BATCHWIRE_KAFKA_BOOTSTRAP / BATCHWIRE_REDIS_URL (a Sentinel URL's are the
    Sentinels'); last, process names, which may count strangers (other Kafkas on a shared machine).
    """
    from_files = {kind: _pid_files(state_dir, kind) for kind in ("kafka", "redis", "sentinel")}
    if from_files["kafka"] or from_files["redis"]:
        return {kind: pids for kind, pids in from_files.items() if pids or kind != "sentinel"}, "pid file"
    kafka_ports = _ports(settings.get("BATCHWIRE_KAFKA_BOOTSTRAP", ""))
    redis_url = settings.get("BATCHWIRE_REDIS_URL", "")
    redis_ports = _ports(redis_url)
    if kafka_ports or redis_ports:
        listening = {"kafka": _listening(kafka_ports), "redis": _listening(redis_ports)}
        if redis_url.lower().startswith("redis+sentinel://"):
            listening["sentinel"], listening["redis"] = listening["redis"], []
        return listening, "listening port"
    found: dict[str, list[int]] = {"kafka": [], "redis": []}
    for process in psutil.process_iter(["name", "cmdline"]):
        try:
            name = process.info.get("name") or ""
            cmdline: Iterable[str] = process.info.get("cmdline") or ()
        except psutil.Error:
            continue
        if name.startswith("redis-server"):
            found["redis"].append(process.pid)
        elif any(part == "kafka.Kafka" for part in cmdline):
            found["kafka"].append(process.pid)
    return found, "process name"
