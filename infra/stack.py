"""Kafka + Redis for development: the detached stack behind `batchwire stack up|down|status`.

`up` makes the stack whole and touches nothing that works: a server that runs is left alone, a
dead one is started again on the ports it had, over its data (Kafka's log dir, Redis's append-only
file), so roles that hold the stack's addresses reconnect. Each server's ports are recorded in its
own config file (`kafka/server.properties`, `redis/redis.conf`), next to its data; `stack.env`
(source it, or let the roles read it) is written from them. A pid file per server names its
process, which is signalled only after checking it is still ours (command line and working
folder). `down` stops both and keeps data and ports for the next `up`. Argument parsing belongs to
the project CLI; these are plain functions.
"""

from __future__ import annotations

import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
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
from infra.errors import InfraError
from infra.fetch_kafka import prepare_kafka
from infra.kafka_dist import KafkaRuntime
from infra.kafka_probe import kafka_serves, wait_for_kafka
from infra.kafka_server import DEFAULT_STOP_TIMEOUT_S, KafkaServer, read_config_ports
from infra.locks import file_lock
from infra.loopback import write_atomically
from infra.ports import LOOPBACK
from infra.process import ServiceProcess
from infra.redis_server import CONFIG_NAME, RedisServer, checked_maxmemory, read_config_port, redis_pings

__all__ = [
    "DEFAULT_REDIS_MAXMEMORY",
    "DEFAULT_STATE_DIR",
    "ENV_FILE_NAME",
    "KAFKA_ENV",
    "REDIS_ENV",
    "ServerStatus",
    "StackStatus",
    "StackUp",
    "cmd_down",
    "cmd_status",
    "cmd_up",
    "not_running",
    "print_up",
    "read_env_file",
    "stack_down",
    "stack_status",
    "stack_up",
]

DEFAULT_STATE_DIR = Path(".batchwire")
ENV_FILE_NAME = "stack.env"
KAFKA_ENV = "BATCHWIRE_KAFKA_BOOTSTRAP"
REDIS_ENV = "BATCHWIRE_REDIS_URL"
DEFAULT_UP_TIMEOUT_S = 120.0
DEFAULT_REDIS_MAXMEMORY = "512mb"
"""A dev box's bound; over it Redis refuses writes (see `infra.redis_server.MAXMEMORY_POLICY`)."""


def _servers(state_dir: Path) -> tuple[DetachedServer, DetachedServer]:
    kafka_dir, redis_dir = state_dir / "kafka", state_dir / "redis"
    properties = kafka_dir / "server.properties"
    kafka_marks = ("kafka.Kafka", str(properties))
    # redis-server rewrites its command line ("redis-server 127.0.0.1:PORT"): its folder says whose it is.
    redis_marks = ("redis-server",)
    commands = StackCommands(state_dir_flag(state_dir))
    return (
        DetachedServer("kafka", kafka_dir, properties, state_dir / "kafka.pid", kafka_marks, _kafka_ports, commands),
        DetachedServer(
            "redis", redis_dir, redis_dir / CONFIG_NAME, state_dir / "redis.pid", redis_marks, _redis_ports, commands
        ),
    )


def _kafka_ports(config_path: Path) -> tuple[int, ...]:
    return read_config_ports(config_path) or ()


def _redis_ports(config_path: Path) -> tuple[int, ...]:
    port = read_config_port(config_path)
    if port is None:
        # A stack made before Redis had a redis.conf: its port is in stack.env only.
        url = read_env_file(config_path.parent.parent / ENV_FILE_NAME).get(REDIS_ENV, "")
        prefix = f"redis://{LOOPBACK}:"
        text = url.removeprefix(prefix).split("/", 1)[0] if url.startswith(prefix) else ""
        port = int(text) if text.isdigit() else None
    return () if port is None else (port,)


@dataclass(frozen=True)
class ServerStatus:
    """One server as `status` found it: recorded ports, its live verified pid, whether it answers, and the
    commands that act on its stack (the advice names them)."""

    name: str
    commands: StackCommands
    ports: tuple[int, ...] = ()
    pid: int | None = None
    serving: bool = False

    @property
    def alive(self) -> bool:
        return self.pid is not None

    def describe(self) -> str:
        if self.pid is not None:
            port = f"port {self.ports[0]}" if self.ports else "no port recorded"
            return f"alive, {'serving' if self.serving else 'NOT serving'} (pid {self.pid}, {port})"
        return not_running(self.ports[0] if self.ports else None, self.commands)


def not_running(port: int | None, commands: StackCommands) -> str:
    """`status`'s line on a server not running, single or replicated: one with no port recorded never ran, so
    has no data to come back with."""
    if port is None:
        return f"none yet (`{commands.up}` starts one)"
    return f"dead (port {port}; `{commands.up}` starts it again with its data)"


