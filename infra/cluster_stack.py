"""The detached replicated stack: `batchwire stack up --brokers N --redis-replicas R` or
`--redis-cluster P`.

N KRaft nodes (controller and broker in each), and a Redis primary with R replicas and, with a
replica, three Sentinels watching them; or a Redis Cluster of P primaries, each with a replica.
Same contract as the single stack (`infra.stack`): `up` makes the stack whole and leaves what works
alone; a dead server starts again on its recorded ports over its data; pid files are checked before
a signal. The shape is recorded in the state dir (`cluster.shape`), so `status` and `down` need no
flags and an `up` with another shape is refused.

A dead cluster node rejoins from its `nodes.conf` (a killed primary comes back as the replica of the
one that replaced it). A dead Redis node of the Sentinel shape starts as a replica of the primary
the Sentinels name (after a failover, the old primary comes back as a replica of the promoted one);
it starts as the primary only when they still name it, i.e. no failover happened.
"""

from __future__ import annotations

import shlex
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from infra.aio import run_blocking
from infra.detached import (
    DetachedServer,
    StackCommands,
    not_answering,
    poll_until,
    refuse_taken_ports,
    unrecorded,
    write_pid,
)
from infra.errors import InfraError, ServiceStartError, ShapeError
from infra.fetch_kafka import prepare_kafka
from infra.kafka_cluster import cluster_jvm_opts, harden_offsets_topic, node_properties
from infra.kafka_dist import KafkaRuntime
from infra.kafka_probe import wait_for_kafka
from infra.kafka_server import DEFAULT_STOP_TIMEOUT_S, KafkaServer, new_cluster_id, read_config_ports
from infra.locks import file_lock
from infra.loopback import PORT_ATTEMPTS, write_atomically
from infra.ports import LOOPBACK, free_port, free_port_pair
from infra.process import ServiceProcess
from infra.redis_cluster import cluster_url, create, wait_whole
from infra.redis_sentinel import (
    MASTER_NAME,
    SENTINEL_CONFIG_NAME,
    SentinelServer,
    recorded_primary,
    redis_role,
    sentinel_primary,
)
from infra.redis_server import CLUSTER_BUS_OFFSET, CONFIG_NAME, RedisServer, read_config_port, redis_pings
from infra.stack import (
    DEFAULT_UP_TIMEOUT_S,
    ENV_FILE_NAME,
    KAFKA_ENV,
    REDIS_ENV,
    StackUp,
    cmd_down,
    stack_up,
    state_dir_flag,
)

SHAPE_FILE_NAME = "cluster.shape"
SENTINELS = 3


@dataclass(frozen=True)
class Shape:
    """How many of each server a replicated stack runs."""

    brokers: int
    redis_replicas: int
    redis_cluster: int = 0
    """Primaries of a Redis Cluster, each with a replica (0: no cluster)."""

    @property
    def sentinels(self) -> int:
        return SENTINELS if self.redis_replicas > 0 and not self.redis_cluster else 0

    @property
    def redis_nodes(self) -> int:
        return 2 * self.redis_cluster if self.redis_cluster else self.redis_replicas + 1

    @property
    def replicated(self) -> bool:
        """Anything beyond the single stack (one broker, one Redis)."""
        return self.brokers > 1 or self.redis_replicas > 0 or self.redis_cluster > 0

    def flags(self) -> str:
        if self.redis_cluster:
            return f"--brokers {self.brokers} --redis-cluster {self.redis_cluster}"
        return f"--brokers {self.brokers} --redis-replicas {self.redis_replicas}"


def read_shape(state_dir: Path) -> Shape | None:
    """The shape recorded in `state_dir`; None for a single stack or none."""
    try:
        lines = (state_dir / SHAPE_FILE_NAME).read_text().splitlines()
    except (FileNotFoundError, NotADirectoryError):
        return None
    values = dict(line.split("=", 1) for line in lines if "=" in line)
    return Shape(int(values["brokers"]), int(values["redis_replicas"]), int(values.get("redis_cluster", 0)))


@dataclass(frozen=True)
class Node:
    """One server of the replicated stack: its kind, its node id and where it lives."""

    kind: str  # "kafka", "redis" or "sentinel"
    node_id: int
    server: DetachedServer


def stack_commands(state_dir: Path, shape: Shape) -> StackCommands:
    """The commands that act on the stack of this shape under `state_dir`, for the advice a message gives."""
    return StackCommands(state_dir_flag(state_dir), f" {shape.flags()}")


