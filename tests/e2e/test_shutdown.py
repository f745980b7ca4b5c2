"""Graceful shutdown with real signals, for workers, batchers and gateways: SIGTERM finishes or hands
back the work in hand and exits 0; a second SIGTERM exits at once. Nothing accepted is lost either way."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cluster_checks import (
    logged,
    proc_named,
    running,
    stored,
    terminal_events,
    two_batchers_one_slow_worker,
)
from tests.support.eventually import eventually_sync
from tests.support.http_calls import assert_answered, post_all, post_stream
from tests.support.processes import Cluster, Proc, TerminalEvents, launch, metric, task_states

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


async def until_running(cluster: Cluster, sent: asyncio.Task[list[httpx.Response]]) -> dict[str, str]:
    """Task id -> worker of the tasks stored running (the requests here are keyed, so stored); fails
    with the answers if ``sent``'s requests end before any ran (refused, say)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        found = await asyncio.to_thread(running, cluster)
        if found:
            return found
        if sent.done():
            answers = [(r.status_code, r.text[:200]) for r in sent.result()]
            raise AssertionError(f"the requests ended before a batch was seen running: {answers}")
        await asyncio.sleep(0.05)
    states = Counter(state.status.value for state in stored(cluster).values())
    raise AssertionError(f"no batch started running within 20 s; stored states: {states}")


def sigterm(proc: Proc) -> None:
    assert proc.popen is not None
    proc.popen.send_signal(signal.SIGTERM)


async def exit_status(proc: Proc, timeout_s: float) -> tuple[int, float]:
    assert proc.popen is not None
    started = time.monotonic()
    code = await asyncio.to_thread(proc.popen.wait, timeout_s)
    return code, time.monotonic() - started


async def test_sigterm_lets_a_worker_finish_its_batch_and_exit_0(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    cluster = launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=2, sim_latency_ms=2000)
    clusters.append(cluster)
    inputs = [f"drain-{n}" for n in range(5)]
    sent = asyncio.create_task(post_all(cluster.gateway_urls[0], inputs, keyed=True))
    in_flight = await until_running(cluster, sent)
    victim = next(iter(in_flight.values()))
    proc = proc_named(cluster, victim)
    sigterm(proc)
    code, took = await exit_status(proc, 30)
    assert code == 0, f"a drained worker exits 0, got {code}"
    finals = task_states(cluster.redis_url, cluster.namespace, [t for t, w in in_flight.items() if w == victim])
    assert finals and all(s.status.value == "completed" and s.worker_id == victim for s in finals.values()), (
        f"the batch in hand is finished by the stopping worker itself: {finals}"
    )
    assert_answered(inputs, await sent)
    print(f"\nSIGTERM mid-batch: {victim} finished its batch and exited 0 after {took:.1f} s")


