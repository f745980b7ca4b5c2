"""Real processes for end-to-end tests: gateways, batchers and workers started with the CLI.

Each process logs to a file under the test's tmp dir; a test that fails shows their tails.
Workers write a batch journal (``--batch-log``) that the tests read to check invariants.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from infra.local_stack import LocalStack
from infra.ports import free_port
from tests.support.eventually import eventually_sync


@dataclass
class Proc:
    name: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "batchwire.cli", *self.args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill9(self) -> None:
        assert self.popen is not None
        os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.popen is None or self.popen.poll() is not None:
            return self.popen.returncode if self.popen else None
        self.popen.send_signal(signal.SIGTERM)
        return self.stopped(timeout_s)

    def stopped(self, timeout_s: float = 20.0) -> int | None:
        """Waits for a signalled process to exit; kills it (-9) if it takes longer than ``timeout_s``."""
        assert self.popen is not None
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
            return None

    def tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Cluster:
    """A multi-process batchwire deployment over the session's Kafka and Redis."""

    base: Path
    kafka_bootstrap: str
    redis_url: str
    namespace: str
    sim_latency_ms: float = 100.0
    extra_env: dict[str, str] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    gateway_urls: list[str] = field(default_factory=list)

    @property
    def batch_log(self) -> Path:
        return self.base / "batches.jsonl"

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWIRE_")}
        env.update(
            BATCHWIRE_KAFKA_BOOTSTRAP=self.kafka_bootstrap,
            BATCHWIRE_REDIS_URL=self.redis_url,
            BATCHWIRE_NAMESPACE=self.namespace,
            BATCHWIRE_STACK_ENV=str(self.base / "no-stack.env"),
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)
        return env

    def _start(self, name: str, *args: str) -> Proc:
        return Proc(name, list(args), self._env(), self.base / f"{name}.log").start()

    def spawn(self, name: str, *args: str) -> Proc:
        proc = self._start(name, *args)
        self.procs.append(proc)
        return proc

    def gateway(self, index: int | None = None, *extra: str) -> Proc:
        index = len(self.gateway_urls) if index is None else index
        name = f"gateway{index}"

        def start(port: int) -> Proc:
            return self._start(name, "gateway", "--port", str(port), "--gateway-id", f"gw{index}", *extra)

        proc, url = serving(start, f"gateway {index}")
        self.procs.append(proc)
        self.gateway_urls.append(url)
        return proc

    def batcher(self, index: int, *extra: str) -> Proc:
        return self.spawn(f"batcher{index}", "batcher", "--batcher-id", f"batcher{index}", *extra)

    def worker(self, index: int, *extra: str) -> Proc:
        return self.spawn(
            f"worker{index}",
            "worker",
            "--worker-id",
            f"worker{index}",
            "--batch-log",
            str(self.batch_log),
            "--sim-latency-ms",
            str(self.sim_latency_ms),
            *extra,
        )

    def journal(self) -> list[dict[str, Any]]:
        if not self.batch_log.exists():
            return []
        return [json.loads(line) for line in self.batch_log.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        """SIGTERM to every process at once, then waits for each: each one drains on its own, so a worker
        finishing a long batch does not hold up the others' exits."""
        running = [proc for proc in reversed(self.procs) if proc.alive()]
        for proc in running:
            assert proc.popen is not None
            proc.popen.send_signal(signal.SIGTERM)
        for proc in running:
            proc.stopped()

    def logs(self) -> str:
        return "\n".join(
            f"--- {proc.name} (pid {proc.popen.pid if proc.popen else '-'})\n{proc.tail()}" for proc in self.procs
        )


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _ready_or_exited(proc: Proc, url: str) -> bool:
    return not proc.alive() or _ready(url)


PORT_TAKEN = "address already in use"
START_TRIES = 3


def serving(start: Callable[[int], Proc], what: str, timeout_s: float = 60.0) -> tuple[Proc, str]:
    """Starts a listening process on a free port and waits until it is ready; returns it and its URL.

    A port is drawn free but bound by the child a moment later, so another test's process can take it
    in between: a child that exits saying so is started again on another port. A child that exits for
    any other reason fails the test at once, with its log's tail.
    """
    for _ in range(START_TRIES):
        port = free_port()
        proc = start(port)
        url = f"http://127.0.0.1:{port}"
        try:
            eventually_sync(functools.partial(_ready_or_exited, proc, url), f"{what} to be ready", timeout_s=timeout_s)
        except AssertionError as err:
            proc.stop()
            raise AssertionError(f"{err}:\n{proc.tail(10)}") from None
        if proc.alive():
            return proc, url
        if PORT_TAKEN not in proc.tail(10):
            raise AssertionError(f"{what} exited with {proc.stop()} before it was ready:\n{proc.tail(10)}")
    raise AssertionError(f"{what} found its port taken {START_TRIES} times:\n{proc.tail(10)}")


def embedded(base: Path, workers: int = 2, sim_latency_ms: float = 100.0, *extra: str) -> tuple[Proc, str]:
    """``batchwire up`` as a subprocess; returns it and its URL once ready."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWIRE_")}
    env["PYTHONUNBUFFERED"] = "1"
    flags = [
        "--workers",
        str(workers),
        "--sim-latency-ms",
        str(sim_latency_ms),
        "--batch-log",
        str(base / "batches.jsonl"),
    ]

    def start(port: int) -> Proc:
        return Proc("embedded", ["up", "--port", str(port), *flags, *extra], env, base / "embedded.log").start()

    return serving(start, "embedded service")


# fault tests --------------------------------------------------------------------------------------
def redis_client(redis_url: str) -> Any:
    """A synchronous client of the Redis that ``redis_url`` names; for a ``redis+sentinel://`` URL, of
    the primary the Sentinels name when each connection opens; for a ``redis+cluster://`` URL, of the
    cluster."""
    import redis
    from redis.sentinel import Sentinel

    from transport.redis.pools import is_cluster_url, sync_client
    from transport.redis.sentinel import is_sentinel_url, parse_sentinel_url

    if is_cluster_url(redis_url):
        return sync_client(redis_url, timeout_s=5.0)
    if not is_sentinel_url(redis_url):
        return redis.Redis.from_url(redis_url)
    parsed = parse_sentinel_url(redis_url)
    sentinels = Sentinel(list(parsed.sentinels), socket_timeout=2.0)
    return sentinels.master_for(parsed.master, db=parsed.db, socket_timeout=5.0)


def launch(
    base: Path,
    kafka_bootstrap: str,
    redis_url: str,
    *,
    gateways: int = 1,
    batchers: int = 1,
    workers: int = 2,
    sim_latency_ms: float = 100.0,
    batcher_args: tuple[str, ...] = (),
    worker_args: tuple[str, ...] = (),
    gateway_args: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
) -> Cluster:
    """A cluster in a fresh namespace, with extra flags per role; returns once every worker offers a credit."""
    import uuid

    from schemas.wire import Names

    namespace = f"f{uuid.uuid4().hex[:8]}"
    cluster = Cluster(base, kafka_bootstrap, redis_url, namespace, sim_latency_ms, dict(extra_env or {}))
    try:
        for index in range(batchers):
            cluster.batcher(index, *batcher_args)
        for index in range(workers):
            cluster.worker(index, *worker_args)
        for index in range(gateways):
            cluster.gateway(index, *gateway_args)
        client = redis_client(redis_url)
        credits = Names(namespace).credit_queue("sim")
        eventually_sync(
            lambda: client.zcard(credits) >= workers, f"{workers} idle workers to offer credits", timeout_s=60
        )
        client.close()
    except BaseException:
        print(cluster.logs())
        cluster.stop()
        raise
    return cluster


@contextmanager
def stopped_after(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[Cluster]:
    """Yields ``cluster`` to a fixture and stops it after, printing its logs if a test failed."""
    try:
        yield cluster
    finally:
        failed = request.session.testsfailed
        cluster.stop()
        if failed:
            print(cluster.logs())


def respawn(cluster: Cluster, proc: Proc) -> Proc:
    """Starts ``proc``'s command line again (as a supervisor restarts a process); it joins the cluster."""
    fresh = Proc(proc.name, list(proc.args), dict(proc.env), proc.log_path).start()
    cluster.procs.append(fresh)
    return fresh


class Restarter:
    """Restarts processes that exit on their own, like compose's ``restart: unless-stopped``.

    ``exits`` records (name, exit status, monotonic time) of every exit it saw. ``release`` a
    process before stopping it on purpose.
    """

    def __init__(self, cluster: Cluster, procs: list[Proc], delay_s: float = 0.2) -> None:
        import threading

        self.cluster = cluster
        self.delay_s = delay_s
        self.current: dict[str, Proc] = {proc.name: proc for proc in procs}
        self.exits: list[tuple[str, int, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="restarter", daemon=True)

    def __enter__(self) -> Restarter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def release(self, name: str) -> Proc:
        with self._lock:
            return self.current.pop(name)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            with self._lock:
                for name, proc in list(self.current.items()):
                    assert proc.popen is not None
                    code = proc.popen.poll()
                    if code is None:
                        continue
                    self.exits.append((name, code, time.monotonic()))
                    time.sleep(self.delay_s)
                    self.current[name] = respawn(self.cluster, proc)


class TerminalEvents:
    """Every terminal state published in the namespace, counted per task (PSUBSCRIBE): on the task
    channels, and in the gateways' reply frames, where alone the end of a synchronous task that no
    one stored is published (``TaskStore.apply``)."""

    def __init__(self, redis_url: str, namespace: str) -> None:
        import threading
        from collections import defaultdict

        import redis

        from schemas.records import TaskState

        self._client = redis.Redis.from_url(redis_url)
        self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.psubscribe(f"{namespace}:events:*", f"{namespace}:reply:*")
        for _ in range(2):  # the psubscribe confirmations: from here on nothing is missed
            self._pubsub.get_message(timeout=5)
        self._events_prefix = f"{namespace}:events:".encode()
        self._events: dict[str, list[TaskState]] = defaultdict(list)
        self._replies: dict[str, list[TaskState]] = defaultdict(list)
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="terminal-events", daemon=True)

    def __enter__(self) -> TerminalEvents:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._pubsub.close()
        self._client.close()

    def _run(self) -> None:
        from schemas.codec import decode_state
        from transport.redis.lua import reply_frames

        try:
            while not self._stop.is_set():
                message = self._pubsub.get_message(timeout=0.1)
                if message is None or message["type"] != "pmessage":
                    continue
                if message["channel"].startswith(self._events_prefix):
                    state = decode_state(message["data"])
                    if state.status.terminal:
                        self._events[state.task_id].append(state)
                else:
                    for doc in reply_frames(message["data"]):
                        state = decode_state(doc)
                        self._replies[state.task_id].append(state)
        except BaseException as err:  # reported by twice(): a dead listener must not pass for silence
            self.failure = err
            raise

    @property
    def states(self) -> dict[str, list[Any]]:
        """Each task's published terminal states: on its task channel, else in reply frames (a stored
        synchronous task's end goes to both: counted once)."""
        tasks = set(self._events) | set(self._replies)
        return {task: list(self._events.get(task) or self._replies.get(task) or ()) for task in tasks}

    def twice(self) -> dict[str, int]:
        """Tasks whose terminal state was published more than once on one path (must stay empty)."""
        assert self.failure is None, f"the terminal-event listener died: {self.failure!r}"
        counts: dict[str, int] = {}
        for published in (dict(self._events), dict(self._replies)):
            for task, states in list(published.items()):
                counts[task] = max(counts.get(task, 0), len(states))
        return {task: count for task, count in counts.items() if count > 1}


def task_states(redis_url: str, namespace: str, task_ids: list[str]) -> dict[str, Any]:
    """The stored ``TaskState`` of each found task, read straight from Redis."""
    from schemas.codec import decode_state
    from schemas.wire import Names

    names = Names(namespace)
    client = redis_client(redis_url)
    try:
        docs = client.pipeline(transaction=False)
        for task_id in task_ids:
            docs.hget(names.task_key(task_id), "doc")
        found = docs.execute()
    finally:
        client.close()
    return {task_id: decode_state(doc) for task_id, doc in zip(task_ids, found, strict=True) if doc}


def metric(port: int, name: str) -> float:
    """Sum of a Prometheus metric's samples on ``127.0.0.1:port/metrics`` (0 when absent or not serving yet)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def private_cluster(
    request: pytest.FixtureRequest, stack: LocalStack, base: Path, *, workers: int, sim_latency_ms: float
) -> Iterator[Cluster]:
    """One gateway, one batcher and ``workers`` sim workers over a stack of the test module's own, stopped
    after the test."""
    launched = launch(
        base,
        stack.kafka_bootstrap,
        stack.redis_url,
        gateways=1,
        batchers=1,
        workers=workers,
        sim_latency_ms=sim_latency_ms,
    )
    with stopped_after(request, launched) as started:
        yield started
