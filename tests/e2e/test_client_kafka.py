"""``batchwire.client`` against a Kafka deployment: real gateways, a batcher and sim workers as separate
processes over the session's Kafka and Redis.

- A call whose gateway is killed (``kill -9``) while its input runs is retried by the client through
  the other gateway with the same ``Idempotency-Key``: one answer, the right one, computed once.
- ``infer_many`` over 10,000 inputs at its default concurrency keeps the deployment's queue within
  that concurrency, and returns every output in order.
- The three modes (``infer``, ``submit`` then ``result``, ``events``) end completed.

There is no load balancer between client and gateways: :class:`Failover`, an httpx transport that
sends to the first gateway until it refuses connections and then to the next, plays one. Like a real
one it moves on only when a connection is refused (nothing was sent); a request cut off mid-way is
the client's to retry.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from batchwire.client import DEFAULT_CONCURRENCY, BatchwireError, Client, TaskEvent
from gateway.keys.idempotency import ANONYMOUS_SCOPE
from schemas.records import TaskStatus
from schemas.wire import IDEMPOTENCY_HEADER, Names
from tests.support.cluster_checks import stored
from tests.support.eventually import eventually_sync
from tests.support.processes import Cluster, launch, redis_client, stopped_after
from transport.redis.lua import parse_binding

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(300)]

RUNS_FOR_MS = 3000.0
"""The sim's call time in the gateway-kill test: long enough to kill the gateway while the input runs."""
MANY = 10_000
HELD_BOUND = DEFAULT_CONCURRENCY + 4
"""The most requests a gateway or the batchers may hold at once: the calls in flight, and a few more
for requests a gateway still works on after their client gave up on the connection and retried. A
queue that grew with the inputs would reach thousands."""
LAG_BOUND = 2 * DEFAULT_CONCURRENCY
"""The request topic's lag counts offsets: a batcher commits a partition up to its lowest unfinished
request, so requests answered behind one it still holds count until it finishes."""
ORDER = [status.value for status in TaskStatus]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def port_of(url: str) -> int:
    port = httpx.URL(url).port
    assert port is not None, url
    return port


# a load balancer --------------------------------------------------------------------------------
@dataclass
class Attempt:
    """One request as the balancer forwarded it: to which gateway, with which key, and what came
    (a status, or the name of the transport error)."""

    port: int
    path: str
    key: str | None
    outcome: str = "in flight"
    replayed: bool = False


class Failover(httpx.HTTPTransport):
    """Sends each request to the current gateway; a refused connection (nothing sent) moves it to the
    next one and tries there. Any other failure is raised to the client, as a proxy would answer it.
    Records every attempt; the test reads them while the client's thread sends."""

    def __init__(self, ports: list[int]) -> None:
        super().__init__()
        self.ports = ports
        self.current = 0
        self.attempts: list[Attempt] = []
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        refused: httpx.ConnectError | None = None
        for _ in self.ports:
            with self._lock:
                port = self.ports[self.current]
                attempt = Attempt(port, request.url.path, request.headers.get(IDEMPOTENCY_HEADER))
                self.attempts.append(attempt)
            request.url = request.url.copy_with(port=port)
            request.headers["Host"] = f"{request.url.host}:{port}"
            try:
                response = super().handle_request(request)
            except httpx.ConnectError as err:
                attempt.outcome = "refused"
                refused = err
                with self._lock:
                    if self.ports[self.current] == port:
                        self.current = (self.current + 1) % len(self.ports)
                continue
            except httpx.TransportError as err:
                attempt.outcome = type(err).__name__
                raise
            attempt.outcome = str(response.status_code)
            attempt.replayed = response.headers.get("Idempotent-Replayed") == "true"
            return response
        assert refused is not None
        raise refused

    def recorded(self) -> list[Attempt]:
        with self._lock:
            return list(self.attempts)


# the deployments --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deployment(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two gateways, a batcher and three sim workers (10 ms a call): 10,000 inputs at 32 a time are
    about 300 batches, so the run is paced by the client's concurrency and the service, not the sim."""
    infra = request.getfixturevalue("infra")
    base = tmp_path_factory.mktemp("client-kafka")
    started = launch(base, infra.kafka_bootstrap, infra.redis_url, gateways=2, workers=3, sim_latency_ms=10)
    with stopped_after(request, started) as cluster:
        yield cluster


@pytest.fixture
def slow_deployment(tmp_path: Path, infra: Any, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """Two gateways, a batcher and two sim workers that take ``RUNS_FOR_MS`` a call; its own, as a
    gateway of it is killed."""
    with stopped_after(
        request,
        launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, gateways=2, workers=2, sim_latency_ms=RUNS_FOR_MS),
    ) as cluster:
        yield cluster


