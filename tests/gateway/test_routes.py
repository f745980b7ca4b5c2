"""Health, readiness, metrics, OpenAPI, unknown routes, unexpected errors, and the lifespan order."""

from __future__ import annotations

import asyncio
import logging
from typing import get_args

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.types import Receive, Scope, Send

from gateway.edge.app import create_app
from gateway.edge.events import StreamsEnd
from gateway.edge.models import StatusName
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from schemas.records import TaskState, TaskStatus
from tests.support.eventually import eventually
from tests.support.gateway_rig import RecordingStore, RigFactory, StubLifecycle, error_of
from tests.support.metrics import ready_series
from transport.memory.requests import MemoryRequestBus
from transport.memory.store import MemoryTaskStore
from transport.routing import Partitioner


async def test_healthz_is_ok(make_rig: RigFactory) -> None:
    rig = await make_rig()
    response = await rig.client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


async def test_readyz_is_200_when_every_part_is_ready(make_rig: RigFactory) -> None:
    rig = await make_rig()
    response = await rig.client.get("/readyz")
    assert response.status_code == 200, response.text
    assert response.json() == {
        "status": "ready",
        "checks": {"batcher": True, "bus": True, "store": True, "gateway": True},
        "models": {"sim": "serving", "echo": "serving"},
    }


async def test_readyz_names_the_part_that_is_down(make_rig: RigFactory) -> None:
    rig = await make_rig()
    rig.lifecycle.parts["batcher"] = False
    rig.lifecycle.parts["store"] = False
    response = await rig.client.get("/readyz")
    assert response.status_code == 503, response.text
    assert error_of(response)["code"] == "not_ready"
    assert error_of(response)["message"] == "not ready: batcher, store"
    assert response.json()["checks"]["bus"] is True
    assert response.headers["retry-after"] == "1"


async def test_readyz_counts_a_failing_lifecycle_check_as_down(make_rig: RigFactory) -> None:
    rig = await make_rig()
    rig.lifecycle.fail_ready = True
    response = await rig.client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["lifecycle"] is False


async def test_readyz_is_503_before_the_gateway_starts(make_rig: RigFactory) -> None:
    rig = await make_rig(start=False)
    response = await rig.client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["gateway"] is False


async def test_metrics_count_requests_by_route_template(make_rig: RigFactory) -> None:
    rig = await make_rig()
    await rig.client.get("/v1/result/NoSuchTaskForMetrics")
    await rig.client.get("/no/such/route")
    response = await rig.client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert "batchwire_requests_total" in text
    assert 'route="/v1/result/{task_id}",status="404"' in text, "requests are labelled by template, not path"
    assert 'route="unmatched",status="404"' in text
    assert "NoSuchTaskForMetrics" not in text


async def test_metrics_show_each_readiness_check_as_it_is_when_scraped(make_rig: RigFactory) -> None:
    """Prometheus reads ``/metrics``, not ``/readyz``: each scrape runs the checks afresh (no /readyz in
    between), and a check no longer made leaves no series behind."""
    rig = await make_rig()
    ready = ready_series((await rig.client.get("/metrics")).text)
    assert ready == {"bus": 1, "store": 1, "batcher": 1, "gateway": 1}, ready

    rig.lifecycle.parts["store"] = False
    del rig.lifecycle.parts["batcher"]
    ready = ready_series((await rig.client.get("/metrics")).text)
    assert ready == {"bus": 1, "store": 0, "gateway": 1}, f"the store down, the batcher no longer checked: {ready}"

    rig.lifecycle.parts["store"] = True
    assert (await rig.client.get("/readyz")).status_code == 200
    ready = ready_series((await rig.client.get("/metrics")).text)
    assert ready == {"bus": 1, "store": 1, "gateway": 1}, ready


