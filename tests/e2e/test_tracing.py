"""Done-when of tracing over Kafka: gateway, batcher and worker processes export their spans over
OTLP/HTTP to a receiver in this test, and one synchronous request's spans make one trace whose
chain covers what the caller waited."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.eventually import eventually_sync
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.processes import Cluster, launch, stopped_after
from tests.support.trace_checks import check_batch_links, check_covers, request_chain

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(240)]

ROLES = {"batchwire-gateway", "batchwire-batcher", "batchwire-worker"}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver
) -> Iterator[Cluster]:
    infra = request.getfixturevalue("infra")
    cluster = launch(
        tmp_path_factory.mktemp("tracing"),
        infra.kafka_bootstrap,
        infra.redis_url,
        workers=1,
        sim_latency_ms=50,
        extra_env={"BATCHWIRE_OTLP_ENDPOINT": receiver.url, "BATCHWIRE_LOG_FORMAT": "json"},
    )
    with stopped_after(request, cluster):
        yield cluster


def _traceparent() -> tuple[str, str]:
    trace_id = secrets.token_hex(16)
    return f"00-{trace_id}-{secrets.token_hex(8)}-01", trace_id


def _call(client: httpx.Client, text: str, header: str | None = None) -> tuple[int, int]:
    headers = {"traceparent": header} if header else {}
    started = time.time_ns()
    response = client.post("/v1/inference", json={"input": text}, headers=headers)
    ended = time.time_ns()
    assert response.status_code == 200, response.text
    assert response.json()["output"] == text[::-1]
    return started, ended


def _traced(receiver: OtlpReceiver, trace_ids: list[str]) -> Any:
    """Waits until every chain of ``trace_ids`` has been exported; returns the spans."""

    def complete() -> bool:
        spans = receiver.spans()
        try:
            for trace_id in trace_ids:
                request_chain(spans, trace_id)
        except AssertionError:
            return False
        return True

    eventually_sync(complete, f"the spans of {len(trace_ids)} requests to be exported", timeout_s=30)
    return receiver.spans()


@pytest.mark.timing  # the spans cover the call but 10 ms (the caller's own send and read), several times a quiet figure
def test_one_synchronous_request_is_one_trace_across_the_three_roles(cluster: Cluster, receiver: OtlpReceiver) -> None:
    with httpx.Client(base_url=cluster.gateway_urls[0], timeout=30) as client:
        for n in range(3):  # first-request costs (connections, metadata) are not what is traced
            _call(client, f"warm up {n}")
        header, trace_id = _traceparent()
        started, ended = _call(client, "the traced one", header)
    spans = _traced(receiver, [trace_id])
    chain = request_chain(spans, trace_id)
    assert {span.trace_id for span in chain.values()} == {trace_id}, "one trace id, the caller's"
    assert {span.service for span in chain.values()} == ROLES, {name: s.service for name, s in chain.items()}
    assert chain["gateway.accept"].parent_id == header[36:52], "the gateway's span is a child of the caller's"
    backend = [s for s in spans if s.name == "backend" and s.parent_id == chain["worker.run"].span_id]
    assert len(backend) == 1, "the backend call is a child of worker.run"
    assert chain["batch.formed"].links == ((trace_id, chain["gateway.accept"].span_id),)
    check_covers(chain, started, ended, slack_ms=10)
    assert not receiver.refused, receiver.refused


def test_a_batch_span_links_to_every_request_span_in_its_batch(cluster: Cluster, receiver: OtlpReceiver) -> None:
    traced = [_traceparent() for _ in range(8)]

    def call(header: str, trace_id: str) -> None:
        with httpx.Client(base_url=cluster.gateway_urls[0], timeout=30) as client:
            _call(client, f"input {trace_id[:6]}", header)

    with ThreadPoolExecutor(8) as pool:
        # One worker, 50 ms calls: requests sent together wait for it in twos and more.
        list(pool.map(lambda pair: call(*pair), traced))
    spans = _traced(receiver, [trace_id for _, trace_id in traced])
    batches = {request_chain(spans, trace_id)["batch.formed"].span_id for _, trace_id in traced}
    mine = [s for s in spans if s.name == "batch.formed" and s.span_id in batches]
    assert check_batch_links(spans) >= len(mine)
    assert max(len(s.links) for s in mine) > 1, f"no batch held two of the requests: {[len(s.links) for s in mine]}"
    for _, trace_id in traced:
        chain = request_chain(spans, trace_id)
        # The chain has no gap from the gateway's first span to its last (each caller here also opened a connection).
        check_covers(chain, chain["gateway.accept"].start_ns, chain["reply"].end_ns, slack_ms=1)


def test_json_logs_are_one_object_a_line(cluster: Cluster) -> None:
    lines = 0
    for proc in cluster.procs:
        for line in Path(proc.log_path).read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                assert {"time", "level", "logger", "message"} <= record.keys(), line
                lines += 1
    assert lines > 0, "the roles logged nothing"