def nodes(state_dir: Path, shape: Shape) -> list[Node]:
    """Every server of the stack, Kafka nodes first, then Redis (node 1 the first primary), Sentinels."""
    commands = stack_commands(state_dir, shape)

    def make(kind: str, node_id: int, config_name: str, marks: tuple[str, ...]) -> Node:
        work_dir = state_dir / f"{kind}-{node_id}"
        config = work_dir / config_name
        reader = _kafka_ports if kind == "kafka" else _redis_ports
        name = f"{kind}-{node_id}"
        pid_path = state_dir / f"{name}.pid"
        return Node(kind, node_id, DetachedServer(name, work_dir, config, pid_path, marks, reader, commands))

    found = []
    for node_id in range(1, shape.brokers + 1):
        properties = state_dir / f"kafka-{node_id}" / "server.properties"
        found.append(make("kafka", node_id, "server.properties", ("kafka.Kafka", str(properties))))
    # redis-server rewrites its command line: its folder says whose it is.
    found += [make("redis", n, CONFIG_NAME, ("redis-server",)) for n in range(1, shape.redis_nodes + 1)]
    found += [make("sentinel", n, SENTINEL_CONFIG_NAME, ("redis-server",)) for n in range(1, shape.sentinels + 1)]
    return found


def _kafka_ports(config_path: Path) -> tuple[int, ...]:
    return read_config_ports(config_path) or ()


def _redis_ports(config_path: Path) -> tuple[int, ...]:
    port = read_config_port(config_path)
    return () if port is None else (port,)


def cluster_env(all_nodes: list[Node], shape: Shape) -> dict[str, str]:
    """The `BATCHWIRE_*` addresses the recorded ports make: every broker, and the Redis Cluster's
    nodes, the Sentinels' URL or the lone Redis's."""
    ports = {(node.kind, node.node_id): node.server.ports() for node in all_nodes}
    brokers = [f"{LOOPBACK}:{p[0]}" for (kind, _), p in ports.items() if kind == "kafka" and p]
    env: dict[str, str] = {}
    if brokers:
        env[KAFKA_ENV] = ",".join(brokers)
    sentinels = [f"{LOOPBACK}:{p[0]}" for (kind, _), p in ports.items() if kind == "sentinel" and p]
    cluster_nodes = [p[0] for (kind, _), p in ports.items() if kind == "redis" and p]
    if shape.redis_cluster and cluster_nodes:
        env[REDIS_ENV] = cluster_url(cluster_nodes)
    elif shape.sentinels and sentinels:
        env[REDIS_ENV] = f"redis+sentinel://{','.join(sentinels)}/{MASTER_NAME}"
    elif ports.get(("redis", 1)):
        env[REDIS_ENV] = f"redis://{LOOPBACK}:{ports[('redis', 1)][0]}/0"
    return env


def cluster_up(
    state_dir: Path, shape: Shape, *, redis_maxmemory: str, timeout_s: float
) -> tuple[dict[str, str], tuple[str, ...]]:
    """Make the replicated stack under `state_dir` whole; its `BATCHWIRE_*` variables and one line
    per server on what was done."""
    state_dir = state_dir.resolve()
    deadline = time.monotonic() + timeout_s
    with file_lock(state_dir / ".stack.lock"):
        _check_shape(state_dir, shape)
        all_nodes = nodes(state_dir, shape)
        running = {node.server.name: node.server.process() for node in all_nodes}
        kafka_nodes = [node for node in all_nodes if node.kind == "kafka"]
        fresh_kafka = not any(node.server.ports() for node in kafka_nodes)
        if not fresh_kafka and not all(node.server.ports() for node in kafka_nodes):
            commands = kafka_nodes[0].server.commands
            raise InfraError(
                f"some Kafka nodes under {state_dir} have no recorded ports; run `{commands.down}`, delete "
                f"{shlex.quote(str(state_dir))} and run `{commands.up}` for a new cluster"
            )
        for node in all_nodes:
            if running[node.server.name] is None:
                refuse_taken_ports(node.server)
        runtime = prepare_kafka()  # before Redis starts: a missing Java leaves nothing running
        write_atomically(
            state_dir / SHAPE_FILE_NAME,
            f"brokers={shape.brokers}\nredis_replicas={shape.redis_replicas}\nredis_cluster={shape.redis_cluster}\n",
        )
        if shape.redis_cluster:
            actions = _up_redis_cluster(state_dir, all_nodes, running, redis_maxmemory, deadline)
        else:
            actions = _up_redis_nodes(all_nodes, running, redis_maxmemory, deadline)
        actions += _up_kafka_nodes(state_dir, kafka_nodes, running, runtime, fresh_kafka, deadline)
        env = cluster_env(all_nodes, shape)
        commands = kafka_nodes[0].server.commands
        run_blocking(lambda: harden_offsets_topic(env[KAFKA_ENV], shape.brokers, commands=commands))
        write_atomically(state_dir / ENV_FILE_NAME, "".join(f"{key}={value}\n" for key, value in env.items()))
        return env, tuple(actions)


