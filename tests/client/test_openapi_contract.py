"""The client against the gateway's OpenAPI document: every route, method, header, parameter and field
the client sends or reads is there, so a change of the API that would break the client fails here."""

from __future__ import annotations

from typing import Any

import pytest

from batchwire import client
from gateway.edge.app import create_app
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from schemas.wire import IDEMPOTENCY_HEADER
from tests.support.gateway_rig import StubLifecycle
from transport.memory.requests import MemoryRequestBus
from transport.memory.store import MemoryTaskStore
from transport.routing import Partitioner


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    settings = GatewaySettings(gateway_id="doc")
    bus = MemoryRequestBus(Partitioner(settings.models, 4))
    spec: dict[str, Any] = create_app(Gateway(settings, bus.producer(), MemoryTaskStore()), StubLifecycle()).openapi()
    return spec


def operation(doc: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    found: dict[str, Any] | None = doc["paths"].get(path, {}).get(method)
    assert found is not None, f"the client calls {method.upper()} {path}, which the API no longer has"
    return found


def schema(doc: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    name = ref["$ref"].rsplit("/", 1)[-1]
    found: dict[str, Any] = doc["components"]["schemas"][name]
    return found


def response_fields(doc: dict[str, Any], op: dict[str, Any], status: str) -> set[str]:
    assert status in op["responses"], f"the client expects a {status}, the API documents {sorted(op['responses'])}"
    return set(schema(doc, op["responses"][status]["content"]["application/json"]["schema"])["properties"])


def parameters(op: dict[str, Any], where: str) -> set[str]:
    return {p["name"] for p in op.get("parameters", []) if p["in"] == where}


@pytest.mark.parametrize("path", [client.INFERENCE_PATH, client.TASKS_PATH])
def test_the_submits_take_what_the_client_sends(doc: dict[str, Any], path: str) -> None:
    op = operation(doc, "post", path)
    body = op["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert {"input", "model", "priority", "timeout_ms"} <= set(body), f"{path} takes {sorted(body)}"
    assert set(body["priority"]["anyOf"][0]["enum"]) == {"high", "normal", "low"}, "client.Priority is stale"
    assert IDEMPOTENCY_HEADER in parameters(op, "header"), f"{path} documents no {IDEMPOTENCY_HEADER} header"
    assert {"503", "422", "404"} <= set(op["responses"]), f"{path}'s errors: {sorted(op['responses'])}"


def test_the_submits_answer_what_the_client_reads(doc: dict[str, Any]) -> None:
    assert "output" in response_fields(doc, operation(doc, "post", client.INFERENCE_PATH), "200")
    assert "task_id" in response_fields(doc, operation(doc, "post", client.TASKS_PATH), "202")


def test_the_result_route_long_polls_and_answers_the_task(doc: dict[str, Any]) -> None:
    op = operation(doc, "get", client.RESULT_PATH)
    assert parameters(op, "path") == {"task_id"} and "wait" in parameters(op, "query")
    wait = next(p for p in op["parameters"] if p["name"] == "wait")["schema"]
    assert "maximum" not in wait, f"a wait past the deployment's longest is cut to it, not refused: {wait}"
    fields = response_fields(doc, op, "200")
    assert {"task_id", "status", "output", "error"} <= fields, fields
    statuses = set(
        schema(doc, op["responses"]["200"]["content"]["application/json"]["schema"])["properties"]["status"]["enum"]
    )
    assert statuses >= client.TERMINAL, f"the client ends on {sorted(client.TERMINAL)}; the API has {statuses}"
    assert "404" in op["responses"]


def test_cancel_is_a_delete_of_the_result(doc: dict[str, Any]) -> None:
    op = operation(doc, "delete", client.RESULT_PATH)
    assert {"200", "404", "409"} <= set(op["responses"]), sorted(op["responses"])


def test_the_event_stream_resumes_with_last_event_id(doc: dict[str, Any]) -> None:
    op = operation(doc, "get", client.EVENTS_PATH)
    ok = op["responses"]["200"]
    assert "text/event-stream" in ok["content"], ok
    assert client.LAST_EVENT_ID_HEADER in ok["description"], "the stream no longer says it resumes"
    assert "204" in op["responses"], "a stream whose end was read answers 204, which ends the client's retries"


def test_errors_have_the_shape_the_client_reads(doc: dict[str, Any]) -> None:
    detail = doc["components"]["schemas"]["ErrorDetail"]["properties"]
    assert {"code", "message", "task_id"} <= set(detail), detail
    assert set(doc["components"]["schemas"]["ErrorResponse"]["properties"]) == {"error"}
