"""Processes die (kill -9, a crashing or hanging backend) with work in hand: nothing accepted is lost,
nothing is answered twice, and a poison input ends on the dead-letter topic instead of blocking.

Real processes over the session's Kafka and Redis, real signals. Workers and batchers run with the
default 3 s group session, so a dead member's partitions move about 3-4 s after its death.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from infra.ports import free_port
from schemas.wire import Names
from tests.support.cluster_checks import (
    group_offsets,
    proc_named,
    running,
    terminal_events,
    two_batchers_one_slow_worker,
)
from tests.support.eventually import eventually_sync
from tests.support.http_calls import assert_answered, collect_events, many_at_once, post_all, post_stream
from tests.support.processes import (
    Cluster,
    Restarter,
    TerminalEvents,
    launch,
    metric,
    redis_client,
    task_states,
)

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


async def test_a_worker_killed_mid_batch_loses_nothing_and_answers_once(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    cluster = launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=2, sim_latency_ms=1500)
    clusters.append(cluster)
    # Half keyed, so stored from their submit: their "running" says which worker holds the batch; the
    # plain half is stored only at its end (``TaskStore.apply``).
    keyed, plain = [f"kill-{n}" for n in range(0, 12, 2)], [f"kill-{n}" for n in range(1, 12, 2)]
    inputs = keyed + plain

    async def send() -> list[httpx.Response]:
        url = cluster.gateway_urls[0]
        first, second = await asyncio.gather(post_all(url, keyed, keyed=True), post_all(url, plain))
        return first + second

    with TerminalEvents(cluster.redis_url, cluster.namespace) as events:
        sent = asyncio.create_task(send())
        deadline = time.monotonic() + 20
        in_flight: dict[str, str] = {}
        while not in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            in_flight = await asyncio.to_thread(running, cluster)
        assert in_flight, "no batch started running within 20 s"
        victim = next(iter(in_flight.values()))
        lost = [task for task, worker in in_flight.items() if worker == victim]
        proc_named(cluster, victim).kill9()
        killed_at = time.monotonic()
        responses = await sent
        answered_in = time.monotonic() - killed_at
        bodies = assert_answered(inputs, responses)
        twice = await terminal_events(cluster, events, [body["task_id"] for body in bodies])
    assert not twice, f"tasks answered twice: {twice}"
    finals = task_states(cluster.redis_url, cluster.namespace, lost)
    assert all(state.worker_id != victim for state in finals.values()), "another worker completed the batch"
    print(f"\nkill -9 of {victim} mid-batch ({len(lost)} tasks on it): all answered {answered_in:.1f} s after the kill")
    assert answered_in < 20, f"redelivery took {answered_in:.1f} s (3 s Kafka timeout + 1.5 s batch expected)"


async def test_an_idle_workers_stale_credit_delays_one_batch_only_until_the_rebalance(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    cluster = launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=2, sim_latency_ms=50)
    clusters.append(cluster)
    proc_named(cluster, "worker0").kill9()  # idle: its credit stays in Redis until it expires (5 s)
    killed_at = time.monotonic()
    latencies: list[tuple[float, float]] = []
    async with httpx.AsyncClient(timeout=30) as client:
        while time.monotonic() - killed_at < 7:
            started = time.monotonic()
            response = await client.post(f"{cluster.gateway_urls[0]}/v1/inference", json={"input": "stale"})
            assert response.status_code == 200 and response.json()["output"] == "elats", response.text
            latencies.append((started - killed_at, time.monotonic() - started))
    slow = [(at, took) for at, took in latencies if took > 2.5]
    worst = max(took for _, took in latencies)
    print(f"\nidle worker killed: {len(latencies)} sequential requests, {len(slow)} over 2.5 s, worst {worst:.1f} s")
    assert len(slow) <= 1, f"only the batch sent against the dead worker's credit waits: {slow}"
    assert worst < 10, f"it waits for the rebalance (about 3-4 s), not longer: {worst:.1f} s"


async def test_a_batcher_killed_with_held_requests_loses_none(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    cluster, port = await two_batchers_one_slow_worker(tmp_path, infra, clusters)
    inputs = [f"held-{n}" for n in range(40)]
    with TerminalEvents(cluster.redis_url, cluster.namespace) as events:
        sent = asyncio.create_task(post_stream(cluster.gateway_urls[0], inputs, 0.1))
        # one worker, one-second batches: requests pile up in the batchers while it is busy
        await asyncio.to_thread(
            eventually_sync,
            lambda: metric(port, "batchwire_batcher_pending") > 0,
            "batcher0 to hold requests",
            timeout_s=20,
        )
        held = metric(port, "batchwire_batcher_pending")
        proc_named(cluster, "batcher0").kill9()
        killed_at = time.monotonic()
        responses = await sent
        answered_in = time.monotonic() - killed_at
        bodies = assert_answered(inputs, responses)
        twice = await terminal_events(cluster, events, [body["task_id"] for body in bodies])
    assert not twice, f"tasks answered twice: {twice}"
    print(f"\nbatcher0 killed holding {held:.0f} requests: all {len(inputs)} answered {answered_in:.1f} s after")


async def test_async_tasks_survive_a_gateway_restart(tmp_path: Path, infra: Any, clusters: list[Cluster]) -> None:
    # 8 s calls: the last batch ends two calls after the first post (within the 30 s default deadline),
    # which leaves a busy machine about 14 s to stop the gateway and bring it back.
    cluster = launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, gateways=2, workers=2, sim_latency_ms=8000)
    clusters.append(cluster)
    first, other = cluster.gateway_urls
    inputs = [f"async-{n}" for n in range(20)]
    async with httpx.AsyncClient(timeout=60, limits=many_at_once()) as client:
        created = [(await client.post(f"{first}/v1/tasks", json={"input": text})).json() for text in inputs]
        gateway0 = proc_named(cluster, "gateway0")
        assert gateway0.stop() == 0, "a gateway stops on SIGTERM and exits 0"
        cluster.gateway_urls.remove(first)
        cluster.gateway(0)
        restarted = cluster.gateway_urls[-1]
        ids = [task["task_id"] for task in created]
        stored = await asyncio.to_thread(task_states, cluster.redis_url, cluster.namespace, ids)
        pending = [task for task in ids if not stored[task].status.terminal]
        polled = await asyncio.gather(
            *(client.get(f"{restarted}/v1/result/{task['task_id']}", params={"wait": 45}) for task in created)
        )
        streamed = await asyncio.gather(
            *(asyncio.wait_for(collect_events(client, other, task["task_id"]), 45) for task in created[:5])
        )
    for text, response in zip(inputs, polled, strict=True):
        body = response.json()
        assert body["status"] == "completed" and body["output"] == text[::-1], body
    for text, events in zip(inputs[:5], streamed, strict=True):
        assert events[-1][0] == "completed" and events[-1][1]["output"] == text[::-1], events
    print(f"\ngateway restarted with {len(pending)} of {len(inputs)} async tasks still in flight; all retrieved")
    assert pending, "the restart should happen while tasks are in flight (make the batches slower)"


async def test_a_task_whose_deadline_passes_while_every_batcher_is_down_ends_expired(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    cluster = launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=1)
    clusters.append(cluster)
    proc_named(cluster, "batcher0").kill9()
    url = cluster.gateway_urls[0]
    async with httpx.AsyncClient(timeout=30) as client:
        created = await client.post(f"{url}/v1/tasks", json={"input": "too late", "timeout_ms": 2000})
        assert created.status_code == 202, created.text
        task_id = created.json()["task_id"]
        streamed = asyncio.create_task(asyncio.wait_for(collect_events(client, url, task_id), 20))
        started = time.monotonic()
        try:
            polled = (await client.get(f"{url}/v1/result/{task_id}", params={"wait": 15})).json()
            answered_in = time.monotonic() - started
        finally:
            if not streamed.done():
                await asyncio.wait({streamed}, timeout=20)  # its own bound: it ends or fails within 20 s
        assert polled["status"] == "expired" and polled["error"]["code"] == "deadline_exceeded", (
            f"a long-poll of a task past its deadline while no batcher runs: expected expired, got {polled}"
        )
        assert answered_in < 10, (
            f"the long-poll answers at the deadline (2 s), not at its wait's end: {answered_in:.1f} s"
        )
        events = await streamed
    assert [name for name, _ in events] == ["queued", "expired"], f"the stream ends expired: {events}"
    port = free_port()
    cluster.batcher(0, "--metrics-port", str(port))
    names = Names(cluster.namespace)

    async def read_and_committed() -> bool:
        committed, ends = await group_offsets(cluster.kafka_bootstrap, names.batcher_group, names.request_topic)
        return sum(committed.values()) == sum(ends.values()) > 0

    await asyncio.to_thread(
        eventually_sync,
        lambda: asyncio.run(read_and_committed()),
        "the batcher that came back to read the request and commit it",
        timeout_s=30,
        interval_s=0.5,
    )
    stored = task_states(cluster.redis_url, cluster.namespace, [task_id])[task_id]
    assert stored.status.value == "expired", f"the stored task stays expired: {stored}"
    # The task's one end is the gateway's: the batcher's expiry, which the store refused, is not counted.
    served = (await asyncio.to_thread(httpx.get, f"http://127.0.0.1:{port}/metrics", timeout=5)).text
    assert "batchwire_batcher_pending{" in served, "the batcher that came back serves its metrics"
    batcher_ended = metric(port, "batchwire_tasks_ended_total")
    assert batcher_ended == 0, f"the batcher counts no end of a task the gateway ended: {batcher_ended}"
    gateway_ended = metric(int(url.rsplit(":", 1)[1]), 'batchwire_tasks_ended_total{model="sim",status="expired"}')
    assert gateway_ended == 1, f"the gateway counts the end it wrote, once: {gateway_ended}"
    ran = [batch for batch in cluster.journal() if task_id in batch.get("task_ids", [])]
    assert not ran, f"no worker computes a task past its deadline: {ran}"


async def test_a_task_past_its_deadline_in_a_hung_call_ends_expired_when_its_only_worker_stops(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    """The only worker's call hangs: once it gives up (exit 75), the task whose deadline has passed
    reads ``expired``, not ``running`` until a worker comes back or its record expires."""
    args = ("--sim-hang-on", "forever", "--hang-min-s", "3", "--expected-latency-ms", "100")
    cluster = launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=1, worker_args=args)
    clusters.append(cluster)
    worker = proc_named(cluster, "worker0")
    url = cluster.gateway_urls[0]
    async with httpx.AsyncClient(timeout=30) as client:
        created = await client.post(f"{url}/v1/tasks", json={"input": "hang forever", "timeout_ms": 1000})
        assert created.status_code == 202, created.text
        task_id = created.json()["task_id"]
        code = await asyncio.to_thread(worker.stopped, 30)
        assert code == 75, f"the worker gives up on the hung call and exits 75: {code}\n{worker.tail()}"
        polled = (await client.get(f"{url}/v1/result/{task_id}")).json()
    assert polled["status"] == "expired" and polled["error"]["code"] == "deadline_exceeded", (
        f"a task past its deadline in a hung call, its worker gone: expected expired, got {polled}"
    )
    stored = task_states(cluster.redis_url, cluster.namespace, [task_id])[task_id]
    assert stored.status.value == "expired", f"the stored task is expired: {stored}"


async def test_a_collapsed_callers_task_ends_expired_at_its_deadline_after_its_gateway_is_killed(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    """Two identical synchronous calls share one computation, each recorded ``queued`` under its
    own task id; their gateway dies (kill -9) before any answer. Past its deadline, each caller's
    task reads ``expired`` from another gateway, not ``queued`` until its record expires."""
    cluster = launch(
        tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=1, gateway_args=("--deterministic-models", "sim")
    )
    clusters.append(cluster)
    proc_named(cluster, "worker0").kill9()  # the computation waits: no answer comes
    url = cluster.gateway_urls[0]

    async def call() -> httpx.Response | httpx.HTTPError:
        async with httpx.AsyncClient(timeout=30) as client:
            try:
                return await client.post(f"{url}/v1/inference", json={"input": "same", "timeout_ms": 3000})
            except httpx.HTTPError as err:
                return err

    calls = [asyncio.create_task(call()) for _ in range(2)]
    redis = redis_client(cluster.redis_url)
    prefix = Names(cluster.namespace).task_key("")[:-2]  # "<ns>:task:", before the id's braces
    try:
        await asyncio.to_thread(
            eventually_sync, lambda: len(list(redis.scan_iter(f"{prefix}*"))) >= 2, "both callers' records"
        )
        task_ids = [key.decode()[len(prefix) + 1 : -1] for key in redis.scan_iter(f"{prefix}*")]
    finally:
        redis.close()
    assert len(task_ids) == 2, f"one record per caller, none for the computation: {task_ids}"
    proc_named(cluster, "gateway0").kill9()
    answered = await asyncio.gather(*calls)
    assert all(isinstance(outcome, httpx.HTTPError) for outcome in answered), f"no answer came: {answered}"
    cluster.gateway(1, "--deterministic-models", "sim")
    async with httpx.AsyncClient(timeout=30) as client:
        for task_id in task_ids:
            polled = (await client.get(f"{cluster.gateway_urls[1]}/v1/result/{task_id}", params={"wait": 15})).json()
            assert polled["status"] == "expired" and polled["error"]["code"] == "deadline_exceeded", (
                f"a collapsed caller's task past its deadline, its gateway dead: expected expired, got {polled}"
            )


async def read_dead_letters(bootstrap: str, topic: str, want: int, timeout_s: float = 20) -> list[Any]:
    from aiokafka import AIOKafkaConsumer

    from schemas.deadletter import decode_dead_letter

    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None)
    await consumer.start()
    letters: list[Any] = []
    try:
        async with asyncio.timeout(timeout_s):
            while len(letters) < want:
                batches = await consumer.getmany(timeout_ms=500)
                letters.extend(decode_dead_letter(r.value) for records in batches.values() for r in records)
    finally:
        await consumer.stop()
    return letters


async def fault_run(cluster: Cluster, bad: str, good: list[str], timeout_s: float) -> dict[str, dict[str, Any]]:
    """Submits the bad input, then the good ones, as tasks; returns each one's final result by input."""
    url = cluster.gateway_urls[0]
    async with httpx.AsyncClient(timeout=30) as client:
        ids = {bad: (await client.post(f"{url}/v1/tasks", json={"input": bad, "timeout_ms": 30_000})).json()["task_id"]}
        for text in good:
            ids[text] = (await client.post(f"{url}/v1/tasks", json={"input": text})).json()["task_id"]
        results: dict[str, dict[str, Any]] = {}
        async with asyncio.timeout(timeout_s):
            while len(results) < len(ids):
                for text, task_id in ids.items():
                    if text not in results:
                        body = (await client.get(f"{url}/v1/result/{task_id}", params={"wait": 2})).json()
                        if body["status"] not in ("queued", "batched", "running"):
                            results[text] = body
    return results