def cluster_down(state_dir: Path, shape: Shape, *, timeout_s: float) -> bool:
    """Stop every server and keep data and ports: Sentinels first (none fails over a primary being
    stopped), then the Kafka nodes together (one stopped alone waits for a quorum that is leaving),
    then Redis."""
    state_dir = state_dir.resolve()
    with file_lock(state_dir / ".stack.lock"):
        all_nodes = nodes(state_dir, shape)
        stopped = False
        for kind in ("sentinel", "kafka", "redis"):
            processes = [p for p in (node.server.process() for node in all_nodes if node.kind == kind) if p]
            if processes:
                stopped = True
                with ThreadPoolExecutor(max_workers=len(processes), thread_name_prefix="stack-stop") as pool:
                    for done in [pool.submit(process.terminate, timeout_s) for process in processes]:
                        done.result()
        for node in all_nodes:
            node.server.pid_path.unlink(missing_ok=True)
        (state_dir / ENV_FILE_NAME).unlink(missing_ok=True)
        return stopped


def _check_shape(state_dir: Path, shape: Shape) -> None:
    recorded = read_shape(state_dir)
    single = (state_dir / "kafka").is_dir() or (state_dir / "redis").is_dir()
    if (recorded is None and not single) or recorded == shape:
        return
    has = "a single stack (one broker, one Redis)" if recorded is None else f"a stack of `{recorded.flags()}`"
    again = StackCommands(state_dir_flag(state_dir), "" if recorded is None else f" {recorded.flags()}")
    raise InfraError(
        f"{state_dir} holds {has}; nothing was changed. Run `{again.up}` for it, or give "
        f"another --state-dir for `{shape.flags()}`"
    )


def _fresh_ports(count: int, taken: set[int]) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in taken and port not in ports:
            ports.append(port)
    return ports


def _up_redis_nodes(
    all_nodes: list[Node], running: dict[str, ServiceProcess | None], maxmemory: str, deadline: float
) -> list[str]:
    redis_nodes = [node for node in all_nodes if node.kind == "redis"]
    sentinel_nodes = [node for node in all_nodes if node.kind == "sentinel"]
    recorded = {node.server.name: node.server.ports() for node in redis_nodes + sentinel_nodes}
    spare = iter(_fresh_ports(len(redis_nodes) + len(sentinel_nodes), {p for ps in recorded.values() for p in ps}))
    port_of = {name: ports[0] if ports else next(spare) for name, ports in recorded.items()}
    primary = _current_primary(redis_nodes, sentinel_nodes, running, port_of)
    # The primary first: replicas started after it sync at once.
    ordered = sorted(redis_nodes, key=lambda node: port_of[node.server.name] != primary)
    actions = []
    for node in ordered:
        name, process = node.server.name, running[node.server.name]
        if process is not None:
            actions.append(_keep_alive(node, process, redis_pings, deadline))
            continue
        port = port_of[name]
        replica_of = None if port == primary else primary
        server = RedisServer(
            node.server.work_dir, port=port, detached=True, maxmemory=maxmemory, persistent=True, replica_of=replica_of
        )
        server.start(max(deadline - time.monotonic(), 1.0))
        write_pid(node.server.pid_path, server.pid)
        role = "primary" if replica_of is None else f"replica of port {replica_of}"
        kept = "restarted over its data" if recorded[name] else "started empty"
        actions.append(f"{name}: was not running; {kept} as {role} (pid {server.pid}, port {port})")
    for node in sentinel_nodes:
        name = node.server.name
        process = running[name]
        if process is not None:
            actions.append(_keep_alive(node, process, redis_pings, deadline))
            continue
        sentinel = SentinelServer(node.server.work_dir, primary_port=primary, port=port_of[name], detached=True)
        sentinel.start(max(deadline - time.monotonic(), 1.0))
        write_pid(node.server.pid_path, sentinel.pid)
        kept = "restarted with what it knew" if recorded[name] else f"started watching port {primary}"
        actions.append(f"{name}: was not running; {kept} (pid {sentinel.pid}, port {sentinel.port})")
    return actions


