"""A Kafka + Redis stack of one bench run's own, and the environment that points its roles at it.

Comparing backbones (one broker against three, Redis with and without a replica) needs each run on
a fresh stack of a known shape; ``batchwire stack up --state-dir`` starts one anywhere, and its
``stack.env`` names the addresses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.detached import StackCommands
from infra.stack import state_dir_flag

#: The addresses a stack of the run's own replaces: the roles must not reach another Kafka or Redis.
_ADDRESS_VARS = ("BATCHWIRE_KAFKA_BOOTSTRAP", "BATCHWIRE_REDIS_URL")


@dataclass(frozen=True, slots=True)
class OwnStack:
    """A Kafka + Redis stack that one bench run starts in a state dir of its own, and removes.

    Its shape is ``batchwire stack up``'s: ``brokers`` KRaft nodes (topics get the default replication
    factor, the smaller of 3 and the brokers), and a Redis primary with ``redis_replicas`` replicas
    (with Sentinels when there is one, and the roles then reach Redis through them).
    """

    state_dir: Path
    brokers: int = 1
    redis_replicas: int = 0

    def flags(self) -> list[str]:
        return [
            "--state-dir",
            str(self.state_dir),
            "--brokers",
            str(self.brokers),
            "--redis-replicas",
            str(self.redis_replicas),
        ]

    @property
    def down(self) -> str:
        """The `batchwire stack down` that stops this stack, for a message: its folder quoted, since a
        temporary folder's path may hold a space."""
        return StackCommands(state_dir_flag(self.state_dir)).down

    def describe(self) -> dict[str, Any]:
        return {"state_dir": str(self.state_dir), "brokers": self.brokers, "redis_replicas": self.redis_replicas}


def child_env(base: Mapping[str, str], own: OwnStack | None) -> dict[str, str]:
    """The environment of the roles and the stack commands: with a stack of the run's own, its
    ``stack.env`` gives the addresses (set ones would win over the file, so they are dropped)."""
    env = {**base, "PYTHONUNBUFFERED": "1"}
    if own is not None:
        for name in _ADDRESS_VARS:
            env.pop(name, None)
        env["BATCHWIRE_STACK_ENV"] = str(own.state_dir / "stack.env")
    return env


def server_pids(status: Mapping[str, Any]) -> dict[str, list[int]]:
    """Live server pids by kind (kafka, redis, sentinel) from ``batchwire stack status --json``."""
    found: dict[str, list[int]] = {"kafka": [], "redis": []}
    for server in status.get("servers", []):
        pid = server.get("pid")
        if server.get("alive") and isinstance(pid, int):
            found.setdefault(str(server.get("kind")), []).append(pid)
    return found