async def test_a_worker_restarted_after_a_hang_takes_its_call_time_for_the_batch_it_hung_on(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    """No --expected-latency-ms: each worker times its own calls, and a restarted process has timed none.
    It takes the hung worker's call time from the batch's delivery log; allowed the 60 s of a fresh
    worker instead, it would hang on past every deadline of the batch, and the hanging input would end
    ``expired``, not dead-lettered."""
    args = ("--sim-hang-on", "forever", "--hang-min-s", "1")
    cluster = launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=1, worker_args=args)
    clusters.append(cluster)
    async with httpx.AsyncClient(timeout=30) as client:  # the worker times a call
        warm = await client.post(f"{cluster.gateway_urls[0]}/v1/inference", json={"input": "warm"})
        assert warm.status_code == 200, warm.text
    with Restarter(cluster, [proc_named(cluster, "worker0")]) as restarter:
        results = await fault_run(cluster, "hang forever", ["fine-1", "fine-2"], timeout_s=60)
        await asyncio.to_thread(eventually_sync, lambda: len(restarter.exits) >= 3, "three worker exits", timeout_s=10)
        exits = list(restarter.exits)
    assert results["fine-1"]["output"] == "1-enif" and results["fine-2"]["output"] == "2-enif"
    hung = results["hang forever"]
    assert hung["status"] == "failed" and hung["error"]["code"] == "dead_lettered", hung
    assert [code for _, code, _ in exits] == [75, 75, 75], f"each hang: exit 75 and a restart, got {exits}"