def stored_statuses(cluster: Cluster) -> dict[str, str]:
    """Every task stored in the cluster's namespace, with its status."""
    return {task_id: state.status.value for task_id, state in stored(cluster).items()}


def bound_task(cluster: Cluster, key: str) -> str | None:
    """The task an anonymous caller's Idempotency-Key names in the store."""
    client = redis_client(cluster.redis_url)
    try:
        held = client.get(Names(cluster.namespace).idempotency_key(ANONYMOUS_SCOPE, key))
    finally:
        client.close()
    claim = parse_binding(held.decode()) if held is not None else None
    return claim.task_id if claim is not None else None


# 1. a retry after a gateway is killed mid-request -----------------------------------------------
def test_a_call_whose_gateway_is_killed_mid_request_is_retried_on_the_other_and_computed_once(
    slow_deployment: Cluster,
) -> None:
    cluster = slow_deployment
    gateway_a = next(proc for proc in cluster.procs if proc.name == "gateway0")
    port_a, port_b = (port_of(url) for url in cluster.gateway_urls)
    balancer = Failover([port_a, port_b])
    text = unique("survives")
    with Client(cluster.gateway_urls[0], transport=balancer, timeout=30) as client, ThreadPoolExecutor(1) as pool:
        call = pool.submit(client.infer, text)
        # Running: the worker has the input, and gateway A holds the caller's connection.
        eventually_sync(
            lambda: list(stored_statuses(cluster).values()) == ["running"],
            "the call's task to be running",
            timeout_s=20,
        )
        assert [(a.port, a.outcome) for a in balancer.recorded()] == [(port_a, "in flight")], balancer.recorded()
        gateway_a.kill9()
        killed_at = time.monotonic()
        output = call.result(timeout=40)
        took_s = time.monotonic() - killed_at

    assert output == text[::-1], f"expected the reversal of {text!r}, got {output!r}"
    attempts = balancer.recorded()
    summary = [(a.port, a.outcome, a.replayed) for a in attempts]
    assert attempts[0].port == port_a and attempts[0].outcome not in ("200", "refused", "in flight"), (
        f"the first attempt should be cut off on gateway A by its death: {summary}"
    )
    assert (attempts[-1].port, attempts[-1].outcome, attempts[-1].replayed) == (port_b, "200", True), (
        f"the answer should come from gateway B, as a replay of the first attempt's task: {summary}"
    )
    keys = {a.key for a in attempts}
    assert len(keys) == 1 and None not in keys, f"every attempt should carry the one Idempotency-Key: {keys}"
    assert all(a.path == "/v1/inference" for a in attempts), summary

    (key,) = keys
    assert key is not None
    tasks = stored_statuses(cluster)
    assert list(tasks.values()) == ["completed"], f"one task, completed, in the namespace: {tasks}"
    (task_id,) = tasks
    assert bound_task(cluster, key) == task_id, "the key names the one task"
    runs = [
        (entry["worker"], entry["batch_id"], entry["outcome"])
        for entry in cluster.journal()
        if task_id in entry["task_ids"]
    ]
    all_runs = [task for entry in cluster.journal() for task in entry["task_ids"]]
    assert len(runs) == 1 and all_runs == [task_id], (
        f"task {task_id} should be computed once, by one worker: its batches {runs}, every task run {all_runs}"
    )
    print(f"gateway A killed mid-call; answered through gateway B {took_s:.2f} s later; attempts {summary}; run {runs}")


# 2. infer_many keeps the queue bounded ----------------------------------------------------------
@dataclass
class QueueSampler:
    """Reads one gateway's /metrics and the fleet's queue depth until stopped, keeping the highest of each."""

    url: str
    samples: int = 0
    inflight: float = 0.0
    topic_lag: float = 0.0
    fleet_queue: float = 0.0
    failures: Counter[str] = field(default_factory=Counter)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5) as http:
            while not self.stop.is_set():
                try:
                    metrics = http.get("/metrics").text
                    fleet = http.get("/v1/fleet").json()
                except httpx.HTTPError as err:
                    self.failures[type(err).__name__] += 1
                else:
                    self.samples += 1
                    self.inflight = max(self.inflight, gauge(metrics, "batchwire_inflight_requests"))
                    self.topic_lag = max(self.topic_lag, gauge(metrics, "batchwire_request_topic_lag"))
                    self.fleet_queue = max(self.fleet_queue, float(fleet["totals"]["queue_depth"]))
                self.stop.wait(0.05)  # the sampling rate, not a wait for anything


