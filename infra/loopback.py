"""What the local Kafka broker and Redis server share: one process on loopback ports, started with
a retry on fresh ports, stopped cleanly or killed, its files (which record its ports) written whole."""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from pathlib import Path

from infra.errors import PortTakenError, ServiceStartError
from infra.process import ServiceProcess, tail_text

PORT_ATTEMPTS = 3
"""Starts on fresh ports a server whose port another process bound first gets, in all."""


def write_atomically(path: Path, text: str) -> None:
    """Replaces ``path`` with ``text`` in one rename: a reader (`source stack.env`, another `status`,
    the next `up` reading the recorded ports) never sees half a file, even after a crash mid-write."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(text)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


class LoopbackServer(ABC):
    """A server process whose ports stay fixed across restarts, so clients keep their address.

    Ports it chose itself (free when chosen) may be taken by someone else before its first start:
    that start retries on fresh ports. Once it has served, or with ports given to it, a taken port
    is an error instead.
    """

    def __init__(self, *, ports_chosen_by_us: bool, start_timeout_s: float, stop_timeout_s: float) -> None:
        self._ports_chosen_by_us = ports_chosen_by_us
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._process: ServiceProcess | None = None
        self._has_served = False
        self._answered_by_another = False

    @property
    @abstractmethod
    def log_path(self) -> Path: ...

    @abstractmethod
    def _start_once(self, deadline: float) -> None:
        """Launches the process and returns once it serves, or raises ``ServiceStartError``."""

    @abstractmethod
    def _choose_new_ports(self) -> None:
        """Moves to fresh ports after a start found one taken."""

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def log_tail(self, lines: int = 40) -> str:
        return tail_text(self.log_path, lines)

    def port_taken(self) -> bool:
        """Whether its last start failed because another process held one of its ports."""
        return self._answered_by_another or "Address already in use" in self.log_tail()

    def start(self, timeout_s: float | None = None) -> None:
        """Launches the server and returns once it serves (does nothing if it runs already)."""
        if self.is_running():
            return
        deadline = time.monotonic() + (self._start_timeout_s if timeout_s is None else timeout_s)
        attempts = PORT_ATTEMPTS if self._ports_chosen_by_us and not self._has_served else 1
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(deadline)
            except ServiceStartError as err:
                self._answered_by_another = isinstance(err, PortTakenError)
                if attempt == attempts or not self.port_taken():
                    raise
                self._choose_new_ports()
                continue
            self._has_served = True
            self._answered_by_another = False
            return

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM, then SIGKILL if it takes longer than ``timeout_s``."""
        if self._process is not None:
            self._process.terminate(self._stop_timeout_s if timeout_s is None else timeout_s)
            self._process = None

    def kill(self) -> None:
        """SIGKILL: a crash."""
        if self._process is not None:
            self._process.kill()
            self._process = None
