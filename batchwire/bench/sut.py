"""Starts and stops the system under test, so one command reproduces a figure.

Every child runs in its own process group (a terminal Ctrl-C reaches only the bench, which then
stops the children in order) with its output in a log file. ``stop()`` always runs, from a
``with`` block: SIGTERM, a grace period, then SIGKILL to the whole group.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal

import aiohttp

from batchwire.bench.own_stack import OwnStack, child_env
from infra.ports import free_port

Mode = Literal["embedded", "kafka", "echo", "echo-asgi"]
_POLL_S = 0.2
BATCH_LOG_VAR = "BATCHWIRE_BATCH_LOG"


class SutError(Exception):
    """The system under test could not be started or did not become ready."""


def batchwire_command() -> list[str]:
    """The ``batchwire`` script next to this interpreter, else ``python -m batchwire.cli``."""
    script = Path(sys.executable).with_name("batchwire")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "batchwire.cli"]


@dataclass(frozen=True, slots=True)
class SutSpec:
    mode: Mode
    policy: str
    workers: int = 1
    sim_latency_ms: float = 100.0
    max_batch: int | None = None
    max_wait_ms: float | None = None
    gateways: int = 1
    batchers: int = 1
    slow_worker_latency_ms: float | None = None
    host: str = "127.0.0.1"
    ready_timeout_s: float = 60.0
    stop_grace_s: float = 10.0
    stack_timeout_s: float = 300.0
    inference_path: str = "/v1/inference"
    command: tuple[str, ...] = ()
    own_stack: OwnStack | None = None
    """kafka mode: the stack this run starts for itself; None: the ``.batchwire`` stack."""
    models: tuple[str, ...] = ()
    """Models to serve, ``workers`` workers each (empty: the default model only)."""
    gateway_args: tuple[str, ...] = ()
    """More flags for the gateways (or the embedded service)."""
    result_ttl_s: float | None = None
    """Every role's ``--result-ttl-s`` (None: the roles' default)."""
    max_batch_tokens: int | None = None
    """The batchers' token budget and the gateways' limit (``--max-batch-tokens``); None: the default."""


@dataclass(slots=True)
class Role:
    """One child process: what it runs and how to tell that it is ready."""

    name: str
    kind: str
    argv: list[str]
    ready_url: str
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None
    returncode: int | None = None


@dataclass(slots=True)
class _Plan:
    roles: list[Role] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    metrics_urls: list[str] = field(default_factory=list)


def _policy_flags(spec: SutSpec) -> list[str]:
    flags = ["--policy", spec.policy]
    if spec.max_batch is not None:
        flags += ["--max-batch", str(spec.max_batch)]
    if spec.max_wait_ms is not None:
        flags += ["--max-wait-ms", f"{spec.max_wait_ms:g}"]
    return flags + _budget_flags(spec)


def _budget_flags(spec: SutSpec) -> list[str]:
    return [] if spec.max_batch_tokens is None else ["--max-batch-tokens", str(spec.max_batch_tokens)]


def plan(spec: SutSpec, command: Sequence[str], namespace: str, log_dir: Path) -> _Plan:
    """The processes to start, in start order, with their ports chosen."""
    out = _Plan()
    origin = f"http://{spec.host}"
    shared = ["--models", ",".join(spec.models)] if spec.models else []  # flags every role takes
    if spec.result_ttl_s is not None:
        shared += ["--result-ttl-s", f"{spec.result_ttl_s:g}"]
    if spec.mode in ("echo", "echo-asgi"):
        port = free_port(spec.host)
        argv = [sys.executable, "-m", "batchwire.bench.echo", "--host", spec.host, "--port", str(port)]
        argv += ["--asgi"] if spec.mode == "echo-asgi" else []
        out.roles.append(Role("echo", "echo", argv, f"{origin}:{port}/readyz", log_dir / "echo.log"))
        out.urls.append(f"{origin}:{port}{spec.inference_path}")
        return out
    if spec.mode == "embedded":
        port = free_port(spec.host)
        argv = [
            *command,
            "up",
            *shared,
            *spec.gateway_args,
            "--host",
            spec.host,
            "--port",
            str(port),
            "--workers",
            str(spec.workers),
            "--sim-latency-ms",
            f"{spec.sim_latency_ms:g}",
            *_policy_flags(spec),
        ]
        out.roles.append(Role("up", "embedded", argv, f"{origin}:{port}/readyz", log_dir / "up.log"))
        out.urls.append(f"{origin}:{port}{spec.inference_path}")
        out.metrics_urls.append(f"{origin}:{port}/metrics")
        return out
    ns = ["--namespace", namespace]
    for index in range(spec.workers * max(1, len(spec.models))):
        port = free_port(spec.host)
        latency = spec.sim_latency_ms
        if index == 0 and spec.slow_worker_latency_ms is not None:
            latency = spec.slow_worker_latency_ms
        model = ["--model", spec.models[index // spec.workers]] if spec.models else []
        argv = [*command, "worker", *shared, *model, "--sim-latency-ms", f"{latency:g}", "--metrics-port", str(port)]
        argv += ns
        if spec.max_batch is not None:  # the backend must take the batches the batcher makes
            argv[-2:-2] = ["--max-batch", str(spec.max_batch)]
        out.roles.append(
            Role(f"worker-{index}", "worker", argv, f"{origin}:{port}/metrics", log_dir / f"worker-{index}.log")
        )
        out.metrics_urls.append(f"{origin}:{port}/metrics")
    for index in range(spec.batchers):
        port = free_port(spec.host)
        argv = [*command, "batcher", *shared, *_policy_flags(spec), "--metrics-port", str(port), *ns]
        out.roles.append(
            Role(f"batcher-{index}", "batcher", argv, f"{origin}:{port}/metrics", log_dir / f"batcher-{index}.log")
        )
        out.metrics_urls.append(f"{origin}:{port}/metrics")
    for index in range(spec.gateways):
        port = free_port(spec.host)
        argv = [
            *command,
            "gateway",
            *shared,
            *_budget_flags(spec),
            *spec.gateway_args,
            "--host",
            spec.host,
            "--port",
            str(port),
            *ns,
        ]
        out.roles.append(
            Role(f"gateway-{index}", "gateway", argv, f"{origin}:{port}/readyz", log_dir / f"gateway-{index}.log")
        )
        out.urls.append(f"{origin}:{port}{spec.inference_path}")
        out.metrics_urls.append(f"{origin}:{port}/metrics")
    return out


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class SystemUnderTest:
    """The processes of one bench run; use as ``with SystemUnderTest(...) as sut:`` so they always stop."""

    def __init__(self, spec: SutSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_dir = log_dir
        self.command = list(spec.command) or batchwire_command()
        self.namespace = f"bench{secrets.token_hex(4)}"
        self._plan = plan(spec, self.command, self.namespace, log_dir)
        given = os.environ.get(BATCH_LOG_VAR)
        self._own_batch_log = not given
        self.batch_log: Path = Path(given) if given else _scratch_file()
        """The workers' batch journal: the one set in the environment, else a scratch file removed at stop."""

    @property
    def urls(self) -> list[str]:
        return list(self._plan.urls)

    @property
    def metrics_urls(self) -> list[str]:
        return list(self._plan.metrics_urls)

    def pid_groups(self) -> dict[str, list[int]]:
        """Root pids of all batchwire processes together, and of each role kind."""
        groups: dict[str, list[int]] = {"batchwire": []}
        for role in self._plan.roles:
            if role.process is not None:
                groups["batchwire"].append(role.process.pid)
                if self.spec.mode == "kafka":
                    groups.setdefault(f"batchwire.{role.kind}", []).append(role.process.pid)
        return groups

    def describe(self) -> dict[str, Any]:
        return {
            "mode": self.spec.mode,
            "policy": self.spec.policy,
            "namespace": self.namespace if self.spec.mode == "kafka" else None,
            "own_stack": self.spec.own_stack.describe() if self.spec.own_stack is not None else None,
            "workers": self.spec.workers,
            "gateways": self.spec.gateways if self.spec.mode == "kafka" else None,
            "batchers": self.spec.batchers if self.spec.mode == "kafka" else None,
            "sim_latency_ms": self.spec.sim_latency_ms,
            "slow_worker_latency_ms": self.spec.slow_worker_latency_ms,
            "max_batch": self.spec.max_batch,
            "max_wait_ms": self.spec.max_wait_ms,
            "commands": [" ".join(role.argv) for role in self._plan.roles],
            "logs": str(self.log_dir),
            "returncodes": {role.name: role.returncode for role in self._plan.roles},
        }

    def __enter__(self) -> SystemUnderTest:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        """Starts Kafka and Redis (kafka mode) and then every role; returns without waiting for readiness."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.spec.mode == "kafka":
            self._stack_up()
            # The ports again, now that the stack's servers listen: one drawn before could be a Sentinel's.
            self._plan = plan(self.spec, self.command, self.namespace, self.log_dir)
        env = {**child_env(os.environ, self.spec.own_stack), BATCH_LOG_VAR: str(self.batch_log)}
        for role in self._plan.roles:
            role.log = role.log_path.open("wb")
            try:
                role.process = subprocess.Popen(
                    role.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=role.log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            except OSError as err:
                raise SutError(f"cannot start {role.name} ({' '.join(role.argv)}): {err}") from err

    def _stack_up(self) -> None:
        log_path = self.log_dir / "stack-up.log"
        # Also creates this run's topics with the configured partition counts (a no-op start when up).
        own = self.spec.own_stack
        argv = [*self.command, "stack", "up", "--namespace", self.namespace, *(own.flags() if own else [])]
        with log_path.open("wb") as log:
            try:
                done = subprocess.run(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=self.spec.stack_timeout_s,
                    check=False,
                    env=child_env(os.environ, own),
                )
            except subprocess.TimeoutExpired as err:
                raise SutError(f"'{' '.join(argv)}' took over {self.spec.stack_timeout_s:g} s; see {log_path}") from err
        if done.returncode != 0:
            raise SutError(f"'{' '.join(argv)}' exited with {done.returncode}:\n{_tail(log_path)}")

    async def wait_ready(self) -> None:
        """Polls every role's readiness URL until all answer 200, or raises at the deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.spec.ready_timeout_s
        waiting = list(self._plan.roles)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
            while waiting:
                for role in list(waiting):
                    self._raise_if_exited(role)
                    if await _answers_200(session, role.ready_url):
                        waiting.remove(role)
                if not waiting:
                    return
                if loop.time() > deadline:
                    names = ", ".join(f"{role.name} ({role.ready_url})" for role in waiting)
                    raise SutError(
                        f"not ready after {self.spec.ready_timeout_s:g} s: {names}; "
                        f"raise --ready-timeout or see the logs in {self.log_dir}"
                    )
                await asyncio.sleep(_POLL_S)

    def _raise_if_exited(self, role: Role) -> None:
        if role.process is None:
            raise SutError(f"{role.name} was never started")
        code = role.process.poll()
        if code is not None:
            role.returncode = code
            raise SutError(f"{role.name} exited with {code} before it was ready:\n{_tail(role.log_path)}")

    def stop(self) -> None:
        """SIGTERM to every live role, up to ``stop_grace_s`` for all to exit, then SIGKILL to the rest."""
        live = [role for role in self._plan.roles if role.process is not None and role.process.poll() is None]
        try:
            for role in reversed(live):  # gateways first: stop taking work before the workers go
                assert role.process is not None
                with contextlib.suppress(ProcessLookupError):
                    role.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.spec.stop_grace_s
            for role in live:
                assert role.process is not None
                with contextlib.suppress(subprocess.TimeoutExpired):
                    role.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        finally:  # also on a second Ctrl-C while waiting: nothing is left behind
            for role in self._plan.roles:
                self._kill(role)
            if self._own_batch_log:
                self.batch_log.unlink(missing_ok=True)

    @staticmethod
    def _kill(role: Role) -> None:
        process = role.process
        if process is not None:
            # The whole group, also when its leader already exited: a child it left behind must not
            # keep a port or a GPU busy for the next run. (A reaped leader's group id cannot be
            # reused while any member remains, so this reaches only what this run started.)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5.0)
            role.returncode = process.returncode
        if role.log is not None:
            role.log.close()
            role.log = None


async def _answers_200(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url) as response:
            await response.read()
            return response.status == 200
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


async def wait_first_answer(urls: Sequence[str], body: bytes, timeout_s: float) -> None:
    """Sends one request to each URL until it is answered 200: ready endpoints are not yet a working path
    (a Kafka consumer group may still be joining), and a run that starts before would measure that."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    headers = {"Content-Type": "application/json"}
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=max(timeout_s, 1.0))) as session:
        for url in urls:
            while True:
                try:
                    async with session.post(url, data=body, headers=headers) as response:
                        await response.read()
                        if response.status == 200:
                            break
                        last = f"HTTP {response.status}"
                except (aiohttp.ClientError, OSError, TimeoutError) as err:
                    last = f"{type(err).__name__}: {err}"
                if loop.time() > deadline:
                    raise SutError(f"{url} gave no good answer within {timeout_s:g} s (last: {last})")
                await asyncio.sleep(_POLL_S)


def _scratch_file() -> Path:
    """A new empty file of the system's temporary directory (the journal grows by a line per batch)."""
    fd, name = tempfile.mkstemp(prefix="batchwire-bench-", suffix=".batches.jsonl")
    os.close(fd)
    return Path(name)
