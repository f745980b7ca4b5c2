"""Schemathesis over every route of the gateway's OpenAPI document, against a real ``batchwire up``.

Two deployments, each a subprocess on a free 127.0.0.1 port: API keys off, and API keys on (every
request carries the bearer key, and schemathesis's ``ignored_auth`` check also sends it without).
Each operation gets generated and schema-violating requests (examples, coverage and fuzzing
phases); a stateful run follows the links schemathesis infers from ``POST /v1/tasks`` (the
``task_id`` and the Location header) into ``GET``/``DELETE /v1/result/{task_id}`` and the SSE
stream, so those see real tasks and not only 404s. Every answer must be no 5xx, carry a documented
status and content type, and match the documented schema; schemathesis's other default checks
(schema-violating requests rejected, valid ones accepted, unsupported methods answered 405, auth
not ignored, ...) run too. Exclusions are narrow and say why where they are made.

The document is built in-process at import (schemathesis parametrizes at collection, before any
server runs) and ``test_served_document_is_the_fuzzed_one`` proves the server serves the same one.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import positive_data_acceptance, use_after_free

from gateway.edge.app import create_app
from gateway.edge.auth import digest_of
from gateway.keys.idempotency import KEY_PATTERN
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from schemas.records import TaskStatus
from schemas.wire import IDEMPOTENCY_HEADER
from tests.support.gateway_rig import StubLifecycle
from tests.support.processes import Proc, embedded
from transport.memory.requests import MemoryRequestBus
from transport.memory.store import MemoryTaskStore
from transport.routing import Partitioner

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

API_KEY = "fuzz-key-0123456789abcdef"
# Reads /metrics, which the fuzzer's tenant key is refused (403, documented).
OPERATOR_KEY = "fuzz-operator-0123456789abcdef"
# Sync calls answer in ~5 ms (sim latency); a timeout_ms near the maximum still ends in 2 s.
TIMEOUT_MS = 2000
SERVICE_FLAGS = ("--max-timeout-ms", str(TIMEOUT_MS), "--default-timeout-ms", str(TIMEOUT_MS))
SIM_LATENCY_MS = 5.0
# A sync call asking for less than this may rightly end 504 deadline_exceeded (the sim alone takes
# 5 ms, a loaded 2-core box adds more); one given longer must get its answer.
SHORT_DEADLINE_MS = 1000
EVENTS_PATH = "/v1/result/{task_id}/events"

EXAMPLES_PER_OPERATION = 60
STATEFUL_SCENARIOS = 20
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES_PER_OPERATION,
    derandomize=True,  # the same cases every run, no example database
    database=None,
    deadline=None,  # answers are timed by the server's own limits, not by Hypothesis
    suppress_health_check=[HealthCheck.too_slow],  # every example is an HTTP round trip
)
STATEFUL_SETTINGS = settings(FUZZ_SETTINGS, max_examples=STATEFUL_SCENARIOS, stateful_step_count=6)


def _document(api_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """The OpenAPI document of ``batchwire up`` with ``SERVICE_FLAGS`` (and these key digests)."""
    gateway_settings = GatewaySettings(
        default_timeout_ms=TIMEOUT_MS, max_timeout_ms=TIMEOUT_MS, api_keys=api_keys, gateway_id="doc"
    )
    bus = MemoryRequestBus(Partitioner(gateway_settings.models, 12))
    app = create_app(Gateway(gateway_settings, bus.producer(), MemoryTaskStore()), StubLifecycle())
    return app.openapi()


def _config(bearer: str | None) -> schemathesis.Config:
    raw: dict[str, Any] = {
        # 413 is this API's documented answer to an oversized `input` (maxLength), and 415 to a body
        # sent without its JSON Content-Type (a missing body is one), so a schema-violating request
        # rejected with either is rejected as it should be.
        "checks": {"negative_data_rejection": {"expected-statuses": [400, 401, 404, 405, 409, 413, 415, 422]}},
    }
    if bearer is not None:
        raw["auth"] = {"openapi": {"apiKey": {"bearer": bearer}}}
    return schemathesis.Config.from_dict(raw)


def _with_event_schema(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with the SSE stream's ``{"type": "string"}`` replaced by the schema of one event.

    Schemathesis (like OpenAPI 3.2's ``itemSchema``) reads the ``schema`` of a ``text/event-stream``
    in a 3.1 document as the schema of each event, an object ``{event, data, id}``: the served
    ``{"type": "string"}`` fails every real event (reported as a documentation finding). This is
    what the route's own description promises, so each event is checked, its JSON ``data`` too.
    """
    fuzzed = copy.deepcopy(doc)
    stream = fuzzed["paths"][EVENTS_PATH]["get"]["responses"]["200"]["content"]["text/event-stream"]
    stream["schema"] = {
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": {"enum": [*(status.value for status in TaskStatus), "error"]},
            "id": {"type": "string", "pattern": "^[0-3]$"},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {
                    "anyOf": [
                        {"$ref": "#/components/schemas/TaskResult"},
                        {"$ref": "#/components/schemas/ErrorResponse"},
                    ]
                },
            },
        },
    }
    return fuzzed


