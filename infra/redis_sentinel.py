"""Redis Sentinel on loopback (`redis-server CONF --sentinel`), and asking Redis who the primary is.

A Sentinel rewrites its own config file as it learns the deployment (the current primary, the
replicas, the other Sentinels, the epoch), so the file is written only when it does not exist yet:
a restarted Sentinel goes on from what it knew instead of from the primary it first watched.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from infra.loopback import LoopbackServer, write_atomically
from infra.ports import LOOPBACK, free_port
from infra.redis_server import (
    DEFAULT_START_TIMEOUT_S,
    DEFAULT_STOP_TIMEOUT_S,
    find_redis_server,
    spawn_answering,
)

MASTER_NAME = "batchwire"
QUORUM = 2
# A primary that does not answer for this long is down for one Sentinel; `QUORUM` of them agree,
# one is elected, it promotes a replica: a few seconds from crash to new primary on loopback.
DOWN_AFTER_MS = 1000
# Also how long before a failed failover is tried again (twice this): short, for tests.
FAILOVER_TIMEOUT_MS = 5000
SENTINEL_CONFIG_NAME = "sentinel.conf"
_POLL_INTERVAL_S = 0.02
_ASK_TIMEOUT_S = 0.5


class SentinelServer(LoopbackServer):
    """One Sentinel over a work folder (sentinel.conf, sentinel.log) watching `MASTER_NAME`."""

    def __init__(self, work_dir: Path, *, primary_port: int, port: int | None = None, detached: bool = False) -> None:
        super().__init__(
            ports_chosen_by_us=port is None,
            start_timeout_s=DEFAULT_START_TIMEOUT_S,
            stop_timeout_s=DEFAULT_STOP_TIMEOUT_S,
        )
        self._work_dir = work_dir
        self._port = port if port is not None else free_port()
        self._primary_port = primary_port
        self._detached = detached

    @property
    def port(self) -> int:
        return self._port

    @property
    def log_path(self) -> Path:
        return self._work_dir / "sentinel.log"

    @property
    def config_path(self) -> Path:
        return self._work_dir / SENTINEL_CONFIG_NAME

    def _choose_new_ports(self) -> None:
        self._port = free_port()
        self.config_path.unlink(missing_ok=True)

    def config_text(self) -> str:
        """The first sentinel.conf; Sentinel adds what it learns below it."""
        lines = [
            f"port {self._port}",
            f"bind {LOOPBACK}",
            "daemonize no",
            f'dir "{self._work_dir.resolve()}"',
            "loglevel warning",
            f"sentinel monitor {MASTER_NAME} {LOOPBACK} {self._primary_port} {QUORUM}",
            f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}",
            f"sentinel parallel-syncs {MASTER_NAME} 1",
        ]
        return "".join(f"{line}\n" for line in lines)

    def _start_once(self, deadline: float) -> None:
        self._work_dir.mkdir(parents=True, exist_ok=True)
        if not self.config_path.is_file():
            write_atomically(self.config_path, self.config_text())
        argv = [str(find_redis_server()), str(self.config_path.resolve()), "--sentinel"]
        self._process = spawn_answering(
            argv, self._port, "Sentinel", self, cwd=self._work_dir, detached=self._detached, deadline=deadline
        )


def no_retry() -> Retry:
    """For one question to a server that may hang (stopped, overloaded): redis-py's default retries a
    timed-out command three times, with backoff, which turns each ask's timeout into ten seconds."""
    return Retry(NoBackoff(), 0)


def sentinel_primary(sentinel_ports: Iterable[int], master: str = MASTER_NAME) -> int | None:
    """The primary's port as the first answering Sentinel names it; None if none answers."""
    for port in sentinel_ports:
        try:
            with redis.Redis(host=LOOPBACK, port=port, socket_timeout=_ASK_TIMEOUT_S, retry=no_retry()) as client:
                answer = client.execute_command("SENTINEL", "get-master-addr-by-name", master)
        except redis.RedisError:
            continue
        if answer:
            return int(answer[1])
    return None


def redis_role(port: int) -> str | None:
    """'primary' or 'replica' as the server at `port` says (ROLE); None if it does not answer."""
    try:
        with redis.Redis(host=LOOPBACK, port=port, socket_timeout=_ASK_TIMEOUT_S, retry=no_retry()) as client:
            role = client.execute_command("ROLE")
    except redis.RedisError:
        return None
    name = role[0].decode() if isinstance(role[0], bytes) else str(role[0])
    return {"master": "primary", "slave": "replica"}.get(name, name)


def recorded_primary(config_paths: Iterable[Path], master: str = MASTER_NAME) -> int | None:
    """The primary's port as the Sentinels' config files record it (they rewrite them on a
    failover); the file with the highest config epoch wins. None without one."""
    best: tuple[int, int] | None = None
    for path in config_paths:
        try:
            lines = [line.split() for line in path.read_text().splitlines()]
        except OSError:
            continue
        port = next((int(w[4]) for w in lines if w[:3] == ["sentinel", "monitor", master] and w[4:5]), None)
        epoch = next((int(w[3]) for w in lines if w[:3] == ["sentinel", "config-epoch", master] and w[3:4]), 0)
        if port is not None and (best is None or epoch > best[0]):
            best = (epoch, port)
    return None if best is None else best[1]