def answered(url: str) -> Counter[str]:
    """The gateway's ``/v1/inference`` answers so far, by status (its ``batchwire_requests`` counter)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    found = re.findall(r'^batchwire_requests_total\{route="/v1/inference",status="(\d+)"\} (\S+)$', text, flags=re.M)
    return Counter({status: int(float(count)) for status, count in found})


def gauge(metrics: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", metrics, flags=re.MULTILINE)
    assert found is not None, f"{name} is not in /metrics"
    value = float(found.group(1))
    return 0.0 if value != value else value  # NaN: not read yet


def test_infer_many_over_ten_thousand_inputs_keeps_the_queue_within_its_concurrency(deployment: Cluster) -> None:
    url = deployment.gateway_urls[0]
    inputs = [f"many-{index:05d}" for index in range(MANY)]
    before = answered(url)
    sampler = QueueSampler(url)
    sampling = threading.Thread(target=sampler.run, name="queue-sampler")
    sampling.start()
    started = time.monotonic()
    try:
        # The client's own transport, as its callers get it: what it pools and retries is under test too.
        with Client(url) as client:
            outputs = client.infer_many(inputs)
    except BatchwireError:
        print(deployment.logs())
        raise
    finally:
        took_s = time.monotonic() - started
        sampler.stop.set()
        sampling.join(10)

    wrong = [(text, out) for text, out in zip(inputs, outputs, strict=True) if out != text[::-1]]
    assert len(outputs) == MANY and not wrong, f"{len(wrong)} outputs are not their input's reversal: {wrong[:5]}"
    statuses = answered(url) - before
    figures = (
        f"{MANY} inputs in {took_s:.1f} s ({MANY / took_s:.0f}/s), gateway answers {dict(statuses)}; over "
        f"{sampler.samples} samples the highest in-flight was {sampler.inflight:g}, request-topic lag "
        f"{sampler.topic_lag:g}, fleet queue depth {sampler.fleet_queue:g} (concurrency {DEFAULT_CONCURRENCY})"
    )
    print(figures)
    # A refusal (503, 429) is the client's to retry; an answer lost on its way (a second 200 for a
    # retried call) is not expected without a fault, nor is any other status. (A pooled connection
    # closed under its call by httpcore, encode/httpcore#1110, shows as one, or as a call that hangs.)
    assert set(statuses) <= {"200", "503", "429"}, f"only answers and refusals to retry expected: {figures}"
    assert statuses["200"] == MANY, f"each call should be answered once: {figures}"
    runs = Counter(task for entry in deployment.journal() for task in entry["task_ids"])
    twice = [task for task, count in runs.items() if count > 1]
    assert len(runs) >= MANY and not twice, f"each input computed once: {len(runs)} tasks ran, twice: {twice[:5]}"
    assert sampler.samples >= 10, f"too few samples of the queue to judge it: {figures}; failures {sampler.failures}"
    assert 0 < sampler.inflight <= HELD_BOUND, f"in-flight requests should stay within {HELD_BOUND}: {figures}"
    assert sampler.fleet_queue <= HELD_BOUND, f"the batchers' queue should stay within {HELD_BOUND}: {figures}"
    assert sampler.topic_lag <= LAG_BOUND, f"the request topic's lag should stay within {LAG_BOUND}: {figures}"


# 3. the three modes -----------------------------------------------------------------------------
def test_infer_submit_and_events_end_completed(deployment: Cluster) -> None:
    first, second = deployment.gateway_urls
    with Client(first) as client, Client(second) as other:
        text = unique("inferred")
        assert client.infer(text) == text[::-1]

        text = unique("polled")
        task = client.submit(text)
        assert task.result(wait=20) == text[::-1]
        assert other.task(task.id).result(wait=0) == text[::-1], "the other gateway reads the same ended task"

        text = unique("streamed")
        events = list(client.submit(text).events())
    print(f"event stream: {[event.status for event in events]}")
    assert_each_status_once_in_order(events, text)


def assert_each_status_once_in_order(events: list[TaskEvent], text: str) -> None:
    statuses = [event.status for event in events]
    assert statuses, "the stream sent no event"
    assert len(set(statuses)) == len(statuses), f"a status came twice: {statuses}"
    assert statuses == sorted(statuses, key=ORDER.index), f"statuses out of order: {statuses}"
    assert [event.id for event in events] == [TaskStatus(s).rank for s in statuses], f"ids are not ranks: {events}"
    assert statuses[-1] == "completed", f"the stream should end with the task's completion: {statuses}"
    assert events[-1].output == text[::-1], events[-1]
