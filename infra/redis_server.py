"""A Redis server on a loopback port, configured by a `redis.conf` in its work folder.

Test sessions run it throwaway (no persistence, no memory bound); `batchwire stack up` runs it
bounded (`maxmemory`) and persistent (append-only file), so a restart keeps the stored tasks.
"""

from __future__ import annotations

import re
import shutil
import socket
import time
from pathlib import Path

from infra.errors import PortTakenError, ServiceStartError, StartTimeoutError, ToolMissingError
from infra.loopback import LoopbackServer, write_atomically
from infra.ports import LOOPBACK, free_port, free_port_pair
from infra.process import ServiceProcess

DEFAULT_START_TIMEOUT_S = 15.0
DEFAULT_STOP_TIMEOUT_S = 10.0
_POLL_INTERVAL_S = 0.02
CONFIG_NAME = "redis.conf"
CLUSTER_BUS_OFFSET = 10_000
"""A cluster node's bus listens this far below its port (``cluster-port``). Redis's default, 10,000
above, lands in the kernel's ephemeral range, where any outgoing connection may hold it."""
CLUSTER_NODE_TIMEOUT_MS = 2000
"""How long a cluster node may not answer before its replica takes over (Redis's default is 15 s)."""

# batchwire's keys are task states, idempotency keys, rate-limit buckets and delivery counts, all
# with a TTL, and worker credits. An evicting policy would drop live ones silently (a queued task
# forgotten, an idempotency key gone so a retry runs twice, a poison input's count reset), and
# `volatile-*` policies would too, since nearly every key has a TTL. `noeviction` turns a full
# Redis into refused writes instead: callers get 503 `unavailable` and workers retry storing their
# results until expiring states free memory.
MAXMEMORY_POLICY = "noeviction"

_MEMORY = re.compile(r"(?i)^\d+(b|k|kb|m|mb|g|gb)?$")


def checked_maxmemory(text: str) -> str:
    """`text` if Redis takes it as a `maxmemory` (bytes, or a number with k/kb/m/mb/g/gb; 0 for no
    bound), lower-cased; else ValueError saying what is taken."""
    value = text.strip().lower()
    if not _MEMORY.match(value):
        raise ValueError(f"{text!r} is not a memory size; give bytes or a number with kb, mb or gb (e.g. 512mb)")
    return value


def read_config_port(config_path: Path) -> int | None:
    """The `port` a `redis.conf` written by `RedisServer` names; None without a readable one."""
    try:
        lines = config_path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.strip().partition(" ")
        if key == "port" and value.strip().isdigit():
            return int(value.strip())
    return None


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


def spawn_answering(
    argv: list[str], port: int, what: str, server: LoopbackServer, *, cwd: Path, detached: bool, deadline: float
) -> ServiceProcess:
    """Starts ``argv`` (a redis-server, or one in Sentinel mode) and returns once it answers PING on
    ``port``; a process that exits or stays silent until ``deadline`` is stopped and reported."""
    log_path = server.log_path
    process = ServiceProcess.spawn(argv, log_path=log_path, cwd=cwd, detached=detached)
    while process.is_alive() and time.monotonic() < deadline:
        if redis_pings(port):
            if process.listens_on(port) is False:
                process.terminate(2.0)
                raise PortTakenError(
                    f"{what} on port {port}: another process answered there, having bound the port first "
                    f"(log: {log_path}):\n{server.log_tail()}"
                )
            return process
        time.sleep(_POLL_INTERVAL_S)
    running = process.is_alive()
    process.terminate(2.0)
    error = StartTimeoutError if running else ServiceStartError
    why = "did not answer PING before the deadline" if running else "exited during start-up"
    raise error(f"{what} on port {port} {why} (log: {log_path}):\n{server.log_tail()}")


def _quoted(text: str) -> str:
    # redis.conf reads a double-quoted value with backslash escapes (a folder name may hold spaces).
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


class RedisServer(LoopbackServer):
    """One `redis-server` over a work folder (redis.conf, redis.log, its data); same port across
    restarts.

    `persistent`: every write goes to an append-only file, fsynced every second, so `start()` after
    `stop()` or `kill()` brings the data back (a machine crash can lose the last second; a killed
    process loses nothing it acknowledged). Otherwise a restart gives an empty server.
    `maxmemory`: the memory bound (`checked_maxmemory`; None: none), past which writes are refused.
    `replica_of`: the loopback port of the primary this server replicates (None: a primary).
    `cluster`: a Redis Cluster node (`infra.redis_cluster` joins the nodes); its node id and view of
    the cluster are kept in `nodes.conf` in its work folder.
    """

    def __init__(
        self,
        work_dir: Path,
        *,
        port: int | None = None,
        detached: bool = False,
        binary: Path | None = None,
        maxmemory: str | None = None,
        persistent: bool = False,
        replica_of: int | None = None,
        cluster: bool = False,
    ) -> None:
        super().__init__(
            ports_chosen_by_us=port is None,
            start_timeout_s=DEFAULT_START_TIMEOUT_S,
            stop_timeout_s=DEFAULT_STOP_TIMEOUT_S,
        )
        self._work_dir = work_dir
        self._cluster = cluster
        self._port = port if port is not None else self._free_port()
        self._detached = detached
        self._binary = binary
        self._maxmemory = "0" if maxmemory is None else checked_maxmemory(maxmemory)
        self._persistent = persistent
        self._replica_of = replica_of

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
    def config_path(self) -> Path:
        return self._work_dir / CONFIG_NAME

    @property
    def work_dir(self) -> Path:
        return self._work_dir

    def _choose_new_ports(self) -> None:
        self._port = self._free_port()

    def _free_port(self) -> int:
        return free_port_pair(CLUSTER_BUS_OFFSET) if self._cluster else free_port()

    def config_text(self) -> str:
        """The text of redis.conf for this server."""
        settings = [
            ("port", str(self._port)),
            ("bind", LOOPBACK),
            ("daemonize", "no"),
            ("dir", _quoted(str(self._work_dir.resolve()))),
            ("loglevel", "warning"),
            ("save", '""'),  # no RDB snapshots: the append-only file (when on) is the persistence
            ("appendonly", "yes" if self._persistent else "no"),
            ("appendfsync", "everysec"),
            ("maxmemory", self._maxmemory),
            ("maxmemory-policy", MAXMEMORY_POLICY),
        ]
        if self._replica_of is not None:
            settings.append(("replicaof", f"{LOOPBACK} {self._replica_of}"))
        if self._cluster:
            settings += [
                ("cluster-enabled", "yes"),
                ("cluster-port", str(self._port - CLUSTER_BUS_OFFSET)),
                ("cluster-config-file", "nodes.conf"),
                ("cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS)),
            ]
        return "".join(f"{key} {value}\n" for key, value in settings)

    def _argv(self) -> list[str]:
        binary = self._binary if self._binary is not None else find_redis_server()
        return [str(binary), str(self.config_path.resolve())]

    def _start_once(self, deadline: float) -> None:
        self._work_dir.mkdir(parents=True, exist_ok=True)
        argv = self._argv()
        write_atomically(self.config_path, self.config_text())
        self._process = spawn_answering(
            argv, self._port, "redis-server", self, cwd=self._work_dir, detached=self._detached, deadline=deadline
        )