@dataclass(frozen=True)
class StackStatus:
    """Both servers, and the `BATCHWIRE_*` addresses their recorded ports make."""

    state_dir: Path
    kafka: ServerStatus
    redis: ServerStatus

    @property
    def env(self) -> dict[str, str]:
        return _env(self.kafka.ports, self.redis.ports)

    @property
    def healthy(self) -> bool:
        return self.kafka.serving and self.redis.serving

    @property
    def anything_running(self) -> bool:
        return self.kafka.alive or self.redis.alive


@dataclass(frozen=True)
class StackUp:
    """What `up` gave: the addresses (stack.env's lines) and one line per server on what it did."""

    env: dict[str, str]
    actions: tuple[str, ...] = field(default=())


def stack_up(
    state_dir: Path = DEFAULT_STATE_DIR,
    *,
    redis_maxmemory: str = DEFAULT_REDIS_MAXMEMORY,
    timeout_s: float = DEFAULT_UP_TIMEOUT_S,
) -> StackUp:
    """Make the detached stack under `state_dir` whole; return its `BATCHWIRE_*` variables.

    A live server is left alone (waited for if it does not answer yet). A dead one starts again on
    its recorded ports over its data. Before anything starts, every port a dead server needs is
    checked, and so are Java and the Kafka jars: a port another process holds, or a missing tool, is an
    error that changes nothing. Two `up`s at once
    take turns (a lock file), so the second finds the stack the first made.
    `redis_maxmemory` applies when Redis starts; a running Redis keeps its bound.
    """
    try:
        maxmemory = checked_maxmemory(redis_maxmemory)
    except ValueError as err:
        raise InfraError(f"--redis-maxmemory (BATCHWIRE_REDIS_MAXMEMORY): {err}") from err
    state_dir = state_dir.resolve()
    deadline = time.monotonic() + timeout_s
    with file_lock(state_dir / ".stack.lock"):
        kafka, redis = _servers(state_dir)
        running = {server.name: server.process() for server in (kafka, redis)}
        for server in (kafka, redis):
            if running[server.name] is None:
                refuse_taken_ports(server)
        # Java and the jars are looked for before Redis starts: a missing one leaves nothing running.
        runtime = prepare_kafka() if running["kafka"] is None else None
        actions = [
            _up_redis(redis, running["redis"], maxmemory, deadline),
            _up_kafka(kafka, running["kafka"], runtime, deadline),
        ]
        env = _env(kafka.ports(), redis.ports())
        write_atomically(state_dir / ENV_FILE_NAME, "".join(f"{key}={value}\n" for key, value in env.items()))
        return StackUp(env, tuple(actions))