OPEN_DOC = _document()
KEYED_DOC = _document((digest_of(API_KEY),))
open_api = schemathesis.openapi.from_dict(_with_event_schema(OPEN_DOC), config=_config(None))
keyed_api = schemathesis.openapi.from_dict(_with_event_schema(KEYED_DOC), config=_config(API_KEY))


def _service(base: Path, *extra: str) -> Iterator[str]:
    """``batchwire up`` for one module; on the way out it must still run, stop cleanly and have logged no traceback."""
    proc: Proc
    proc, url = embedded(base, 1, SIM_LATENCY_MS, *SERVICE_FLAGS, *extra)
    try:
        yield url
        assert proc.alive(), f"batchwire up died while being fuzzed:\n{proc.tail()}"
        print(f"\n{base.name}: answers by status {_answers_by_status(url)}")
    finally:
        code = proc.stop()
    assert code == 0, f"batchwire up exited {code} after SIGTERM:\n{proc.tail()}"
    log = proc.log_path.read_text(errors="replace")
    assert "Traceback" not in log, f"batchwire up logged a traceback while being fuzzed:\n{log[-6000:]}"


def _answers_by_status(url: str) -> dict[str, int]:
    """What the service answered while fuzzed, from its own request counter."""
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {OPERATOR_KEY}"}, timeout=10).text
    counts: Counter[str] = Counter()
    for line in metrics.splitlines():
        if line.startswith("batchwire_requests_total{"):
            status = line.split('status="', 1)[1].split('"', 1)[0]
            counts[status] += int(float(line.rsplit(" ", 1)[1]))
    return dict(sorted(counts.items()))


@pytest.fixture(scope="module")
def open_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _service(tmp_path_factory.mktemp("fuzz-open"))


@pytest.fixture(scope="module")
def keyed_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _service(tmp_path_factory.mktemp("fuzz-keyed"), "--api-keys", f"{API_KEY},operator {OPERATOR_KEY}")


_key_serial = itertools.count()


def _fresh_idempotency_key(case: schemathesis.Case[Any]) -> None:
    """Makes a well-formed generated Idempotency-Key unique to this case.

    Hypothesis draws the same short keys ("0", "00") over and over; the gateway rightly answers a
    key reused with another input 422 ``idempotency_key_reused``, which schemathesis would report as
    a valid request rejected. Malformed keys are left as drawn: they are what negative cases test.
    """
    headers = case.headers
    key = headers.get(IDEMPOTENCY_HEADER) if headers else None
    if isinstance(key, str) and KEY_PATTERN.fullmatch(key) and len(key) <= 200:
        headers[IDEMPOTENCY_HEADER] = f"{key}.{next(_key_serial)}"


def no_server_error(ctx: Any, response: schemathesis.Response, case: schemathesis.Case[Any]) -> None:
    """Replaces ``not_a_server_error``: no 5xx, but for the documented 504 of a too-short ``timeout_ms``.

    ``POST /v1/inference`` with ``timeout_ms`` below what the model takes, and ``POST /v1/tasks``
    with one below what queueing takes, answer 504 ``deadline_exceeded`` by contract (docs/operations.md's
    error table); the built-in check counts that as a server error. Every other 5xx, and a 504 for a
    request that gave the service enough time, fails.
    """
    if response.status_code < 500:
        return
    if response.status_code == 504 and case.path in ("/v1/inference", "/v1/tasks"):
        timeout_ms = case.body.get("timeout_ms") if isinstance(case.body, dict) else None
        code = _error_code(response)
        if isinstance(timeout_ms, int | float) and timeout_ms < SHORT_DEADLINE_MS and code == "deadline_exceeded":
            return
    raise AssertionError(f"server error {response.status_code}: {response.text[:2000]}")


