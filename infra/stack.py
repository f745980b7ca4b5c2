"""Kafka + Redis for development and tests: `LocalStack` (in-process) and the detached stack.

`batchwire stack up|down|status` call `cmd_up`/`cmd_down`/`cmd_status` (or the functions under
them).

`up` starts both in their own sessions (they outlive the command), writes
`<state_dir>/stack.env` (source it, or let services read `BATCHWIRE_*`) and one pid file per
service. `down` stops them by pid after checking each pid still names our process.
Argument parsing belongs to the project CLI; these are plain functions.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from infra.aio import run_blocking
from infra.errors import InfraError
from infra.kafka_probe import kafka_serves
from infra.kafka_server import DEFAULT_STOP_TIMEOUT_S
from infra.local_stack import LocalStack
from infra.locks import file_lock
from infra.ports import LOOPBACK
from infra.process import ServiceProcess
from infra.redis_server import redis_pings

__all__ = [
    "DEFAULT_STATE_DIR",
    "ENV_FILE_NAME",
    "KAFKA_ENV",
    "REDIS_ENV",
    "LocalStack",
    "StackStatus",
    "cmd_down",
    "cmd_status",
    "cmd_up",
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


@dataclass(frozen=True)
class StackStatus:
    """What `status` found: addresses from stack.env, live verified pids, and probe results."""

    state_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    kafka_pid: int | None = None
    redis_pid: int | None = None
    kafka_serves: bool = False
    redis_serves: bool = False

    @property
    def healthy(self) -> bool:
        return self.kafka_serves and self.redis_serves and None not in (self.kafka_pid, self.redis_pid)

    @property
    def anything_running(self) -> bool:
        return self.kafka_pid is not None or self.redis_pid is not None


def stack_up(state_dir: Path = DEFAULT_STATE_DIR, *, timeout_s: float = DEFAULT_UP_TIMEOUT_S) -> dict[str, str]:
    """Ensure a healthy detached stack under `state_dir`; return its `BATCHWIRE_*` variables.

    Already up and healthy: nothing is started. A half-dead stack is stopped and replaced by
    a fresh one (new ports, empty data).
    """
    state_dir = state_dir.resolve()
    with file_lock(state_dir / ".stack.lock"):
        status = stack_status(state_dir)
        if status.healthy:
            return status.env
        _stop_services(state_dir)
        for leftover in ("kafka", "redis"):
            shutil.rmtree(state_dir / leftover, ignore_errors=True)
        stack = LocalStack(state_dir, detached=True)
        stack.start(timeout_s)
        try:
            env = {KAFKA_ENV: stack.kafka_bootstrap, REDIS_ENV: stack.redis_url}
            _write_pid(state_dir / "kafka.pid", stack.kafka.pid)
            _write_pid(state_dir / "redis.pid", stack.redis.pid)
            _write_atomically(state_dir / ENV_FILE_NAME, "".join(f"{key}={value}\n" for key, value in env.items()))
        except BaseException:
            stack.stop()
            raise
        return env


def stack_down(state_dir: Path = DEFAULT_STATE_DIR, *, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> bool:
    """Stop the detached stack and remove stack.env; True if something was running."""
    state_dir = state_dir.resolve()
    with file_lock(state_dir / ".stack.lock"):
        stopped = _stop_services(state_dir, timeout_s)
        (state_dir / ENV_FILE_NAME).unlink(missing_ok=True)
        return stopped


def stack_status(state_dir: Path = DEFAULT_STATE_DIR) -> StackStatus:
    """Read stack.env and the pid files, check the processes and ask each service."""
    state_dir = state_dir.resolve()
    env = read_env_file(state_dir / ENV_FILE_NAME)
    kafka = _attach_kafka(state_dir)
    redis = _attach_redis(state_dir, env)
    bootstrap = env.get(KAFKA_ENV)
    redis_port = _redis_port(env)
    kafka_ok = kafka is not None and bootstrap is not None and _kafka_answers(bootstrap)
    redis_ok = redis is not None and redis_port is not None and redis_pings(redis_port)
    return StackStatus(
        state_dir=state_dir,
        env=env,
        kafka_pid=kafka.pid if kafka is not None else None,
        redis_pid=redis.pid if redis is not None else None,
        kafka_serves=kafka_ok,
        redis_serves=redis_ok,
    )


def read_env_file(path: Path) -> dict[str, str]:
    """`KEY=value` lines of stack.env (empty dict if absent)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def cmd_up(state_dir: Path = DEFAULT_STATE_DIR, *, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """`batchwire stack up`: print the two `BATCHWIRE_*=...` lines; exit status."""
    try:
        env = stack_up(state_dir)
    except InfraError as error:
        print(f"stack up failed: {error}", file=err)
        return 1
    for key, value in env.items():
        print(f"{key}={value}", file=out)
    print(f"# written to {state_dir.resolve() / ENV_FILE_NAME}; stop with: batchwire stack down", file=err)
    return 0


def cmd_down(state_dir: Path = DEFAULT_STATE_DIR, *, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """`batchwire stack down`: stop both services; exit status."""
    try:
        stopped = stack_down(state_dir)
    except InfraError as error:
        print(f"stack down failed: {error}", file=err)
        return 1
    print("stack stopped" if stopped else "no stack was running", file=out)
    return 0


def cmd_status(state_dir: Path = DEFAULT_STATE_DIR, *, out: TextIO = sys.stdout) -> int:
    """`batchwire stack status`: addresses and health; 0 when both serve, 1 otherwise."""
    status = stack_status(state_dir)
    for key, value in status.env.items():
        print(f"{key}={value}", file=out)
    print(f"# kafka: {_describe(status.kafka_pid, status.kafka_serves)}", file=out)
    print(f"# redis: {_describe(status.redis_pid, status.redis_serves)}", file=out)
    return 0 if status.healthy else 1


def _describe(pid: int | None, serves: bool) -> str:
    if pid is None:
        return "not running"
    return f"pid {pid}, {'serving' if serves else 'NOT serving'}"


def _stop_services(state_dir: Path, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> bool:
    env = read_env_file(state_dir / ENV_FILE_NAME)
    stopped = False
    for process in (_attach_kafka(state_dir), _attach_redis(state_dir, env)):
        if process is not None:
            process.terminate(timeout_s)
            stopped = True
    for name in ("kafka.pid", "redis.pid"):
        (state_dir / name).unlink(missing_ok=True)
    return stopped


def _attach_kafka(state_dir: Path) -> ServiceProcess | None:
    pid = _read_pid(state_dir / "kafka.pid")
    if pid is None:
        return None
    # The config path is unique to this state dir: a recycled pid will not contain it.
    return ServiceProcess.attach(pid, ["kafka.Kafka", str(state_dir / "kafka" / "server.properties")])


def _attach_redis(state_dir: Path, env: dict[str, str]) -> ServiceProcess | None:
    pid = _read_pid(state_dir / "redis.pid")
    port = _redis_port(env)
    if pid is None or port is None:
        return None
    # redis-server rewrites its title to "redis-server 127.0.0.1:PORT".
    return ServiceProcess.attach(pid, ["redis-server", f"{LOOPBACK}:{port}"])


def _redis_port(env: dict[str, str]) -> int | None:
    url = env.get(REDIS_ENV, "")
    prefix = f"redis://{LOOPBACK}:"
    if not url.startswith(prefix):
        return None
    port = url.removeprefix(prefix).split("/", 1)[0]
    return int(port) if port.isdigit() else None


def _kafka_answers(bootstrap: str) -> bool:
    return run_blocking(lambda: kafka_serves(bootstrap))


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def _write_pid(path: Path, pid: int | None) -> None:
    if pid is None:
        raise InfraError(f"no pid to write to {path}: the service is not running")
    _write_atomically(path, f"{pid}\n")


def _write_atomically(path: Path, text: str) -> None:
    # Readers (`source stack.env`, another `status`) never see half a file.
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(text)
    partial.replace(path)
