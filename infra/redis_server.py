"""A throwaway Redis server on a loopback port: no persistence, logs to a file."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

from infra.errors import ServiceStartError, ToolMissingError
from infra.loopback import LoopbackServer
from infra.ports import LOOPBACK, free_port
from infra.process import ServiceProcess

DEFAULT_START_TIMEOUT_S = 15.0
DEFAULT_STOP_TIMEOUT_S = 10.0
_POLL_INTERVAL_S = 0.02


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


class RedisServer(LoopbackServer):
    """One `redis-server` over a work folder (redis.log); same port across restarts. No
    persistence: after `stop()` or `kill()`, `start()` gives an empty server."""

    def __init__(
        self,
        work_dir: Path,
        *,
        port: int | None = None,
        detached: bool = False,
        binary: Path | None = None,
    ) -> None:
        super().__init__(
            ports_chosen_by_us=port is None,
            start_timeout_s=DEFAULT_START_TIMEOUT_S,
            stop_timeout_s=DEFAULT_STOP_TIMEOUT_S,
        )
        self._work_dir = work_dir
        self._port = port if port is not None else free_port()
        self._detached = detached
        self._binary = binary

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

    def _choose_new_ports(self) -> None:
        self._port = free_port()

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
        raise ServiceStartError(f"redis-server on port {self._port} {why} (log: {self.log_path}):\n{self.log_tail()}")