def _up_redis_cluster(
    state_dir: Path, all_nodes: list[Node], running: dict[str, ServiceProcess | None], maxmemory: str, deadline: float
) -> list[str]:
    """Starts every dead node of the Redis Cluster on its recorded port over its data (its
    `nodes.conf` keeps its place in the cluster: a killed primary comes back as its replacement's
    replica); a fresh one is created first, each primary with one replica."""
    redis_nodes = [node for node in all_nodes if node.kind == "redis"]
    recorded = {node.server.name: node.server.ports() for node in redis_nodes}
    fresh = not any(recorded.values())
    if not fresh and not all(recorded.values()):
        commands = redis_nodes[0].server.commands
        raise InfraError(
            f"some Redis Cluster nodes under {state_dir} have no recorded ports; run `{commands.down}`, delete "
            f"{shlex.quote(str(state_dir))} and run `{commands.up}` for a new cluster"
        )
    port_of = {name: ports[0] if ports else free_port_pair(CLUSTER_BUS_OFFSET) for name, ports in recorded.items()}
    actions = []
    for node in redis_nodes:
        name, process = node.server.name, running[node.server.name]
        if process is not None:
            actions.append(_keep_alive(node, process, redis_pings, deadline))
            continue
        server = RedisServer(
            node.server.work_dir, port=port_of[name], detached=True, maxmemory=maxmemory, persistent=True, cluster=True
        )
        server.start(max(deadline - time.monotonic(), 1.0))
        write_pid(node.server.pid_path, server.pid)
        kept = "started empty" if fresh else "restarted over its data"
        actions.append(f"{name}: was not running; {kept} as a cluster node (pid {server.pid}, port {port_of[name]})")
    ports = list(port_of.values())
    if fresh:
        create(ports, 1, deadline)
    wait_whole(ports, len(ports) // 2, deadline)
    return actions


def _current_primary(
    redis_nodes: list[Node],
    sentinel_nodes: list[Node],
    running: dict[str, ServiceProcess | None],
    port_of: dict[str, int],
) -> int:
    """The port of the primary: as the live Sentinels name it, else a live node that says it is one,
    else as the Sentinels' files record it, else node 1's."""
    live_sentinels = [port_of[n.server.name] for n in sentinel_nodes if running[n.server.name] is not None]
    named = sentinel_primary(live_sentinels)
    if named is not None:
        return named
    for node in redis_nodes:
        port = port_of[node.server.name]
        if running[node.server.name] is not None and redis_role(port) == "primary":
            return port
    # Everything down (`stack down`, then `up`): the Sentinels' files remember the last failover.
    recorded = recorded_primary(node.server.config_path for node in sentinel_nodes)
    return recorded if recorded is not None else port_of[redis_nodes[0].server.name]


def _up_kafka_nodes(
    state_dir: Path,
    kafka_nodes: list[Node],
    running: dict[str, ServiceProcess | None],
    runtime: KafkaRuntime,
    fresh: bool,
    deadline: float,
) -> list[str]:
    id_path = state_dir / "kafka.cluster-id"
    if fresh:
        write_atomically(id_path, new_cluster_id() + "\n")
        ports = _fresh_ports(2 * len(kafka_nodes), set())
        port_pairs = {node.node_id: (ports[2 * i], ports[2 * i + 1]) for i, node in enumerate(kafka_nodes)}
    else:
        port_pairs = {node.node_id: (node.server.ports()[0], node.server.ports()[1]) for node in kafka_nodes}
    cluster_id = id_path.read_text().strip()
    dead = [node for node in kafka_nodes if running[node.server.name] is None]
    # A fresh cluster's ports were free when drawn, but another process may bind one before its JVM
    # does: every node then starts again on new ports (each knows every controller's address).
    for attempt in range(1, (PORT_ATTEMPTS if fresh else 1) + 1):
        servers = _kafka_servers(runtime, dead, port_pairs, cluster_id)
        failure = _start_together(servers, deadline)
        if failure is None:
            break
        taken = any(server.port_taken() for server in servers.values())
        for server in servers.values():
            server.stop()
        if not (fresh and taken) or attempt == PORT_ATTEMPTS:
            raise failure
        for server in servers.values():
            shutil.rmtree(server.data_dir, ignore_errors=True)  # formatted for the old quorum
        ports = _fresh_ports(2 * len(kafka_nodes), {port for pair in port_pairs.values() for port in pair})
        port_pairs = {node.node_id: (ports[2 * i], ports[2 * i + 1]) for i, node in enumerate(kafka_nodes)}
    actions = []
    for node in kafka_nodes:
        process = running[node.server.name]
        if process is not None:
            actions.append(_keep_alive(node, process, _kafka_serves_until(deadline), deadline))
            continue
        server = servers[node.node_id]
        write_pid(node.server.pid_path, server.pid)
        kept = "started empty" if fresh else "restarted over its data"
        actions.append(f"{node.server.name}: was not running; {kept} (pid {server.pid}, port {server.broker_port})")
    return actions


def _kafka_servers(
    runtime: KafkaRuntime, dead: list[Node], port_pairs: dict[int, tuple[int, int]], cluster_id: str
) -> dict[int, KafkaServer]:
    controllers = {node_id: pair[1] for node_id, pair in port_pairs.items()}
    return {
        node.node_id: KafkaServer(
            runtime,
            node.server.work_dir,
            broker_port=port_pairs[node.node_id][0],
            controller_port=port_pairs[node.node_id][1],
            detached=True,
            jvm_opts=cluster_jvm_opts(),
            extra_properties=node_properties(node.node_id, controllers),
            cluster_id=cluster_id,
        )
        for node in dead
    }


def _start_together(servers: dict[int, KafkaServer], deadline: float) -> ServiceStartError | None:
    """Starts the nodes at once (a node serves only once a majority of the controller quorum runs) and
    waits for every start to end; the first failure, or None."""
    if not servers:
        return None
    with ThreadPoolExecutor(max_workers=len(servers), thread_name_prefix="stack-kafka") as pool:
        started = [pool.submit(server.start, max(deadline - time.monotonic(), 1.0)) for server in servers.values()]
        errors = [future.exception() for future in started]
    for error in errors:
        if isinstance(error, ServiceStartError):
            return error
        if error is not None:
            raise error
    return None


def _kafka_serves_until(deadline: float) -> Callable[[int], bool]:
    def serves(port: int) -> bool:
        return wait_for_kafka(f"{LOOPBACK}:{port}", timeout_s=max(deadline - time.monotonic(), 0.0))

    return serves


def _keep_alive(node: Node, process: ServiceProcess, answers: Callable[[int], bool], deadline: float) -> str:
    ports = node.server.ports()
    if not ports:
        raise unrecorded(node.server, process)
    if not poll_until(lambda: answers(ports[0]), deadline, process):
        raise not_answering(node.server, process, ports[0])
    write_pid(node.server.pid_path, process.pid)
    return f"{node.server.name}: alive (pid {process.pid}, port {ports[0]}), left alone"


def live_pid(node: Node) -> int | None:
    """The node's verified live pid (pid file, else found by its folder)."""
    process = node.server.process()
    return None if process is None else process.pid


__all__ = [
    "SHAPE_FILE_NAME",
    "Node",
    "Shape",
    "cluster_down",
    "cluster_env",
    "cluster_up",
    "cmd_down_any",
    "live_pid",
    "nodes",
    "read_shape",
    "up_any",
]


def up_any(state_dir: Path, shape: Shape, *, redis_maxmemory: str) -> StackUp:
    """`batchwire stack up` for either shape: the single stack as before, or the replicated one."""
    if shape.brokers < 1 or shape.redis_replicas < 0:
        raise ShapeError(f"--brokers must be 1 or more and --redis-replicas 0 or more; got `{shape.flags()}`")
    if shape.redis_cluster and (shape.redis_cluster < 3 or shape.redis_replicas):
        raise ShapeError(
            "--redis-cluster takes 3 primaries or more, each with one replica, and no --redis-replicas (which sizes "
            f"the Sentinel shape); got --redis-cluster {shape.redis_cluster} --redis-replicas {shape.redis_replicas}"
        )
    if not shape.replicated and read_shape(state_dir.resolve()) is None:
        return stack_up(state_dir, redis_maxmemory=redis_maxmemory)
    env, actions = cluster_up(state_dir, shape, redis_maxmemory=redis_maxmemory, timeout_s=DEFAULT_UP_TIMEOUT_S)
    return StackUp(env, actions)


def cmd_down_any(state_dir: Path, *, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """`batchwire stack down` for either shape (the recorded one)."""
    shape = read_shape(state_dir.resolve())
    if shape is None:
        return cmd_down(state_dir, out=out, err=err)
    try:
        stopped = cluster_down(state_dir, shape, timeout_s=DEFAULT_STOP_TIMEOUT_S)
    except InfraError as error:
        print(f"stack down failed: {error}", file=err)
        return 1
    print("stack stopped (data and ports kept for the next up)" if stopped else "no stack was running", file=out)
    return 0