async def test_a_batch_longer_than_the_drain_timeout_is_handed_back(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    cluster = launch(
        tmp_path,
        infra.kafka_bootstrap,
        infra.redis_url,
        workers=2,
        sim_latency_ms=8000,
        worker_args=("--drain-timeout-s", "0.5"),
    )
    clusters.append(cluster)
    sent = asyncio.create_task(post_all(cluster.gateway_urls[0], ["handed back"], keyed=True))
    in_flight = await until_running(cluster, sent)
    victim = next(iter(in_flight.values()))
    proc = proc_named(cluster, victim)
    sigterm(proc)
    code, took = await exit_status(proc, 20)
    assert code == 0 and took < 5.5, f"exits 0 right after the drain timeout, got {code} after {took:.1f} s"
    responses = await sent
    assert_answered(["handed back"], responses)
    assert responses[0].json()["task_id"] in in_flight
    final = task_states(cluster.redis_url, cluster.namespace, list(in_flight))
    assert all(state.worker_id != victim for state in final.values()), "the other worker ran the handed-back batch"


async def test_a_second_sigterm_exits_at_once_and_loses_nothing(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    cluster = launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=2, sim_latency_ms=6000)
    clusters.append(cluster)
    sent = asyncio.create_task(post_all(cluster.gateway_urls[0], ["impatient"], keyed=True))
    in_flight = await until_running(cluster, sent)
    proc = proc_named(cluster, next(iter(in_flight.values())))
    sigterm(proc)
    await asyncio.to_thread(
        eventually_sync,
        lambda: logged(cluster, proc.name, "finishing the work in hand") >= 1,
        "the first SIGTERM",
        timeout_s=10,
    )
    assert proc.alive(), "the first SIGTERM waits for the 6 s batch"
    sigterm(proc)
    code, took = await exit_status(proc, 5)
    assert code == 128 + signal.SIGTERM and took < 2, f"second signal: exit 143 at once, got {code} after {took:.1f} s"
    assert_answered(["impatient"], await sent)  # redelivered after the session timeout


async def test_sigterm_stops_a_batcher_cleanly_and_its_requests_move(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    cluster, port = await two_batchers_one_slow_worker(tmp_path, infra, clusters)
    inputs = [f"moved-{n}" for n in range(40)]
    with TerminalEvents(cluster.redis_url, cluster.namespace) as events:
        sent = asyncio.create_task(post_stream(cluster.gateway_urls[0], inputs, 0.1))
        await asyncio.to_thread(
            eventually_sync,
            lambda: metric(port, "batchwire_batcher_pending") > 0,
            "batcher0 to hold requests",
            timeout_s=20,
        )
        proc = proc_named(cluster, "batcher0")
        sigterm(proc)
        code, took = await exit_status(proc, 20)
        responses = await sent
        bodies = assert_answered(inputs, responses)
        twice = await terminal_events(cluster, events, [body["task_id"] for body in bodies])
    assert code == 0 and took < 10, f"a batcher stops at once on SIGTERM, got {code} after {took:.1f} s"
    assert not twice, f"tasks answered twice: {twice}"


async def test_sigterm_lets_a_gateway_answer_the_requests_it_holds_and_exit_0(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    cluster = launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=2, sim_latency_ms=2000)
    clusters.append(cluster)
    inputs = [f"held-{n}" for n in range(6)]
    sent = asyncio.create_task(post_all(cluster.gateway_urls[0], inputs, keyed=True))
    await until_running(cluster, sent)
    proc = proc_named(cluster, "gateway0")
    sigterm(proc)
    code, took = await exit_status(proc, 30)
    assert_answered(inputs, await sent)  # each synchronous caller got its own answer before the exit
    assert code == 0 and took < 10, f"a gateway stops once its callers are answered, got {code} after {took:.1f} s"


async def test_a_second_sigterm_ends_a_gateway_at_once(tmp_path: Path, infra: Any, clusters: list[Cluster]) -> None:
    cluster = launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=2, sim_latency_ms=6000)
    clusters.append(cluster)
    sent = asyncio.create_task(post_all(cluster.gateway_urls[0], ["impatient"], keyed=True))
    await until_running(cluster, sent)
    proc = proc_named(cluster, "gateway0")
    sigterm(proc)
    await asyncio.to_thread(
        eventually_sync, lambda: logged(cluster, proc.name, "Shutting down") >= 1, "the first SIGTERM", timeout_s=10
    )
    assert proc.alive(), "the first SIGTERM waits for the caller's 6 s answer"
    sigterm(proc)
    code, took = await exit_status(proc, 5)
    assert code == 128 + signal.SIGTERM and took < 2, f"second signal: exit 143 at once, got {code} after {took:.1f} s"
    with pytest.raises(httpx.TransportError):  # the caller's connection went with the process
        await sent


async def test_sigterm_ends_a_gateways_event_streams_and_it_exits_at_once(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    """An open stream would hold the graceful shutdown for its whole timeout (30 s)."""
    cluster = launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=2, sim_latency_ms=6000)
    clusters.append(cluster)
    proc = proc_named(cluster, "gateway0")
    async with httpx.AsyncClient(base_url=cluster.gateway_urls[0], timeout=30) as client:
        task_id = (await client.post("/v1/tasks", json={"input": "streamed"})).json()["task_id"]
        async with client.stream("GET", f"/v1/result/{task_id}/events") as stream:
            lines = stream.aiter_lines()
            retry, first = await anext(lines), await anext(lines)  # the first event opens with its retry field
            signalled = time.monotonic()
            sigterm(proc)
            rest = [line async for line in lines]
        code, _ = await exit_status(proc, 20)
    took = time.monotonic() - signalled
    print(f"\nstream at SIGTERM: {first!r}, then {rest!r}")
    assert (retry, first[:7]) == ("retry: 1000", "event: "), f"the stream was open: {retry!r}, {first!r}"
    assert not any("completed" in line for line in rest), f"the stream ended before its 6 s task did: {rest}"
    assert code == 0 and took < 5, f"the stream ends and the gateway exits 0 at once, got {code} after {took:.1f} s"
