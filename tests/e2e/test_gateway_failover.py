"""A Redis failover under held callers: every caller gets its answer as soon as its gateway is back
on the new primary, and /readyz names Redis while it fails over.

Real processes over ``stack up --brokers 1 --redis-replicas 1`` (a primary, a replica, three
Sentinels) in a state dir of its own. Gateway A holds synchronous callers, long-polls and event
streams; right after the primary is killed (kill -9) A is frozen (SIGSTOP) until the worker has
stored every answer on the new primary, so each reply is published while A is not subscribed and is
lost for sure. A's lost-reply sweep and stream re-reads are set to 30 s: only the re-check on the
change feed's return can answer its callers within seconds of SIGCONT. Gateway B stays running and
its /readyz is read throughout the failover.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from infra.stack import ENV_FILE_NAME, KAFKA_ENV, REDIS_ENV, read_env_file
from schemas.wire import Names
from tests.support.eventually import eventually_sync
from tests.support.processes import Cluster
from tests.support.stack_cli import stack_cli as _stack

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(120)]

SIM_LATENCY_MS = 5000.0  # a batch outlives the failover: its results land on the new primary
SLOW_RECHECK = ("--reply-recheck-s", "30", "--stream-recheck-s", "30", "--stall-s", "60")
SYNC_CALLERS = 6
LONG_POLLS = 2
STREAMS = 2
TOTAL = SYNC_CALLERS + LONG_POLLS + STREAMS
ANSWERED_WITHIN_S = 5.0  # after SIGCONT; the sweep and the stream re-reads would take 30 s


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Path]:
    state_dir = tmp_path / "stack"
    try:
        done = _stack(state_dir, "up", "--brokers", "1", "--redis-replicas", "1")
        assert done.returncode == 0, f"stack up exited {done.returncode}:\n{done.stderr}"
        yield state_dir
    finally:
        _stack(state_dir, "down")


def _status(state_dir: Path) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(_stack(state_dir, "status", "--json").stdout)
    return report


def _primary(state_dir: Path) -> dict[str, Any]:
    (primary,) = [s for s in _status(state_dir)["servers"] if s["kind"] == "redis" and s["role"] == "primary"]
    return primary


def _sentinel_master(sentinel_url: str) -> int | None:
    """The primary's port as the first answering Sentinel names it."""
    hosts = sentinel_url.split("://", 1)[1].split("/", 1)[0].split(",")
    for host in hosts:
        address, _, port = host.rpartition(":")
        try:
            with redis.Redis(host=address, port=int(port), socket_timeout=1) as sentinel:
                answer = sentinel.execute_command("SENTINEL", "get-master-addr-by-name", "batchwire")
        except redis.RedisError:
            continue
        if answer:
            return int(answer[1])
    return None


def _statuses(port: int, names: Names) -> list[str]:
    """Every task's stored status in this test's namespace, on the server at ``port``."""
    with redis.Redis(port=port, socket_timeout=1) as client:
        keys = list(client.scan_iter(match=names.task_key("*"), count=1000))
        return [(status or b"").decode() for status in (client.hget(key, "status") for key in keys)]


def _all(port_of: Callable[[], int | None], names: Names, status: str, count: int) -> Callable[[], bool]:
    def check() -> bool:
        port = port_of()
        if port is None:
            return False
        try:
            found = _statuses(port, names)
        except redis.RedisError:
            return False
        return len(found) == count and all(s == status for s in found)

    return check


def _subscribed(client: redis.Redis, channels: list[str]) -> bool:
    return all(count >= 1 for _, count in client.pubsub_numsub(*channels))


def _readyz(url: str) -> tuple[int, dict[str, Any]]:
    try:
        response = httpx.get(f"{url}/readyz", timeout=3)
    except httpx.HTTPError:
        return 0, {}
    return response.status_code, response.json()


def _sync_call(url: str, text: str) -> tuple[float, dict[str, Any]]:
    response = httpx.post(f"{url}/v1/inference", json={"input": text, "timeout_ms": 30_000}, timeout=40)
    assert response.status_code == 200, response.text
    return time.monotonic(), response.json()


def _long_poll(url: str, task_id: str) -> tuple[float, dict[str, Any]]:
    response = httpx.get(f"{url}/v1/result/{task_id}", params={"wait": 30}, timeout=40)
    assert response.status_code == 200, response.text
    return time.monotonic(), response.json()


def _outcome(future: Future[tuple[float, dict[str, Any]]]) -> str:
    """What a caller's call ended with: its answer, or the error it raised."""
    error = future.exception()
    return repr(future.result()) if error is None else f"{type(error).__name__}: {error}"


def _stream(url: str, task_id: str) -> tuple[float, dict[str, Any]]:
    with httpx.stream("GET", f"{url}/v1/result/{task_id}/events", timeout=40) as response:
        assert response.status_code == 200
        event = ""
        for line in response.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event in ("completed", "failed", "cancelled", "expired"):
                return time.monotonic(), json.loads(line.removeprefix("data: "))
    raise AssertionError(f"the event stream of {task_id} ended without a terminal event")