def stack_down(state_dir: Path = DEFAULT_STATE_DIR, *, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> bool:
    """Stop both servers and remove stack.env; True if something was running.

    Data and ports stay: the next `up` brings the same stack back. Delete the state dir for a new one.
    """
    state_dir = state_dir.resolve()
    if not state_dir.is_dir():
        return False  # a mistyped --state-dir: nothing to stop, and no folder made for it
    with file_lock(state_dir / ".stack.lock"):
        stopped = False
        for server in _servers(state_dir):
            process = server.process()
            if process is not None:
                process.terminate(timeout_s)
                stopped = True
            server.pid_path.unlink(missing_ok=True)
        (state_dir / ENV_FILE_NAME).unlink(missing_ok=True)
        return stopped


def stack_status(state_dir: Path = DEFAULT_STATE_DIR) -> StackStatus:
    """Each server's recorded ports, its live verified process, and whether it answers."""
    state_dir = state_dir.resolve()
    kafka, redis = _servers(state_dir)
    kafka_ports, redis_ports = kafka.ports(), redis.ports()
    kafka_process, redis_process = kafka.process(), redis.process()
    kafka_serves_now = kafka_process is not None and bool(kafka_ports) and _kafka_answers(_bootstrap(kafka_ports))
    redis_serves_now = redis_process is not None and bool(redis_ports) and redis_pings(redis_ports[0])
    return StackStatus(
        state_dir=state_dir,
        kafka=ServerStatus("kafka", kafka.commands, kafka_ports, _pid(kafka_process), kafka_serves_now),
        redis=ServerStatus("redis", redis.commands, redis_ports, _pid(redis_process), redis_serves_now),
    )


def read_env_file(path: Path) -> dict[str, str]:
    """`KEY=value` lines of stack.env (empty dict if absent)."""
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return {}
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def state_dir_flag(state_dir: Path) -> str:
    """`` --state-dir DIR`` for a stack outside the default folder, for the commands a message gives: a
    command without it acts on the default stack."""
    if state_dir.resolve() == DEFAULT_STATE_DIR.resolve():
        return ""
    return f" --state-dir {shlex.quote(str(state_dir))}"


def print_up(up: StackUp, state_dir: Path, *, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
    """The `BATCHWIRE_*=...` lines on `out` (the same for the same stack), what was done on `err`."""
    for key, value in up.env.items():
        print(f"{key}={value}", file=out)
    for action in up.actions:
        print(f"# {action}", file=err)
    # Another state dir needs naming: `stack down` alone looks in the default one and stops nothing, and
    # roles read the default one's stack.env unless BATCHWIRE_STACK_ENV names this one.
    where = state_dir_flag(state_dir)
    if where:
        env_file = shlex.quote(str(state_dir.resolve() / ENV_FILE_NAME))
        default_file = DEFAULT_STATE_DIR / ENV_FILE_NAME
        print(f"# roles read it with BATCHWIRE_STACK_ENV={env_file} (else {default_file})", file=err)
    print(f"# written to {state_dir.resolve() / ENV_FILE_NAME}; stop with: batchwire stack down{where}", file=err)


def cmd_up(
    state_dir: Path = DEFAULT_STATE_DIR,
    *,
    redis_maxmemory: str = DEFAULT_REDIS_MAXMEMORY,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> int:
    """`batchwire stack up` without topics: print the two `BATCHWIRE_*=...` lines; exit status."""
    try:
        up = stack_up(state_dir, redis_maxmemory=redis_maxmemory)
    except InfraError as error:
        print(f"stack up failed: {error}", file=err)
        return 1
    print_up(up, state_dir, out=out, err=err)
    return 0


def cmd_down(state_dir: Path = DEFAULT_STATE_DIR, *, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """`batchwire stack down`: stop both services; exit status."""
    try:
        stopped = stack_down(state_dir)
    except InfraError as error:
        print(f"stack down failed: {error}", file=err)
        return 1
    print("stack stopped (data and ports kept for the next up)" if stopped else "no stack was running", file=out)
    return 0


def cmd_status(state_dir: Path = DEFAULT_STATE_DIR, *, out: TextIO = sys.stdout) -> int:
    """`batchwire stack status`: addresses and each server's state; 0 when both serve, 1 otherwise."""
    status = stack_status(state_dir)
    for key, value in status.env.items():
        print(f"{key}={value}", file=out)
    print(f"# kafka: {status.kafka.describe()}", file=out)
    print(f"# redis: {status.redis.describe()}", file=out)
    return 0 if status.healthy else 1


def _up_redis(server: DetachedServer, process: ServiceProcess | None, maxmemory: str, deadline: float) -> str:
    ports = server.ports()
    if process is not None:
        if not ports:
            raise unrecorded(server, process)
        if not poll_until(lambda: redis_pings(ports[0]), deadline, process):
            raise not_answering(server, process, ports[0])
        write_pid(server.pid_path, process.pid)  # found by its folder when the pid file was stale
        return f"redis: alive (pid {process.pid}, port {ports[0]}), left alone"
    redis = RedisServer(
        server.work_dir,
        port=ports[0] if ports else None,
        detached=True,
        maxmemory=maxmemory,
        persistent=True,
    )
    redis.start(max(deadline - time.monotonic(), 1.0))
    write_pid(server.pid_path, redis.pid)
    kept = "restarted over its data" if ports else "started empty"
    return f"redis: was not running; {kept} (pid {redis.pid}, port {redis.port}, maxmemory {maxmemory})"


def _up_kafka(
    server: DetachedServer, process: ServiceProcess | None, runtime: KafkaRuntime | None, deadline: float
) -> str:
    ports = server.ports()
    if process is not None:
        if not ports:
            raise unrecorded(server, process)
        bootstrap = _bootstrap(ports)
        remaining_s = max(deadline - time.monotonic(), 0.0)
        if not wait_for_kafka(bootstrap, timeout_s=remaining_s, still_running=process.is_alive):
            raise not_answering(server, process, ports[0])
        write_pid(server.pid_path, process.pid)
        return f"kafka: alive (pid {process.pid}, port {ports[0]}), left alone"
    if not ports:
        # Data formatted for controller ports nobody recorded cannot be served: start empty.
        shutil.rmtree(server.work_dir / "data", ignore_errors=True)
    kafka = KafkaServer(
        runtime if runtime is not None else prepare_kafka(),
        server.work_dir,
        broker_port=ports[0] if ports else None,
        controller_port=ports[1] if ports else None,
        detached=True,
    )
    kafka.start(max(deadline - time.monotonic(), 1.0))
    write_pid(server.pid_path, kafka.pid)
    kept = "restarted over its data" if ports else "started empty"
    return f"kafka: was not running; {kept} (pid {kafka.pid}, port {kafka.broker_port})"


def _env(kafka_ports: tuple[int, ...], redis_ports: tuple[int, ...]) -> dict[str, str]:
    env: dict[str, str] = {}
    if kafka_ports:
        env[KAFKA_ENV] = _bootstrap(kafka_ports)
    if redis_ports:
        env[REDIS_ENV] = f"redis://{LOOPBACK}:{redis_ports[0]}/0"
    return env


def _bootstrap(kafka_ports: tuple[int, ...]) -> str:
    return f"{LOOPBACK}:{kafka_ports[0]}"


def _pid(process: ServiceProcess | None) -> int | None:
    return None if process is None else process.pid


def _kafka_answers(bootstrap: str) -> bool:
    return run_blocking(lambda: kafka_serves(bootstrap))
