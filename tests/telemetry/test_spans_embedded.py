"""A traced request through the embedded system (real gateway, batcher and worker, in this process):
its chain of spans, the batch spans' links, and the spans' cover of the caller's wait."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from batchwire.embedded import EmbeddedRuntime, EmbeddedSettings
from batchwire.settings import SharedSettings
from gateway.edge.app import create_app
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from gpu_worker.backends.sim import SimBackend
from telemetry import tracing
from telemetry.metrics import CACHE_HITS, COLLAPSED
from tests.support.trace_checks import check_batch_links, check_covers, from_sdk, request_chain
from transport.memory.cache import MemoryResultCache

pytestmark = pytest.mark.timeout(60)

CALLER_SPANS: dict[str, str] = {}
"""The span id each caller's ``traceparent`` named, by trace id."""


def traceparent() -> tuple[str, str]:
    """A caller's new trace: its ``traceparent`` header and trace id."""
    trace_id = secrets.token_hex(16)
    return f"00-{trace_id}-{secrets.token_hex(8)}-01", trace_id


@pytest.fixture
async def traced_client() -> AsyncIterator[tuple[httpx.AsyncClient, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracing.configure(None, "batchwire-test", exporter=exporter)  # before the app: its routes are traced
    runtime = EmbeddedRuntime(
        EmbeddedSettings(shared=SharedSettings(models=("sim",)), workers_per_model=1),
        lambda model, index: SimBackend(latency_ms=40),
    )
    gateway = Gateway(GatewaySettings(models=("sim",)), runtime.producer, runtime.store)
    app = create_app(gateway, runtime)
    await runtime.start()
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            await _call(client, "warm up")  # the first request's one-off costs are not the spans' to cover
            exporter.clear()
            yield client, exporter
    finally:
        await gateway.close()
        await runtime.close()
        tracing.shutdown()


async def _call(client: httpx.AsyncClient, text: str) -> tuple[str, int, int]:
    header, trace_id = traceparent()
    CALLER_SPANS[trace_id] = header[36:52]
    started = time.time_ns()
    response = await client.post("/v1/inference", json={"input": text}, headers={"traceparent": header})
    ended = time.time_ns()
    assert response.status_code == 200, response.text
    assert response.json()["output"] == text[::-1]
    return trace_id, started, ended


async def test_one_request_has_the_whole_chain_in_its_callers_trace(
    traced_client: tuple[httpx.AsyncClient, InMemorySpanExporter],
) -> None:
    client, exporter = traced_client
    trace_id, started, ended = await _call(client, "hello")
    spans = from_sdk(exporter.get_finished_spans())
    chain = request_chain(spans, trace_id)
    caller_span = CALLER_SPANS[trace_id]
    assert {span.trace_id for span in chain.values()} == {trace_id}, "alone in its batch: one trace throughout"
    assert chain["gateway.accept"].parent_id == caller_span, "the gateway span is the caller's span's child"
    backend = [s for s in spans if s.name == "backend" and s.parent_id == chain["worker.run"].span_id]
    assert len(backend) == 1, "the backend call is a child of worker.run"
    assert check_batch_links(spans) == 1
    check_covers(chain, started, ended, slack_ms=5)


async def test_a_batch_span_links_every_request_span_of_its_batch(
    traced_client: tuple[httpx.AsyncClient, InMemorySpanExporter],
) -> None:
    client, exporter = traced_client
    # One worker busy for 40 ms: the requests that come meanwhile are batched together.
    calls = await asyncio.gather(*(_call(client, f"input {n}") for n in range(6)))
    spans = from_sdk(exporter.get_finished_spans())
    batches = [s for s in spans if s.name == "batch.formed"]
    assert check_batch_links(spans) == len(batches)
    assert max(len(b.links) for b in batches) > 1, f"no batch held two requests: {[len(b.links) for b in batches]}"
    for trace_id, _, _ in calls:
        # Callers and gateway share this event loop, so a caller's clock starts before its turn: the
        # chain is checked for gaps from the gateway's first span to its last.
        chain = request_chain(spans, trace_id)
        check_covers(chain, chain["gateway.accept"].start_ns, chain["reply"].end_ns, slack_ms=1)


async def test_an_untraced_caller_gets_a_new_trace(
    traced_client: tuple[httpx.AsyncClient, InMemorySpanExporter],
) -> None:
    client, exporter = traced_client
    response = await client.post("/v1/inference", json={"input": "abc"})
    assert response.status_code == 200
    accepts = [s for s in from_sdk(exporter.get_finished_spans()) if s.name == "gateway.accept"]
    assert len(accepts) == 1 and accepts[0].parent_id is None, "a root span"
    request_chain(from_sdk(exporter.get_finished_spans()), accepts[0].trace_id)


async def test_a_refused_request_ends_its_gateway_span_in_an_error(
    traced_client: tuple[httpx.AsyncClient, InMemorySpanExporter],
) -> None:
    client, exporter = traced_client
    header, trace_id = traceparent()
    response = await client.post("/v1/inference", json={"input": "x", "model": "nope"}, headers={"traceparent": header})
    assert response.status_code == 404, response.text
    (accept,) = [s for s in exporter.get_finished_spans() if s.name == "gateway.accept"]
    assert f"{accept.context.trace_id:032x}" == trace_id
    assert (
        accept.status.status_code.name == "ERROR" and (accept.attributes or {}).get("http.response.status_code") == 404
    )
    assert [s.name for s in exporter.get_finished_spans()] == ["gateway.accept"], "nothing was sent"


async def test_a_refused_openai_request_ends_its_gateway_span_in_an_error(
    traced_client: tuple[httpx.AsyncClient, InMemorySpanExporter],
) -> None:
    """The OpenAI routes answer their errors rather than raise them: the span still says it failed."""
    client, exporter = traced_client
    header, trace_id = traceparent()
    body = {"model": "nope", "prompt": "x"}
    response = await client.post("/v1/completions", json=body, headers={"traceparent": header})
    assert response.status_code == 404, response.text
    (accept,) = [s for s in exporter.get_finished_spans() if s.name == "gateway.accept"]
    assert f"{accept.context.trace_id:032x}" == trace_id
    assert (accept.attributes or {}).get("http.response.status_code") == 404
    assert accept.status.status_code.name == "ERROR", accept.status


async def test_a_caller_that_does_not_sample_its_trace_gets_no_spans_recorded(
    traced_client: tuple[httpx.AsyncClient, InMemorySpanExporter],
) -> None:
    client, exporter = traced_client
    header = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00"
    response = await client.post("/v1/inference", json={"input": "quiet"}, headers={"traceparent": header})
    assert response.status_code == 200 and response.json()["output"] == "teiuq"
    assert exporter.get_finished_spans() == (), "the caller's decision holds in every role"


async def test_shared_answers_spans_name_each_callers_own_task() -> None:
    """Identical requests of a deterministic model share one computation, and a later one is answered
    from the cache: each caller's ``gateway.accept`` and ``reply`` carry the task id that caller was
    given, not the shared computation's (an id no caller holds)."""
    exporter = InMemorySpanExporter()
    tracing.configure(None, "batchwire-test", exporter=exporter)
    runtime = EmbeddedRuntime(
        EmbeddedSettings(shared=SharedSettings(models=("sim",)), workers_per_model=1),
        lambda model, index: SimBackend(latency_ms=200),
    )
    settings = GatewaySettings(models=("sim",), deterministic_models=("sim",), cache_ttl_s=60.0)
    gateway = Gateway(settings, runtime.producer, runtime.store, cache=MemoryResultCache())
    app = create_app(gateway, runtime)
    await runtime.start()
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:

            async def call() -> tuple[str, str]:
                header, trace_id = traceparent()
                response = await client.post("/v1/inference", json={"input": "same"}, headers={"traceparent": header})
                assert response.status_code == 200 and response.json()["output"] == "emas", response.text
                return trace_id, response.json()["task_id"]

            collapsed = COLLAPSED.labels(model="sim")._value.get()
            callers = list(await asyncio.gather(call(), call()))
            assert COLLAPSED.labels(model="sim")._value.get() - collapsed == 1, "the second caller joined the first"
            hits = CACHE_HITS.labels(model="sim")._value.get()
            callers.append(await call())
            assert CACHE_HITS.labels(model="sim")._value.get() - hits == 1, "the third caller was a cache hit"
    finally:
        await gateway.close()
        await runtime.close()
        tracing.shutdown()
    spans = from_sdk(exporter.get_finished_spans())
    for trace_id, task_id in callers:
        mine = {
            span.name: span for span in spans if span.trace_id == trace_id and span.name in ("gateway.accept", "reply")
        }
        named = {name: span.attributes.get("task.id") for name, span in mine.items()}
        assert named == {"gateway.accept": task_id, "reply": task_id}, f"caller given {task_id}: {named}"