def test_held_callers_are_answered_when_their_gateway_is_back_on_the_new_primary(stack: Path, tmp_path: Path) -> None:
    env = read_env_file(stack / ENV_FILE_NAME)
    sentinel_url = env[REDIS_ENV]
    names = Names(f"f{uuid.uuid4().hex[:8]}")
    cluster = Cluster(tmp_path, env[KAFKA_ENV], sentinel_url, names.namespace, SIM_LATENCY_MS)
    pool = ThreadPoolExecutor(max_workers=TOTAL)
    frozen: int | None = None
    try:
        # One batch of every caller's task (sealed at its size), so all are running when Redis fails.
        cluster.batcher(0, "--policy", "classic", "--max-batch", str(TOTAL), "--max-wait-ms", "5000")
        cluster.worker(0)
        gateway_a = cluster.gateway(0, *SLOW_RECHECK)
        cluster.gateway(1)
        held_at, observer = cluster.gateway_urls
        old = _primary(stack)
        credits = Names(names.namespace).credit_queue("sim")
        with redis.Redis(port=old["port"]) as client:
            eventually_sync(lambda: client.zcard(credits) >= 1, "the worker to offer a credit", timeout_s=30)

        # Callers on gateway A: synchronous ones, and long-polls and streams of queued tasks.
        calls: list[tuple[str, Future[tuple[float, dict[str, Any]]]]] = []
        for index in range(SYNC_CALLERS):
            text = f"sync-{index}"
            calls.append((text, pool.submit(_sync_call, held_at, text)))
        channels: list[str] = []
        for index in range(LONG_POLLS + STREAMS):
            text = f"task-{index}"
            accepted = httpx.post(f"{held_at}/v1/tasks", json={"input": text, "timeout_ms": 30_000}, timeout=10)
            assert accepted.status_code == 202, accepted.text
            task_id = accepted.json()["task_id"]
            channels.append(names.task_channel(task_id))
            follow = _long_poll if index < LONG_POLLS else _stream
            calls.append((text, pool.submit(follow, held_at, task_id)))
        # One batch: its asynchronous tasks stored running is the batch running (a synchronous task's
        # progress is not stored, only its end).
        eventually_sync(
            _all(lambda: old["port"], names, "running", LONG_POLLS + STREAMS), "the batch to be running", timeout_s=10
        )
        with redis.Redis(port=old["port"]) as client:
            eventually_sync(
                lambda: _subscribed(client, channels), "gateway A to watch every long-poll and stream", timeout_s=10
            )

        os.kill(old["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        # A has seen its feed drop (its /readyz says so) before it is frozen.
        eventually_sync(lambda: _readyz(held_at)[0] == 503, "gateway A to see Redis down", timeout_s=5)
        frozen = gateway_a.pid
        os.kill(frozen, signal.SIGSTOP)

        seen: list[tuple[float, int, dict[str, Any]]] = []

        def observer_ready_again() -> bool:
            asked = time.monotonic()
            status, body = _readyz(observer)
            seen.append((asked - killed_at, status, {**body, "took_s": round(time.monotonic() - asked, 3)}))
            return status == 200 and _sentinel_master(sentinel_url) not in (None, old["port"])

        eventually_sync(
            observer_ready_again, "gateway B's /readyz to be 200 on a new primary", timeout_s=20, interval_s=0.1
        )
        new_port = _sentinel_master(sentinel_url)
        eventually_sync(
            _all(lambda: new_port, names, "completed", TOTAL), "every answer on the new primary", timeout_s=20
        )
        ended = {text: _outcome(future) for text, future in calls if future.done()}
        assert not ended, f"no caller of a frozen gateway can have its answer: {ended}"

        os.kill(frozen, signal.SIGCONT)
        resumed_at = time.monotonic()
        frozen = None
        slowest_s = 0.0
        for text, future in calls:
            answered_at, answer = future.result(timeout=ANSWERED_WITHIN_S + 5)
            slowest_s = max(slowest_s, answered_at - resumed_at)
            assert answer["output"] == text[::-1], f"{text}: expected its reversal, got {answer}"
            assert answered_at - resumed_at < ANSWERED_WITHIN_S, (
                f"{text} was answered {answered_at - resumed_at:.1f} s after gateway A resumed; "
                f"expected under {ANSWERED_WITHIN_S} s (its sweep and stream re-reads run every 30 s)"
            )
        eventually_sync(lambda: _readyz(held_at)[0] == 200, "gateway A's /readyz to be 200 again", timeout_s=10)

        down = [(at, body["down"]["redis"]) for at, status, body in seen if status == 503 and "redis" in body["down"]]
        assert down, f"gateway B's /readyz never named redis while it failed over: {seen}"
        for _, part in down:
            assert part["state"] in ("down", "failing over") and part["reason"], part
        # Sentinel can promote in well under a second, between two reads; the "failing over" state
        # itself is read, held still, in tests/contract/test_redis_sentinel.py.
        states = [part["state"] for _, part in down]
        print(
            f"/readyz redis states during the failover: {states}; ready again after {seen[-1][0]:.1f} s; "
            f"every held caller answered within {slowest_s:.2f} s of gateway A resuming"
        )
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        if frozen is not None:
            os.kill(frozen, signal.SIGCONT)
        pool.shutdown(wait=False, cancel_futures=True)
        cluster.stop()
