"""Real processes for end-to-end tests: gateways, batchers and workers started with the CLI.

Each process logs to a file under the test's tmp dir; a test that fails shows their tails.
Workers write a batch journal (``--batch-log``) that the tests read to check invariants.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(check: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    """Polls ``check`` until it holds or the deadline passes (then fails, naming ``what``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@dataclass
class Proc:
    name: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "batchwire.cli", *self.args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill9(self) -> None:
        assert self.popen is not None
        os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.popen is None or self.popen.poll() is not None:
            return self.popen.returncode if self.popen else None
        self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
            return None

    def tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Cluster:
    """A multi-process batchwire deployment over the session's Kafka and Redis."""

    base: Path
    kafka_bootstrap: str
    redis_url: str
    namespace: str
    sim_latency_ms: float = 100.0
    extra_env: dict[str, str] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    gateway_urls: list[str] = field(default_factory=list)

    @property
    def batch_log(self) -> Path:
        return self.base / "batches.jsonl"

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWIRE_")}
        env.update(
            BATCHWIRE_KAFKA_BOOTSTRAP=self.kafka_bootstrap,
            BATCHWIRE_REDIS_URL=self.redis_url,
            BATCHWIRE_NAMESPACE=self.namespace,
            BATCHWIRE_STACK_ENV=str(self.base / "no-stack.env"),
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)
        return env

    def spawn(self, name: str, *args: str) -> Proc:
        proc = Proc(name, list(args), self._env(), self.base / f"{name}.log").start()
        self.procs.append(proc)
        return proc

    def gateway(self, index: int | None = None) -> Proc:
        index = len(self.gateway_urls) if index is None else index
        port = free_port()
        proc = self.spawn(f"gateway{index}", "gateway", "--port", str(port), "--gateway-id", f"gw{index}")
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _ready(url), 60, f"gateway {index} to be ready ({proc.tail(5)})")
        self.gateway_urls.append(url)
        return proc

    def batcher(self, index: int, *extra: str) -> Proc:
        return self.spawn(f"batcher{index}", "batcher", "--batcher-id", f"batcher{index}", *extra)

    def worker(self, index: int, *extra: str) -> Proc:
        return self.spawn(
            f"worker{index}",
            "worker",
            "--worker-id",
            f"worker{index}",
            "--batch-log",
            str(self.batch_log),
            "--sim-latency-ms",
            str(self.sim_latency_ms),
            *extra,
        )

    def journal(self) -> list[dict[str, Any]]:
        if not self.batch_log.exists():
            return []
        return [json.loads(line) for line in self.batch_log.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def logs(self) -> str:
        return "\n".join(
            f"--- {proc.name} (pid {proc.popen.pid if proc.popen else '-'})\n{proc.tail()}" for proc in self.procs
        )


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def embedded(base: Path, workers: int = 2, sim_latency_ms: float = 100.0, *extra: str) -> tuple[Proc, str]:
    """``batchwire up`` as a subprocess; returns it and its URL once ready."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWIRE_")}
    env["PYTHONUNBUFFERED"] = "1"
    proc = Proc(
        "embedded",
        [
            "up",
            "--port",
            str(port),
            "--workers",
            str(workers),
            "--sim-latency-ms",
            str(sim_latency_ms),
            "--batch-log",
            str(base / "batches.jsonl"),
            *extra,
        ],
        env,
        base / "embedded.log",
    ).start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _ready(url), 60, f"embedded service to be ready ({proc.tail(5)})")
    return proc, url
