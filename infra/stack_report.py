"""`batchwire stack status [--json]`: every server of the stack, single or replicated.

Each server is listed with its kind, node id, verified pid, port and whether it is alive; a Kafka
node with the partitions it leads (from the cluster's metadata), a Redis node with its role (ROLE),
a Sentinel with the primary it names. Tests and operators pick what to kill from it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TextIO

from infra.aio import run_blocking
from infra.cluster_stack import cluster_env, live_pid, nodes, read_shape, stack_commands
from infra.detached import StackCommands
from infra.kafka_cluster import partition_leaders
from infra.redis_sentinel import redis_role, sentinel_primary
from infra.stack import KAFKA_ENV, cmd_status, not_running, stack_status

_STATUS_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class ServerReport:
    """One server as status found it."""

    kind: str  # "kafka", "redis" or "sentinel"
    node_id: int
    pid: int | None
    port: int | None
    alive: bool
    leads: dict[str, list[int]] | None = None  # Kafka: topic -> partitions this node leads
    role: str | None = None  # Redis: "primary" or "replica"; None when it does not answer
    primary_port: int | None = None  # Sentinel: the primary it names


@dataclass(frozen=True)
class StackReport:
    """Every server, the `BATCHWIRE_*` addresses and the Redis primary's port: what the JSON form holds."""

    state_dir: str
    env: dict[str, str]
    servers: list[ServerReport] = field(default_factory=list)
    redis_primary_port: int | None = None

    @property
    def healthy(self) -> bool:
        return bool(self.servers) and all(s.alive for s in self.servers) and self.redis_primary_port is not None


def stack_report(state_dir: Path) -> StackReport:
    """The state of every server of the stack under `state_dir`, asked within a few seconds."""
    state_dir = state_dir.resolve()
    shape = read_shape(state_dir)
    if shape is None:
        return _single_report(state_dir)
    all_nodes = nodes(state_dir, shape)
    env = cluster_env(all_nodes, shape)
    pids = {(node.kind, node.node_id): live_pid(node) for node in all_nodes}
    ports = {(node.kind, node.node_id): (node.server.ports() or (None,))[0] for node in all_nodes}
    leaders = _leaders(env.get(KAFKA_ENV, ""), any(pids[key] for key in pids if key[0] == "kafka"))
    live_sentinels = [p for (kind, n), p in ports.items() if kind == "sentinel" and p and pids[(kind, n)]]
    servers = []
    for node in all_nodes:
        key = (node.kind, node.node_id)
        pid, port = pids[key], ports[key]
        report = ServerReport(node.kind, node.node_id, pid, port, pid is not None)
        if node.kind == "kafka":
            report = replace(report, leads=leaders.get(node.node_id, {}))
        elif node.kind == "redis":
            report = replace(report, role=redis_role(port) if pid and port else None)
        elif pid and port:
            report = replace(report, primary_port=sentinel_primary([port]))
        servers.append(report)
    primary = sentinel_primary(live_sentinels) if shape.sentinels else None
    if primary is None:
        primary = next((s.port for s in servers if s.kind == "redis" and s.role == "primary"), None)
    return StackReport(str(state_dir), env, servers, primary)


def cmd_status_report(state_dir: Path, *, as_json: bool, out: TextIO = sys.stdout) -> int:
    """`batchwire stack status`: text (a single stack's own form, a replicated one's server by server) or JSON;
    0 when all is well. Only the text form gives advice, so only it names the commands that act on the stack."""
    if as_json:
        report = stack_report(state_dir)
        print(json.dumps({**asdict(report), "healthy": report.healthy}, indent=2, sort_keys=True), file=out)
        return 0 if report.healthy else 1
    shape = read_shape(state_dir.resolve())
    if shape is None:
        return cmd_status(state_dir, out=out)
    report = stack_report(state_dir)
    commands = stack_commands(state_dir.resolve(), shape)
    for key, value in report.env.items():
        print(f"{key}={value}", file=out)
    for server in report.servers:
        print(f"# {server.kind}-{server.node_id}: {_describe(server, report, commands)}", file=out)
    return 0 if report.healthy else 1


def _single_report(state_dir: Path) -> StackReport:
    status = stack_status(state_dir)
    kafka_port = status.kafka.ports[0] if status.kafka.ports else None
    redis_port = status.redis.ports[0] if status.redis.ports else None
    leaders = _leaders(status.env.get(KAFKA_ENV, ""), status.kafka.alive)
    role = redis_role(redis_port) if status.redis.alive and redis_port else None
    leads = next(iter(leaders.values()), {})
    servers = [
        ServerReport("kafka", 1, status.kafka.pid, kafka_port, status.kafka.alive, leads=leads),
        ServerReport("redis", 1, status.redis.pid, redis_port, status.redis.alive, role=role),
    ]
    primary = redis_port if role == "primary" else None
    return StackReport(str(state_dir), status.env, servers, primary)


def _leaders(bootstrap: str, any_alive: bool) -> dict[int, dict[str, list[int]]]:
    if not bootstrap or not any_alive:
        return {}
    return run_blocking(lambda: partition_leaders(bootstrap, timeout_s=_STATUS_TIMEOUT_S))


def _describe(server: ServerReport, report: StackReport, commands: StackCommands) -> str:
    if not server.alive:
        return not_running(server.port, commands)
    where = f"pid {server.pid}, port {server.port}"
    if server.kind == "kafka":
        led = sum(len(parts) for parts in (server.leads or {}).values())
        return f"alive ({where}), leads {led} partitions"
    if server.kind == "redis":
        return f"alive ({where}), {server.role or 'NOT answering'}"
    names = "no primary" if server.primary_port is None else f"primary at port {server.primary_port}"
    agrees = "" if server.primary_port == report.redis_primary_port else " (disagrees)"
    return f"alive ({where}), names {names}{agrees}"
