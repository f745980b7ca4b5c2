"""A Redis primary, one replica and three Sentinels as real processes on loopback, for failover tests.

Debian ships no ``redis-sentinel`` binary here, so each Sentinel is ``redis-server <conf> --sentinel``.
Every wait is bounded; ``stop`` kills every process it started.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from infra.ports import free_port
from tests.support.eventually import eventually_sync

MASTER = "batchwire"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000
START_TIMEOUT_S = 20.0
FAILOVER_WAIT_S = 20.0


def _answers(port: int, check: Callable[[redis.Redis], bool]) -> bool:
    client = redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        return check(client)
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


class SentinelCluster:
    """The primary, ``replicas`` replicas (0 or 1) and ``sentinels`` Sentinels, quorum 2 (or 1 alone)."""

    def __init__(self, workdir: Path, *, replicas: int = 1, sentinels: int = 3) -> None:
        self.workdir = workdir
        self.server = shutil.which("redis-server") or "redis-server"
        self.primary_port = free_port()
        self.replica_port = free_port() if replicas else 0
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.quorum = min(2, sentinels)
        self.processes: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{MASTER}/0"

    def start(self) -> None:
        self._redis(self.primary_port)
        if self.replica_port:
            self._redis(self.replica_port, "--replicaof", "127.0.0.1", str(self.primary_port))
        for port in self.sentinel_ports:
            self._sentinel(port)
        if self.replica_port:
            eventually_sync(self._replica_in_sync, "the replica to sync with the primary", timeout_s=START_TIMEOUT_S)
        eventually_sync(
            self._sentinels_see_everything, "the Sentinels to see the replica and each other", timeout_s=START_TIMEOUT_S
        )

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
        for process in self.processes.values():
            process.wait(timeout=10)

    def kill(self, port: int) -> None:
        """kill -9 of the server on ``port``."""
        process = self.processes[port]
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)

    def pause(self, port: int) -> None:
        """SIGSTOP of the server on ``port``: up, its sockets open, answering nothing (a partition)."""
        os.kill(self.processes[port].pid, signal.SIGSTOP)

    def resume(self, port: int) -> None:
        """SIGCONT of a server ``pause`` stopped."""
        os.kill(self.processes[port].pid, signal.SIGCONT)

    def clients(self, port: int, name: str) -> list[dict[str, Any]]:
        """The connections to the server on ``port`` whose client name is ``name``."""
        with redis.Redis(port=port, socket_timeout=5, socket_connect_timeout=5) as client:
            return [entry for entry in client.client_list() if entry.get("name") == name]

    def master_address(self) -> tuple[str, int] | None:
        """The primary every Sentinel names, when they agree (None while they do not)."""
        seen: set[tuple[str, int]] = set()
        for port in self.sentinel_ports:
            client = redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
            try:
                address: Any = client.sentinel_get_master_addr_by_name(MASTER)
            except (redis.RedisError, OSError):
                return None
            finally:
                client.close()
            if not address:
                return None
            host, master_port = address
            seen.add((host.decode() if isinstance(host, bytes) else str(host), int(master_port)))
        return next(iter(seen)) if len(seen) == 1 else None

    def _redis(self, port: int, *extra: str) -> None:
        data = self.workdir / f"redis-{port}"
        data.mkdir()
        args = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(data), "--save", "", "--appendonly", "no"]
        self._spawn(port, [self.server, *args, *extra], data / "log")
        eventually_sync(
            lambda: _answers(port, lambda c: bool(c.ping())), f"Redis on port {port}", timeout_s=START_TIMEOUT_S
        )

    def _sentinel(self, port: int) -> None:
        data = self.workdir / f"sentinel-{port}"
        data.mkdir()
        conf = data / "sentinel.conf"  # Sentinel rewrites its config file, so each has its own
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {data}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {self.primary_port} {self.quorum}\n"
            f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {MASTER} 1\n"
        )
        self._spawn(port, [self.server, str(conf), "--sentinel"], data / "log")

    def _spawn(self, port: int, argv: list[str], log: Path) -> None:
        with log.open("wb") as out:
            self.processes[port] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)

    def _replica_in_sync(self) -> bool:
        return _answers(self.replica_port, lambda c: c.info("replication").get("master_link_status") == "up")

    def _sentinels_see_everything(self) -> bool:
        def sees(client: redis.Redis) -> bool:
            state: Any = client.sentinel_master(MASTER)
            replicas = 1 if self.replica_port else 0
            others = len(self.sentinel_ports) - 1
            return int(state["num-slaves"]) >= replicas and int(state["num-other-sentinels"]) >= others

        return all(_answers(port, sees) for port in self.sentinel_ports)


class HeldSentinel:
    """A server on loopback in a Sentinel's place that never answers (a Sentinel cut off): it holds
    the first connection, unanswered, until ``release``, and closes every other on its first request.
    ``holding`` is set once the first connection has sent a request."""

    def __init__(self) -> None:
        self.holding = asyncio.Event()
        self._released = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._taken = False
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def release(self) -> None:
        """Closes the held connection; every later one is closed on its first request."""
        self._released.set()

    async def close(self) -> None:
        self.release()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first, self._taken = not self._taken, True
        try:
            await reader.read(1)
            if first:
                self.holding.set()
                await self._released.wait()
        finally:
            writer.close()