async def test_metrics_answer_within_the_readiness_bound_while_a_check_hangs(
    make_rig: RigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dependency that never answers turns its check 0 within ``ready_timeout_s``; it does not hang the scrape."""
    rig = await make_rig(ready_timeout_s=0.2)

    async def never() -> dict[str, bool]:
        await asyncio.Event().wait()
        return {}

    monkeypatch.setattr(rig.lifecycle, "ready", never)
    response = await asyncio.wait_for(rig.client.get("/metrics"), 5)
    assert response.status_code == 200, response.text
    ready = ready_series(response.text)
    assert ready == {"lifecycle": 0, "gateway": 1}, ready


async def test_unknown_route_and_wrong_method_use_the_error_shape(make_rig: RigFactory) -> None:
    rig = await make_rig()
    missing = await rig.client.get("/v2/nothing")
    assert missing.status_code == 404
    assert error_of(missing)["code"] == "not_found"
    wrong = await rig.client.delete("/v1/inference")
    assert wrong.status_code == 405
    assert error_of(wrong)["code"] == "method_not_allowed"
    assert wrong.headers["allow"] == "POST"


async def test_an_error_quotes_a_huge_value_by_its_prefix_and_length(make_rig: RigFactory) -> None:
    """A client's value echoed in an error is cut: a 1 MB model name is no 1 MB 404."""
    rig = await make_rig()
    huge = "m" * 1_000_000
    response = await rig.client.post("/v1/inference", json={"input": "x", "model": huge})
    assert response.status_code == 404 and error_of(response)["code"] == "unknown_model", response.text[:300]
    assert len(response.content) < 1_000, f"the answer grew with the name: {len(response.content)} bytes"
    assert "(1000000 characters)" in error_of(response)["message"]
    missing = await rig.client.get("/" + "p" * 20_000)
    assert missing.status_code == 404 and len(missing.content) < 1_000, len(missing.content)
    unallowed = await rig.client.put("/v1/result/" + "t" * 20_000)
    assert unallowed.status_code == 405 and len(unallowed.content) < 1_000, len(unallowed.content)
    assert error_of(unallowed)["code"] == "method_not_allowed"


async def test_a_long_poll_wait_past_the_cap_waits_the_cap_and_a_negative_one_is_refused(make_rig: RigFactory) -> None:
    rig = await make_rig(max_poll_wait_s=0.2)
    queued = await rig.client.post("/v1/tasks", json={"input": "nobody computes it"})
    assert queued.status_code == 202, queued.text
    polled = await rig.client.get(queued.json()["result_url"], params={"wait": "1e9"})
    assert polled.status_code == 200 and polled.json()["status"] == "queued", polled.text
    negative = await rig.client.get(queued.json()["result_url"], params={"wait": "-1"})
    assert negative.status_code == 422 and error_of(negative)["code"] == "validation_error", negative.text
    assert "wait" in error_of(negative)["message"], negative.text


async def test_a_long_poll_answers_the_state_it_has_once_the_server_begins_shutting_down(make_rig: RigFactory) -> None:
    """As an event stream ends: a 30 s ``?wait=`` would hold the graceful shutdown past its limit, and be
    cut with a 500; the caller polls again, at a gateway that stays."""
    end = StreamsEnd()
    rig = await make_rig(streams_end=end)  # no worker: the task stays queued
    task_id = (await rig.client.post("/v1/tasks", json={"input": "x"})).json()["task_id"]
    poll = asyncio.create_task(rig.client.get(f"/v1/result/{task_id}", params={"wait": "30"}))
    await eventually(lambda: rig.gateway.watchers == 1, "the long-poll to wait")
    end.end()  # as the server's signal handler does
    answered = await asyncio.wait_for(poll, 5)
    assert (answered.status_code, answered.json()["status"]) == (200, "queued"), answered.text
    assert rig.gateway.watchers == 0


class ExplodingStore(MemoryTaskStore):
    async def get(self, task_id: str) -> TaskState | None:
        raise ZeroDivisionError("a bug")


async def test_an_unexpected_exception_is_a_logged_json_500(
    make_rig: RigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    rig = await make_rig(store=ExplodingStore())
    response = await rig.client.get("/v1/result/AnyTask")
    assert response.status_code == 500
    assert error_of(response)["code"] == "internal_error"
    assert "a bug" not in response.text, "internals must not leak to clients"
    assert any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records), "the traceback must be logged"


async def test_openapi_documents_every_route_and_its_errors(make_rig: RigFactory) -> None:
    rig = await make_rig()
    spec = (await rig.client.get("/openapi.json")).json()
    paths = spec["paths"]
    assert {"post"} <= set(paths["/v1/inference"])
    assert {"post"} <= set(paths["/v1/tasks"])
    for path in ("/v1/result/{task_id}", "/v1/result/{task_id}/events", "/healthz", "/readyz", "/metrics"):
        assert "get" in paths[path], f"{path} missing from OpenAPI"
    inference = paths["/v1/inference"]["post"]
    assert {"200", "400", "404", "413", "422", "502", "503", "504"} <= set(inference["responses"])
    assert inference["requestBody"]["content"]["application/json"]["schema"]["required"] == ["input"]
    assert "deadline_exceeded" in inference["responses"]["504"]["content"]["application/json"]["examples"]
    assert "202" in paths["/v1/tasks"]["post"]["responses"]
    assert "text/event-stream" in paths["/v1/result/{task_id}/events"]["get"]["responses"]["200"]["content"]
    cancel = paths["/v1/result/{task_id}"]["delete"]
    assert {"200", "400", "404", "409"} <= set(cancel["responses"])
    for submit in (inference, paths["/v1/tasks"]["post"]):
        headers = {p["name"]: p for p in submit.get("parameters", []) if p["in"] == "header"}
        assert headers["Idempotency-Key"]["schema"]["maxLength"] == 255
        assert "idempotency_key_reused" in submit["responses"]["422"]["content"]["application/json"]["examples"]
    assert "security" not in inference, "no API keys configured: nothing to send"


async def test_each_route_is_registered_once_and_the_submits_serve_without_their_lane(make_rig: RigFactory) -> None:
    rig = await make_rig()
    pairs = [
        (route.path, method) for route in rig.app.routes if isinstance(route, APIRoute) for method in route.methods
    ]
    assert len(pairs) == len(set(pairs)), f"a route is registered twice: {sorted(pairs)}"

    async def without_lanes(scope: Scope, receive: Receive, send: Send) -> None:
        await FastAPI.__call__(rig.app, scope, receive, send)

    transport = httpx.ASGITransport(app=without_lanes)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        accepted = await client.post("/v1/tasks", json={"input": "abc"})
        broken = await client.post("/v1/inference", content=b"{", headers={"content-type": "application/json"})
    assert accepted.status_code == 202, accepted.text
    assert accepted.headers["location"] == f"/v1/result/{accepted.json()['task_id']}"
    assert broken.status_code == 400, broken.text
    assert error_of(broken)["code"] == "invalid_json"


def test_the_status_names_in_the_api_are_the_task_statuses() -> None:
    assert set(get_args(StatusName)) == {status.value for status in TaskStatus}


async def test_lifespan_starts_lifecycle_first_and_closes_it_last() -> None:
    calls: list[str] = []

    class Recording(StubLifecycle):
        async def start(self) -> None:
            calls.append("lifecycle.start")

        async def close(self) -> None:
            calls.append("lifecycle.close")

    class RecordingGateway(Gateway):
        async def start(self) -> None:
            calls.append("gateway.start")
            await super().start()

        async def close(self) -> None:
            calls.append("gateway.close")
            await super().close()

    store = RecordingStore()
    gateway = RecordingGateway(GatewaySettings(), MemoryRequestBus(Partitioner(("sim",), 1)).producer(), store)
    app = create_app(gateway, Recording())
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        assert (await client.get("/readyz")).status_code == 200
    assert calls == ["lifecycle.start", "gateway.start", "gateway.close", "lifecycle.close"]


async def test_a_lifecycle_whose_start_fails_closes_what_it_started() -> None:
    """A start that fails part-way (Kafka down after Redis came up) still closes the parts that started."""
    calls: list[str] = []

    class FailingStart(StubLifecycle):
        async def start(self) -> None:
            calls.append("lifecycle.start")
            raise RuntimeError("the producer could not start")

        async def close(self) -> None:
            calls.append("lifecycle.close")

    gateway = Gateway(GatewaySettings(), MemoryRequestBus(Partitioner(("sim",), 1)).producer(), RecordingStore())
    app = create_app(gateway, FailingStart())
    with pytest.raises(RuntimeError, match="could not start"):
        async with app.router.lifespan_context(app):
            pass
    assert calls == ["lifecycle.start", "lifecycle.close"]


@pytest.mark.parametrize("failing", ["_replies", "_keys"])
async def test_a_gateway_whose_start_fails_stops_the_tasks_it_started(failing: str) -> None:
    """The gateway's start fails part-way (its reply subscription, its key watch): the look-ups and sweeps
    it started stop with it, not run on under a lifespan that never served."""
    store = MemoryTaskStore()
    await store.start()
    gateway = Gateway(GatewaySettings(models=("sim",)), MemoryRequestBus(Partitioner(("sim",), 1)).producer(), store)

    async def fail() -> None:
        raise RuntimeError("the gateway could not start")

    getattr(gateway, failing).start = fail
    app = create_app(gateway, StubLifecycle())
    try:
        with pytest.raises(RuntimeError, match="could not start"):
            async with app.router.lifespan_context(app):
                pass
        assert asyncio.all_tasks() == {asyncio.current_task()}, "no task of the gateway left running"
    finally:
        await store.close()