def _error_code(response: schemathesis.Response) -> str | None:
    try:
        return str(json.loads(response.text)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


def _excluded_checks(case: schemathesis.Case[Any]) -> list[Any]:
    excluded: list[Any] = [not_a_server_error]  # replaced by no_server_error
    if case.path.startswith("/v1/result/"):
        # DELETE cancels a task, it does not remove it: the task stays readable, `cancelled`
        # (docs/operations.md, Cancellation). A read that finds it after a successful DELETE is the contract.
        excluded.append(use_after_free)
    if case.path == "/v1/embeddings":
        # The fuzzed deployment's model reverses strings: a valid request is refused 400
        # `not_an_embedding_model`, as documented (tests/gateway/test_openai.py embeds for real).
        excluded.append(positive_data_acceptance)
    return excluded


def test_served_document_is_the_fuzzed_one(open_url: str, keyed_url: str) -> None:
    for url, doc in ((open_url, OPEN_DOC), (keyed_url, KEYED_DOC)):
        served = httpx.get(f"{url}/openapi.json", timeout=10).json()
        assert served == doc, f"{url}/openapi.json differs from the document the fuzz cases were generated from"


def test_every_route_is_fuzzed() -> None:
    """The document names every route the app serves, so parametrizing over it covers them all."""
    documented = {(method.upper(), path) for path, item in OPEN_DOC["paths"].items() for method in item}
    assert documented == {
        ("POST", "/v1/inference"),
        ("POST", "/v1/tasks"),
        ("GET", "/v1/result/{task_id}"),
        ("DELETE", "/v1/result/{task_id}"),
        ("GET", "/v1/result/{task_id}/events"),
        ("GET", "/healthz"),
        ("GET", "/readyz"),
        ("GET", "/metrics"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/{model}"),
        ("POST", "/v1/embeddings"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/fleet"),
    }, f"the routes changed: {sorted(documented)}; review the fuzz tests' exclusions"


@open_api.parametrize()
@FUZZ_SETTINGS
def test_open(case: schemathesis.Case[Any], open_url: str) -> None:
    _fresh_idempotency_key(case)
    case.call_and_validate(
        base_url=open_url, excluded_checks=_excluded_checks(case), additional_checks=[no_server_error], timeout=15
    )


@keyed_api.parametrize()
@FUZZ_SETTINGS
def test_keyed(case: schemathesis.Case[Any], keyed_url: str) -> None:
    _fresh_idempotency_key(case)
    case.call_and_validate(
        base_url=keyed_url, excluded_checks=_excluded_checks(case), additional_checks=[no_server_error], timeout=15
    )


def _run_workflow(api: schemathesis.BaseSchema, url: str) -> Counter[tuple[str, str, int]]:
    """Runs the stateful scenarios; returns how often each (method, path, status) was answered."""
    base = api.as_state_machine()
    seen: Counter[tuple[str, str, int]] = Counter()

    class Workflow(base):  # type: ignore[valid-type, misc]
        def before_call(self, case: schemathesis.Case[Any]) -> None:
            _fresh_idempotency_key(case)

        def get_call_kwargs(self, case: schemathesis.Case[Any]) -> dict[str, Any]:
            return {"base_url": url, "timeout": 15}

        def after_call(self, response: schemathesis.Response, case: schemathesis.Case[Any]) -> None:
            super().after_call(response, case)
            seen[(case.method.upper(), case.path, response.status_code)] += 1

        def validate_response(
            self, response: Any, case: schemathesis.Case[Any], additional_checks: Any = None, **kwargs: Any
        ) -> None:
            __tracebackhide__ = True
            case.validate_response(
                response,
                additional_checks=[no_server_error, *(additional_checks or ())],
                excluded_checks=_excluded_checks(case),
                transport_kwargs=kwargs or None,
                recorder=self.recorder,
            )

    Workflow.run(settings=STATEFUL_SETTINGS)
    return seen


def _assert_reached_real_tasks(seen: Counter[tuple[str, str, int]]) -> None:
    """The links led from a created task to its result, its stream and its cancellation."""
    reached = {(method, path) for method, path, status in seen if status in (200, 409)}
    wanted = {("GET", "/v1/result/{task_id}"), ("GET", EVENTS_PATH), ("DELETE", "/v1/result/{task_id}")}
    assert wanted <= reached, f"the stateful run never reached a real task through {wanted - reached}: {seen}"


def test_open_stateful(open_url: str) -> None:
    _assert_reached_real_tasks(_run_workflow(open_api, open_url))


def test_keyed_stateful(keyed_url: str) -> None:
    _assert_reached_real_tasks(_run_workflow(keyed_api, keyed_url))


def test_405_allow_lists_every_method_of_the_path(open_url: str) -> None:
    response = httpx.request("PUT", f"{open_url}/v1/result/q3bY0h2mXw1kL9aF5cZr6Q", timeout=10)
    assert response.status_code == 405, response.text
    allowed = {method.strip() for method in response.headers.get("allow", "").split(",")}
    assert allowed >= {"GET", "DELETE"}, f"expected Allow to name GET and DELETE, got {response.headers.get('allow')!r}"


def test_submits_are_counted_under_their_route(open_url: str) -> None:
    accepted = httpx.post(f"{open_url}/v1/tasks", json={"input": "count me"}, timeout=10)
    assert accepted.status_code == 202, accepted.text
    metrics = httpx.get(f"{open_url}/metrics", timeout=10).text
    assert 'batchwire_requests_total{route="/v1/tasks",status="202"}' in metrics, (
        "expected a batchwire_requests_total sample for route /v1/tasks, got:\n"
        + "\n".join(line for line in metrics.splitlines() if line.startswith("batchwire_requests_total"))
    )