async def test_an_input_that_crashes_workers_is_dead_lettered_and_others_are_answered(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    cluster = launch(
        tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=2, worker_args=("--sim-crash-on", "segfault")
    )
    clusters.append(cluster)
    workers = [proc_named(cluster, "worker0"), proc_named(cluster, "worker1")]
    good = [f"healthy-{n}" for n in range(6)]
    with Restarter(cluster, workers) as restarter:
        started = time.monotonic()
        results = await fault_run(cluster, "segfault please", good, timeout_s=60)
        took = time.monotonic() - started
        # the third crash is over before the fourth delivery sets the input aside; its exit is seen soon
        await asyncio.to_thread(eventually_sync, lambda: len(restarter.exits) >= 3, "three worker exits", timeout_s=10)
        exits = list(restarter.exits)
    for text in good:
        assert results[text]["status"] == "completed" and results[text]["output"] == text[::-1], results[text]
    poisoned = results["segfault please"]
    assert poisoned["status"] == "failed" and poisoned["error"]["code"] == "dead_lettered", poisoned
    assert [code for _, code, _ in exits] == [70, 70, 70], f"three crashes (max_deliveries=3), got {exits}"
    letters = await read_dead_letters(cluster.kafka_bootstrap, f"{cluster.namespace}.dead-letter", 1)
    assert [item.input for item in letters[0].items] == ["segfault please"]
    assert letters[0].deliveries == 4 and letters[0].items[0].strikes == 3
    print(f"\npoison input: 3 worker crashes, dead-lettered {took:.1f} s after it was sent; healthy inputs answered")


async def test_a_hung_backend_exits_75_and_its_batch_completes_elsewhere(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    args = ("--sim-hang-on", "forever", "--hang-min-s", "1", "--expected-latency-ms", "100")
    cluster = launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=2, worker_args=args)
    clusters.append(cluster)
    workers = [proc_named(cluster, "worker0"), proc_named(cluster, "worker1")]
    with Restarter(cluster, workers) as restarter:
        started = time.monotonic()
        results = await fault_run(cluster, "hang forever", ["fine-1", "fine-2"], timeout_s=60)
        took = time.monotonic() - started
        await asyncio.to_thread(eventually_sync, lambda: len(restarter.exits) >= 3, "three worker exits", timeout_s=10)
        exits = list(restarter.exits)
    assert results["fine-1"]["output"] == "1-enif" and results["fine-2"]["output"] == "2-enif"
    hung = results["hang forever"]
    assert hung["status"] == "failed" and hung["error"]["code"] == "dead_lettered", hung
    assert "hang limit" in hung["error"]["message"] or "died" in hung["error"]["message"]
    assert [code for _, code, _ in exits] == [75, 75, 75], f"each hang: exit 75 and a restart, got {exits}"
    print(f"\nhanging input: 3 worker restarts (exit 75), dead-lettered {took:.1f} s after it was sent")
