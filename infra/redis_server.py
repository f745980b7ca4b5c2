"""A throwaway Redis server on a loopback port: no persistence, logs to a file."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

from infra.errors import ServiceStartError, ToolMissingError
from infra.ports import LOOPBACK, free_port
from infra.process import ServiceProcess, tail_text

DEFAULT_START_TIMEOUT_S = 15.0
DEFAULT_STOP_TIMEOUT_S = 10.0
_POLL_INTERVAL_S = 0.02
_PORT_ATTEMPTS = 3


def find_redis_server() -> Path:
    """`redis-server` on PATH, or an error that says how to install it."""
    found = shutil.which("redis-server")
    if found is None:
        raise ToolMissingError(
            "redis-server not found on PATH; install it (Debian/Ubuntu: apt-get install redis-server)"
        )
    return Path(found)


def redis_pings(port: int, host: str = LOOPBACK, timeout_s: float = 1.0) -> bool:
    """One inline PING; True on `+PONG`. Plain socket: no client library, no pool to close."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One `redis-server` over a work folder (redis.log); same port across restarts."""

    def __init__(
        self,
        work_dir: Path,
        *,
        port: int | None = None,
        detached: bool = False,
        binary: Path | None = None,
    ) -> None:
        self._work_dir = work_dir
        self._port_chosen_by_us = port is None
        self._port = port if port is not None else free_port()
        self._detached = detached
        self._binary = binary
        self._process: ServiceProcess | None = None
        self._has_served = False

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:PORT/0`, valid before `start()` and across restarts."""
        return f"redis://{LOOPBACK}:{self._port}/0"

    @property
    def log_path(self) -> Path:
        return self._work_dir / "redis.log"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        """Launch and return once PING answers (retrying on a fresh port if ours was taken)."""
        if self.is_running():
            return
        deadline = time.monotonic() + timeout_s
        attempts = _PORT_ATTEMPTS if self._port_chosen_by_us and not self._has_served else 1
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(deadline)
            except ServiceStartError:
                if attempt == attempts or "Address already in use" not in tail_text(self.log_path):
                    raise
                self._port = free_port()
                continue
            self._has_served = True
            return

    def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        """SIGTERM (redis exits at once without persistence), SIGKILL after `timeout_s`."""
        if self._process is not None:
            self._process.terminate(timeout_s)
            self._process = None

    def kill(self) -> None:
        """SIGKILL: a crash. All data is lost (no persistence); `start()` gives an empty server."""
        if self._process is not None:
            self._process.kill()
            self._process = None

    def _argv(self) -> list[str]:
        binary = self._binary if self._binary is not None else find_redis_server()
        return [
            str(binary),
            "--port",
            str(self._port),
            "--bind",
            LOOPBACK,
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            str(self._work_dir),
            "--loglevel",
            "warning",
        ]

    def _start_once(self, deadline: float) -> None:
        self._work_dir.mkdir(parents=True, exist_ok=True)
        process = ServiceProcess.spawn(
            self._argv(), log_path=self.log_path, cwd=self._work_dir, detached=self._detached
        )
        self._process = process
        while process.is_alive() and time.monotonic() < deadline:
            if redis_pings(self._port):
                return
            time.sleep(_POLL_INTERVAL_S)
        running = process.is_alive()
        process.terminate(2.0)
        self._process = None
        why = "did not answer PING before the deadline" if running else "exited during start-up"
        raise ServiceStartError(
            f"redis-server on port {self._port} {why} (log: {self.log_path}):\n{tail_text(self.log_path)}"
        )
