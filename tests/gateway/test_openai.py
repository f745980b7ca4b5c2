"""The OpenAI-compatible routes, called through the ``openai`` package's own client: its request
building, response parsing (base64 decoding included), retries and error classes.

The embedded runtime runs a backend that embeds each input as ``[len, index-free constants]``, so the
answers are known; a second model (``sim``) reverses strings and is no embedding model.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest

from batchwire.embedded import EmbeddedRuntime, EmbeddedSettings
from batchwire.settings import SharedSettings
from gateway.admission.gate import ANONYMOUS
from gateway.answers.outcomes import Answer, answer_of
from gateway.edge.app import create_app
from gateway.edge.events import EventStream, StreamsEnd
from gateway.edge.routes.openai import CUT, GONE_GRACE_S, MAX_INPUTS, CompletionChunks, CompletionsBody, openai_error
from gateway.errors import ClientDisconnected, DeadlineExceeded, PredictedLate, TimeoutBelowCall
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from gateway.sharing.answer_keys import AnswerKeys
from gpu_worker.backends.base import BackendError
from gpu_worker.backends.sim import SimBackend
from gpu_worker.settings import WorkerSettings
from schemas.records import TaskState, TaskStatus, shorter_than_call
from tests.support.eventually import eventually
from tests.support.gateway_rig import RigFactory, http_scope
from transport.memory.cache import MemoryResultCache
from transport.memory.limits import MemoryRateLimiter

pytestmark = pytest.mark.timeout(60)


class FakeEmbedder(SimBackend):
    """Embeds each input as ``[its length, 0.25, -1.5]`` (exact in float32), as a JSON array."""

    def batchstring(self, inputs: list[str]) -> list[str]:
        return [json.dumps([float(len(text)), 0.25, -1.5]) for text in inputs]


def _vector(text: str) -> list[float]:
    return [float(len(text)), 0.25, -1.5]


class PoisonedSim(SimBackend):
    """Reverses, as ``sim``, but raises on a batch holding an input containing "poison": that input
    alone ends ``failed`` (``backend_error``), as often as it is sent."""

    def batchstring(self, inputs: list[str]) -> list[str]:
        if any("poison" in text for text in inputs):
            raise BackendError("the model cannot read this input")
        return super().batchstring(inputs)


@asynccontextmanager
async def _client(
    sent: list[str] | None = None,
    *,
    sim: SimBackend | None = None,
    worker: WorkerSettings | None = None,
    **gateway_options: object,
) -> AsyncIterator[openai.AsyncOpenAI]:
    """The openai package's client on an embedded deployment (``sent``: each request's path, as sent;
    ``sim``: the backend of model ``sim``; ``worker``: every worker's settings)."""
    shared = SharedSettings(models=("embed", "sim"))
    runtime = EmbeddedSettings(shared=shared, workers_per_model=1, worker=worker or WorkerSettings())
    backends = {"embed": FakeEmbedder(latency_ms=5), "sim": sim or SimBackend(latency_ms=5)}
    system = EmbeddedRuntime(runtime, lambda model, index: backends[model])
    gateway = Gateway(
        GatewaySettings(models=("embed", "sim"), **gateway_options),  # type: ignore[arg-type]
        system.producer,
        system.store,
        limiter=MemoryRateLimiter(
            float(gateway_options["rate_limit_per_s"]),  # type: ignore[arg-type]
            int(gateway_options.get("rate_limit_burst", 1)),  # type: ignore[call-overload]
        )
        if "rate_limit_per_s" in gateway_options
        else None,
    )
    await system.start()
    await gateway.start()
    app = create_app(gateway, system)

    async def record(request: httpx.Request) -> None:
        if sent is not None:
            sent.append(request.url.path)

    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://batchwire", event_hooks={"request": [record]}
    )
    try:
        yield openai.AsyncOpenAI(base_url="http://batchwire/v1", api_key="unused", http_client=http, max_retries=1)
    finally:
        await http.aclose()
        await gateway.close()
        await system.close()


@pytest.fixture
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    async with _client() as made:
        yield made


async def test_one_string_and_a_list_come_back_in_order_as_floats_and_as_base64(client: openai.AsyncOpenAI) -> None:
    one = await client.embeddings.create(model="embed", input="hello", encoding_format="float")
    assert [d.embedding for d in one.data] == [_vector("hello")]
    assert one.model == "embed" and one.usage.prompt_tokens == math.ceil(len("hello") / 4)
    texts = ["a", "bb", "ccc", "dddd", "a"]
    many = await client.embeddings.create(model="embed", input=texts)  # the package asks for base64
    assert [d.index for d in many.data] == list(range(len(texts)))
    assert [d.embedding for d in many.data] == [_vector(t) for t in texts], "decoded from little-endian float32"


async def test_models_are_listed_and_each_retrieved(client: openai.AsyncOpenAI) -> None:
    listed = await client.models.list()
    assert [m.id for m in listed.data] == ["embed", "sim"]
    assert (await client.models.retrieve("sim")).model_dump() == listed.data[1].model_dump()
    with pytest.raises(openai.NotFoundError) as unknown:
        await client.models.retrieve("org/other")
    assert unknown.value.code == "unknown_model" and "served models: embed, sim" in unknown.value.message


async def test_what_cannot_be_answered_is_refused_with_the_clients_own_errors(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        await client.embeddings.create(model="no-such-model", input="x")
    assert unknown.value.code == "unknown_model" and "no-such-model" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as tokens:
        await client.embeddings.create(model="embed", input=[[1, 2, 3]])
    assert "check_embedding_ctx_length=False" in tokens.value.message
    with pytest.raises(openai.BadRequestError) as dimensions:
        await client.embeddings.create(model="embed", input="x", dimensions=2)
    assert "dimensions" in dimensions.value.message
    with pytest.raises(openai.BadRequestError) as too_many:
        await client.embeddings.create(model="embed", input=["x"] * (MAX_INPUTS + 1))
    assert str(MAX_INPUTS) in too_many.value.message
    with pytest.raises(openai.BadRequestError) as not_embeddings:
        await client.embeddings.create(model="sim", input="x", encoding_format="float")
    assert not_embeddings.value.code == "not_an_embedding_model"
    body = not_embeddings.value.body
    assert isinstance(body, dict) and {"message", "code"} <= set(body), f"OpenAI's error shape: {body}"
    assert not_embeddings.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as chat:
        await client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}])
    assert "POST /v1/completions" in chat.value.message, f"a chat call is told what to send: {chat.value.message}"


@pytest.mark.parametrize(("route", "field"), [("embeddings", "input"), ("completions", "prompt")])
@pytest.mark.parametrize("value", [5, {"text": "x"}, ["x", 1], None, [["x"]], [[1, "x"]]])
async def test_a_text_field_of_another_type_is_refused_in_one_line_saying_what_to_send(
    client: openai.AsyncOpenAI, route: str, field: str, value: object
) -> None:
    """Not one line per branch of the type union (``input.str``, ``input.list[int]``, ...), which names
    shapes no caller wrote."""
    with pytest.raises(openai.BadRequestError) as refused:
        await client.post(f"/{route}", body={"model": "sim", field: value}, cast_to=object)
    body = refused.value.body
    assert isinstance(body, dict) and body.get("code") == "validation_error", body
    assert body.get("message") == f"field '{field}' must be a string or a list of strings", body


@pytest.mark.parametrize(
    ("route", "example"),
    [
        ("embeddings", '{"model": "<model>", "input": "text"}'),
        ("completions", '{"model": "<model>", "prompt": "text"}'),
    ],
)
@pytest.mark.parametrize("body", [b'{"model": "sim", "', b"[]"])
async def test_a_body_that_is_no_json_object_is_shown_the_routes_own_example(
    make_rig: RigFactory, route: str, example: str, body: bytes
) -> None:
    """Not ``/v1/inference``'s ``{"input": ...}``, which a completions caller would send in vain."""
    rig = await make_rig()
    refused = await rig.client.post(f"/v1/{route}", content=body, headers={"content-type": "application/json"})
    assert refused.status_code == 400, refused.text
    assert f"object like {example}" in refused.json()["error"]["message"], refused.text


@pytest.mark.parametrize(("route", "field"), [("embeddings", "input"), ("completions", "prompt")])
@pytest.mark.parametrize(
    ("value", "at", "status", "code", "says"),
    [
        ("", "", 400, "empty_input", "is empty"),
        (["fine", "also fine", ""], "[2]", 400, "empty_input", "is empty"),
        ("y" * 70_000, "", 413, "input_too_large", "is 70000 characters; the limit is 65536"),
        (["fine", "y" * 70_000], "[1]", 413, "input_too_large", "is 70000 characters; the limit is 65536"),
    ],
    ids=["empty", "empty in a list", "too long", "too long in a list"],
)
async def test_a_string_refused_for_itself_is_named_by_the_field_and_place_the_caller_sent(
    client: openai.AsyncOpenAI, route: str, field: str, value: object, at: str, status: int, code: str, says: str
) -> None:
    """Not ``/v1/inference``'s ``input``, which a completions caller never sent, and not a bare "input"
    that leaves the caller to search up to 256 strings for the one at fault."""
    with pytest.raises(openai.APIStatusError) as refused:
        await client.post(f"/{route}", body={"model": "sim", field: value}, cast_to=object)
    body = refused.value.body
    assert refused.value.status_code == status and isinstance(body, dict) and body.get("code") == code, body
    assert str(body.get("message")).startswith(f"`{field}{at}` {says}"), body


@pytest.mark.parametrize(
    ("route", "field"), [("completions", "n"), ("completions", "best_of"), ("embeddings", "dimensions")]
)
async def test_a_refused_number_is_quoted_by_its_start_and_length(make_rig: RigFactory, route: str, field: str) -> None:
    """An answer never grows with what a client sent: JSON's integers have no bound, and a 4,000-digit
    ``n`` was quoted whole."""
    rig = await make_rig()
    text = "prompt" if route == "completions" else "input"
    body = b'{"model": "sim", "%s": "x", "%s": %s}' % (text.encode(), field.encode(), b"9" * 4_000)
    response = await rig.client.post(f"/v1/{route}", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text[:300]
    message = response.json()["error"]["message"]
    assert len(message) < 400 and "(4000 characters)" in message, f"a {len(message)}-character message: {message[:300]}"


@pytest.mark.parametrize("value", [5, ["x", 1], {"text": "x"}])
async def test_a_stop_of_another_type_is_refused_in_one_line_saying_what_to_send(
    client: openai.AsyncOpenAI, value: object
) -> None:
    """As ``prompt``'s: not ``stop.str`` and ``stop.list[str].1``, shapes no caller wrote."""
    with pytest.raises(openai.BadRequestError) as refused:
        await client.post("/completions", body={"model": "sim", "prompt": "x", "stop": value}, cast_to=object)
    body = refused.value.body
    assert isinstance(body, dict) and body.get("message") == "field 'stop' must be a string or a list of strings", body


async def test_every_error_the_routes_answer_has_openais_four_fields(client: openai.AsyncOpenAI) -> None:
    """OpenAI's error object always holds ``message``, ``type``, ``param`` and ``code`` (``param`` null
    where no one parameter is at fault); clients typed on it read each one."""
    refusals: list[Callable[[], Awaitable[object]]] = [
        lambda: client.embeddings.create(model="no-such-model", input="x"),
        lambda: client.embeddings.create(model="embed", input="x", dimensions=2),
        lambda: client.completions.create(model="sim", prompt="x", n=2),
        lambda: client.models.retrieve("org/other"),
    ]
    for refusal in refusals:
        with pytest.raises(openai.APIStatusError) as refused:
            await refusal()
        body = refused.value.body
        assert isinstance(body, dict) and sorted(body) == ["code", "message", "param", "type"], body
        assert body["param"] is None and refused.value.type and refused.value.code, body
    chunk = json.loads(CUT.decode().removeprefix("data: "))
    assert sorted(chunk["error"]) == ["code", "message", "param", "type"], f"a stream's error chunk: {chunk}"


@pytest.mark.parametrize(
    "output",
    [
        *("[" + "9" * 400 + "]", "[" + "9" * 5000 + "]", "[1e39]", "[1e999]", "[NaN]", "[true]", "[1, 2", "[]"),
        "[" * 20_000 + "]" * 20_000,  # nested past json's recursion limit
    ],
    ids=lambda output: output[:12],
)
@pytest.mark.parametrize("encoding_format", ["float", "base64"])
async def test_an_output_that_is_no_float32_vector_is_refused_not_a_500(
    client: openai.AsyncOpenAI, output: str, encoding_format: Any
) -> None:
    """``sim`` answers the input reversed: the caller steers the output, as a generating model's."""
    with pytest.raises(openai.BadRequestError) as refused:
        await client.embeddings.create(model="sim", input=output[::-1], encoding_format=encoding_format)
    assert refused.value.code == "not_an_embedding_model", refused.value.message


async def test_a_rate_limit_surfaces_as_the_clients_rate_limit_error_after_its_retries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[str] = []
    async with _client(sent, rate_limit_per_s=0.01, rate_limit_burst=1) as client:
        # The client honours Retry-After (100 s here) before its retry: the wait is cut, the retry is its own.
        monkeypatch.setattr(client, "_calculate_retry_timeout", lambda *args, **kwargs: 0.01)
        started = time.monotonic()
        await client.embeddings.create(model="embed", input="first")  # the one token for 100 s
        with pytest.raises(openai.RateLimitError) as limited:
            await client.embeddings.create(model="embed", input="second")  # one retry (max_retries=1)
        taken_s = time.monotonic() - started
        assert sent == ["/v1/embeddings"] * 3, f"the client retried the 429 once: {sent}"
        # The next token is 100 s after the first was taken, less what has passed since, rounded up.
        retry_after = limited.value.response.headers.get("retry-after", "")
        assert retry_after.isdigit() and 100 - taken_s <= int(retry_after) <= 100, (
            f"429 says when to come back: {retry_after!r} after {taken_s:.2f} s"
        )
        assert limited.value.code == "rate_limited"


async def test_a_prompt_the_model_failed_is_not_sent_again_by_the_clients_retries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A task the model itself failed (``backend_error``; ``dead_lettered``: its input crashed workers;
    ``output_too_large``) fails the same way when sent again: its 502 says ``x-should-retry: false``, so
    the client's retries of a 5xx do not run (or crash workers on) the input twice more."""
    sent: list[str] = []
    async with _client(sent, sim=PoisonedSim(latency_ms=5)) as client:
        client = client.with_options(max_retries=2)
        monkeypatch.setattr(client, "_calculate_retry_timeout", lambda *args, **kwargs: 0.01)
        with pytest.raises(openai.InternalServerError) as failed:
            await client.completions.create(model="sim", prompt=["fine", "poison"])
        assert failed.value.status_code == 502 and failed.value.code == "backend_error", failed.value.message
        with pytest.raises(openai.InternalServerError) as streamed:
            await client.completions.create(model="sim", prompt="poison", stream=True)
        assert streamed.value.code == "backend_error", "an error before the stream starts is a status"
        assert sent == ["/v1/completions"] * 2, f"each request was sent once: {sent}"


async def test_a_prompt_not_answered_in_time_is_a_504_that_names_the_timeout_to_change() -> None:
    """The OpenAI routes take no ``timeout_ms`` and give no task id: the 504 says which setting bounds the
    wait, not to poll a task the caller cannot name."""
    async with _client(sim=SimBackend(latency_ms=1_000), default_timeout_ms=300) as client:
        with pytest.raises(openai.InternalServerError) as late:
            await client.with_options(max_retries=0).completions.create(model="sim", prompt="slow")
    assert late.value.status_code == 504 and late.value.code == "deadline_exceeded"
    assert "poll" not in late.value.message and "BATCHWIRE_DEFAULT_TIMEOUT_MS" in late.value.message, late.value.message


async def test_a_default_timeout_shorter_than_a_call_is_a_504_that_says_no_retry_can_be_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """These routes wait the deployment's --default-timeout-ms: when a worker finds it shorter than one
    call of the model, sending the request again fails again, so the 504 names the setting to raise and
    the call's length (the worker's verdict, as ``POST /v1/inference`` gives it), and the client does not
    retry it."""
    sent: list[str] = []
    worker = WorkerSettings(expected_latency_ms=1_000)
    async with _client(sent, sim=SimBackend(latency_ms=1_000), worker=worker, default_timeout_ms=300) as client:
        client = client.with_options(max_retries=2)
        monkeypatch.setattr(client, "_calculate_retry_timeout", lambda *args, **kwargs: 0.01)
        with pytest.raises(openai.InternalServerError) as completions:
            await client.completions.create(model="sim", prompt="slow")
        with pytest.raises(openai.InternalServerError) as embeddings:
            await client.embeddings.create(model="embed", input=["a", "b"])
    for late in (completions.value, embeddings.value):
        assert isinstance(late.body, dict), late.body
        message = late.body["message"]
        assert late.status_code == 504 and late.code == "deadline_exceeded", message
        assert late.body == {"message": message, "type": "server_error", "param": None, "code": "deadline_exceeded"}
        assert "less busy" not in message and "send the request again" not in message, f"no retry helps: {message}"
        assert "BATCHWIRE_DEFAULT_TIMEOUT_MS" in message and "--default-timeout-ms" in message, message
        assert "one call" in message and "1000 ms" in message, f"the call's length is named: {message}"
        assert "send a timeout_ms" not in message, f"these routes take no timeout_ms: {message}"
    assert sent == ["/v1/completions", "/v1/embeddings"], f"the client did not retry: {sent}"


def test_an_expired_task_is_below_a_call_only_when_the_whole_timeout_is() -> None:
    """A worker compares a call with what was left of the timeout when the request was sent (admission's
    waits spent): a timeout longer than the call may be met next time, so its 504 stays one to retry."""
    message = f"what was left of the request's timeout when the gateway sent it (900 ms) is {shorter_than_call(1000)}"
    state = TaskState("t", TaskStatus.EXPIRED, "sim", 0, 0, error_code="deadline_exceeded", error_message=message)
    with pytest.raises(TimeoutBelowCall):
        answer_of(state, 1.0, 1_000)
    with pytest.raises(DeadlineExceeded) as late:
        answer_of(state, 1.0, 1_100)
    assert not isinstance(late.value, TimeoutBelowCall), "1,100 ms is longer than the call"
    response = openai_error(late.value, 1)
    assert "x-should-retry" not in response.headers and b"less busy" in response.body, response.body


async def test_a_request_of_several_inputs_takes_its_rate_limit_tokens_whole_or_not_at_all() -> None:
    """Each input is one request to the rate limit, taken together: a list the bucket cannot hold now
    is refused whole (retrying after Retry-After admits it), and one longer than a burst, which no wait
    admits, is a 400 that says how many to send."""
    sent: list[str] = []
    async with _client(sent, rate_limit_per_s=0.01, rate_limit_burst=3) as client:
        client = client.with_options(max_retries=0)
        done = await client.completions.create(model="sim", prompt=["ab", "cd"])
        assert [c.text for c in done.choices] == ["ba", "dc"]
        with pytest.raises(openai.RateLimitError):
            await client.completions.create(model="sim", prompt=["ef", "gh"])  # 1 token left of 3
        with pytest.raises(openai.RateLimitError):
            await client.completions.create(model="sim", prompt=["ij", "kl"], stream=True)
        one = await client.embeddings.create(model="embed", input=["the refused took none"])
        assert len(one.data) == 1, "the last token was still there"
        with pytest.raises(openai.BadRequestError) as refused:
            await client.embeddings.create(model="embed", input=["a", "b", "c", "d"])
        assert "send at most 3 per request" in refused.value.message, refused.value.message


def test_a_refusal_predicted_past_the_deadline_names_the_deployments_timeout_not_a_field_these_routes_lack() -> None:
    """These routes take no ``timeout_ms``: the advice is to retry later, or send fewer strings."""
    late = PredictedLate(
        "... timeout_ms=30000 cannot be met ... or send a longer timeout_ms",
        model="sim",
        answer_s=41.5,
        timeout_ms=30_000,
        retry_after_s=12,
    )
    response = openai_error(late, retry_after_s=1)
    assert response.status_code == 503 and response.headers["retry-after"] == "12"
    error = json.loads(bytes(response.body))["error"]
    assert error["code"] == "overloaded" and error["type"] == "server_error", error
    message = error["message"]
    assert "41.5 s" in message and "BATCHWIRE_DEFAULT_TIMEOUT_MS=30000" in message, message
    assert "fewer per request" in message and "timeout_ms=" not in message.replace("TIMEOUT_MS=", ""), message
    assert message.startswith("model 'sim': its answers are predicted"), f"the model quoted once: {message}"


async def test_more_strings_than_the_gateway_holds_at_once_is_a_400_not_a_503_retried_for_ever() -> None:
    """A request of more strings than ``--max-inflight`` is refused 503 with Retry-After on every
    try, however idle the gateway: the 400 says how many to send, as for more than a rate-limit burst."""
    sent: list[str] = []
    async with _client(sent, max_inflight=3) as client:
        done = await client.embeddings.create(model="embed", input=["a", "b", "c"])
        assert len(done.data) == 3, "as many strings as the gateway holds are answered"
        with pytest.raises(openai.BadRequestError) as refused:
            await client.embeddings.create(model="embed", input=["a", "b", "c", "d"])
        assert refused.value.code == "validation_error" and "send at most 3" in refused.value.message, (
            refused.value.message
        )
        assert "BATCHWIRE_MAX_INFLIGHT" in refused.value.message, refused.value.message
    assert sent == ["/v1/embeddings"] * 2, f"the 400 is not retried: {sent}"


async def test_more_strings_than_the_models_queue_admits_is_a_400_not_a_503_retried_for_ever(
    make_rig: RigFactory,
) -> None:
    """Each string admitted counts in its model's queue at once, so a request of more strings than its
    tier's queue limit was refused 503 on every try, however idle the deployment."""
    rig = await make_rig(queue_depth="bus", max_queue_depth=3)  # "normal" is refused from ceil(3 * 0.8) = 3
    await rig.worker()
    done = await rig.client.post("/v1/completions", json={"model": "sim", "prompt": ["ab", "cd", "ef"]})
    assert done.status_code == 200, done.text
    await eventually(lambda: rig.bus.lag() == 0, "the worker to drain the queue")
    for path, field in (("/v1/completions", "prompt"), ("/v1/embeddings", "input")):
        refused = await rig.client.post(path, json={"model": "sim", field: ["ab", "cd", "ef", "gh"]})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "validation_error" and "send at most 3 per request" in error["message"], error
        assert "BATCHWIRE_QUEUE_FRACTION_NORMAL" in error["message"], error


async def test_a_request_refused_before_it_was_admitted_keeps_its_tokens(make_rig: RigFactory) -> None:
    """As a single request's: refused for its input (404, 413) or by the queue (503), a list takes none."""
    limits: dict[str, Any] = {"rate_limit_per_s": 0.01, "rate_limit_burst": 6}
    rig = await make_rig(queue_depth="bus", max_queue_depth=3, limiter=MemoryRateLimiter(0.01, 6), **limits)
    for index in range(3):  # the queue is full; 3 tokens are left
        assert (await rig.client.post("/v1/tasks", json={"input": f"t{index}"})).status_code == 202
    three = ["ab", "cd", "ef"]
    refused = [
        await rig.client.post("/v1/completions", json={"model": "sim", "prompt": three}),
        await rig.client.post("/v1/completions", json={"model": "sim", "prompt": three, "stream": True}),
        await rig.client.post("/v1/completions", json={"model": "no-such-model", "prompt": three}),
        await rig.client.post("/v1/completions", json={"model": "sim", "prompt": [*three[:2], "x" * 10**6]}),
    ]
    assert [r.status_code for r in refused] == [503, 503, 404, 413], [r.text for r in refused]
    await rig.worker()
    await eventually(lambda: rig.bus.lag() == 0, "the worker to drain the queue")
    deadline = time.monotonic() + 10
    while (done := await rig.client.post("/v1/completions", json={"model": "sim", "prompt": three})).status_code == 503:
        assert time.monotonic() < deadline, done.text
        await asyncio.sleep(0.05)  # poll with a deadline: the queue's sample comes every 0.2 s
    assert done.status_code == 200, done.text


@pytest.mark.parametrize(("route", "field"), [("embeddings", "input"), ("completions", "prompt")])
async def test_a_request_with_a_string_over_the_token_budget_leaves_nothing_behind(
    make_rig: RigFactory, route: str, field: str
) -> None:
    """As one refused for its length: with a token budget and no admission checks (no queue read, no rate
    limit), the strings were counted each in its own submit, and those counted first were queued."""
    counted: list[str] = []

    def count(text: str) -> int:
        counted.append(text)
        return len(text)

    rig = await make_rig(count_tokens=count, max_batch_tokens=100)
    refused = await rig.client.post(f"/v1/{route}", json={"model": "echo", field: ["a", "b", "x" * 101]})
    assert refused.status_code == 413, refused.text
    assert refused.json()["error"]["code"] == "input_over_token_budget", refused.text
    assert refused.json()["error"]["message"].startswith(f"`{field}[2]` is 101 tokens"), refused.text
    assert rig.produced() == 0, "a string of a refused request reached the bus"
    assert rig.store.created == [], "a string of a refused request was stored"
    await rig.worker()
    answered = await rig.client.post("/v1/completions", json={"model": "echo", "prompt": ["cd", "ef"]})
    assert answered.status_code == 200, answered.text
    assert sorted(counted) == sorted(["a", "b", "x" * 101, "cd", "ef"]), f"each string counted once: {counted}"


async def test_prompts_answered_from_the_cache_are_served_while_the_queue_is_full(make_rig: RigFactory) -> None:
    """As a single request's: a cached prompt adds nothing to the queue; a list with a prompt to be queued
    is refused whole and gives its tokens back."""
    cache = MemoryResultCache()
    sharing: dict[str, Any] = {"deterministic_models": ("sim",), "cache_ttl_s": 60.0}
    limits: dict[str, Any] = {"rate_limit_per_s": 0.01, "rate_limit_burst": 4, "trust_client_id": True}
    limiter = MemoryRateLimiter(0.01, 4)
    rig = await make_rig(queue_depth="bus", max_queue_depth=2, cache=cache, limiter=limiter, **sharing, **limits)
    keys = AnswerKeys(rig.settings)
    for prompt in ("ab", "cd"):
        key = keys.key(None, "sim", prompt)
        assert key is not None
        await cache.put(key, prompt[::-1], 60.0)
    for index in range(2):  # the queue is full
        queued = await rig.client.post("/v1/tasks", json={"input": f"t{index}"}, headers={"X-Client-Id": "filler"})
        assert queued.status_code == 202, queued.text
    headers = {"X-Client-Id": "client-1"}

    mixed = await rig.client.post("/v1/completions", json={"model": "sim", "prompt": ["ab", "new"]}, headers=headers)
    cached = await rig.client.post("/v1/completions", json={"model": "sim", "prompt": ["ab", "cd"]}, headers=headers)
    again = await rig.client.post("/v1/completions", json={"model": "sim", "prompt": ["cd", "ab"]}, headers=headers)

    assert mixed.status_code == 503 and mixed.json()["error"]["code"] == "overloaded", mixed.text
    assert cached.status_code == 200, cached.text
    assert [choice["text"] for choice in cached.json()["choices"]] == ["ba", "dc"], cached.text
    assert again.status_code == 200, f"the refused list gave its 2 tokens back: {again.text}"
    assert rig.produced() == 2, "nothing was queued after the queue filled"


async def test_completions_answer_each_prompt_in_order_with_and_without_a_stream(client: openai.AsyncOpenAI) -> None:
    # The sim backend reverses each input.
    one = await client.completions.create(model="sim", prompt="hello")
    assert [(c.index, c.text, c.finish_reason) for c in one.choices] == [(0, "olleh", "stop")]
    assert one.object == "text_completion" and one.model == "sim" and one.id.startswith("cmpl-")
    assert one.usage is not None and one.usage.prompt_tokens == 2 and one.usage.total_tokens == 4
    prompts = ["abc", "hello world", "xyz", "abc"]
    many = await client.completions.create(model="sim", prompt=prompts, stop=["ow"], echo=True)
    assert [c.text for c in many.choices] == ["abccba", "hello worlddlr", "xyzzyx", "abccba"], "cut at the stop, echoed"
    assert many.usage is not None and many.usage.completion_tokens == 4, "an echoed prompt counts as the prompt's"
    stream = await client.completions.create(
        model="sim", prompt=prompts, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    texts = {c.choices[0].index: c.choices[0].text for c in chunks if c.choices}
    assert texts == {i: p[::-1] for i, p in enumerate(prompts)}, "one chunk per prompt, each with its index"
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None, "usage comes last, as asked"
    assert chunks[-1].usage.completion_tokens == sum(math.ceil(len(p) / 4) for p in prompts)


@pytest.mark.parametrize("field", ["n", "echo", "stream"])
async def test_a_null_option_is_its_default(client: openai.AsyncOpenAI, field: str) -> None:
    """openai-python sends ``null`` for an option passed as None, and OpenAI reads it as the default."""
    options: dict[str, Any] = {field: None}
    done = await client.completions.create(model="sim", prompt="hello", **options)
    assert [c.text for c in done.choices] == ["olleh"]


async def test_completions_refuse_what_greedy_text_decoding_cannot_give(client: openai.AsyncOpenAI) -> None:
    refusals: dict[str, dict[str, Any]] = {
        "n": {"n": 2},
        "best_of": {"best_of": 3},
        "logprobs": {"logprobs": 1},
        "suffix": {"suffix": "end"},
        "token ids": {"prompt": [1, 2, 3]},
        "stop": {"stop": ["a", "b", "c", "d", "e"]},
    }
    for name, fields in refusals.items():
        request: dict[str, Any] = {"model": "sim", "prompt": "x", **fields}
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(**request)
        assert refused.value.code == "validation_error", name
        assert name.split()[0] in refused.value.message, (name, refused.value.message)
    with pytest.raises(openai.NotFoundError) as unknown:
        await client.completions.create(model="no-such-model", prompt="x", stream=True)
    assert unknown.value.code == "unknown_model", "an error before the stream starts is a status, not a chunk"


async def test_a_closed_stream_tells_its_unanswered_prompts_that_their_caller_has_gone() -> None:
    told: list[str] = []
    cancelled: list[str] = []

    class Submits:
        """A gateway whose "a" is answered at once, whose "b" waits for its caller to leave, and whose
        "c" waits in admission (where no connection is watched yet)."""

        settings = GatewaySettings(models=("sim",))

        async def submit(self, text: str, model: str | None, *args: object, disconnected: Any, **kw: object) -> Answer:
            if text == "b":
                await disconnected()
                told.append(text)
                raise ClientDisconnected("gone", task_id="t-b")
            if text == "c":
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    cancelled.append(text)
                    raise
            return Answer("t-a", "sim", text[::-1], 1.0, 1)

    body = CompletionsBody(prompt=["a", "b", "c"], model="sim", stream=True)
    chunks = CompletionChunks(Submits(), ["a", "b", "c"], ["a", "b", "c"], body, [], ANONYMOUS)  # type: ignore[arg-type]
    first = json.loads((await anext(chunks)).decode().removeprefix("data: "))
    assert first["choices"] == [{"text": "a", "index": 0, "logprobs": None, "finish_reason": "stop"}]
    async with asyncio.timeout(GONE_GRACE_S * 10):
        await chunks.aclose()
    assert told == ["b"], "the unanswered prompt's submit saw its caller leave, and was awaited"
    assert cancelled == ["c"], "one still in admission was cancelled after the grace"
    with pytest.raises(StopAsyncIteration):
        await anext(chunks)


async def test_a_stream_the_server_shutdown_ends_says_so_and_the_client_raises() -> None:
    """A completions stream cannot be resumed: one the shutdown cuts after its first prompt's chunk ends
    with an error chunk, not as if every prompt had been answered."""

    class Submits:
        settings = GatewaySettings(models=("sim",))

        async def submit(self, text: str, model: str | None, *args: object, disconnected: Any, **kw: object) -> Answer:
            if text == "b":  # unanswered when the shutdown comes
                await disconnected()
                raise ClientDisconnected("gone", task_id="t-b")
            return Answer("t-a", "sim", text[::-1], 1.0, 1)

    body = CompletionsBody(prompt=["a", "b"], model="sim", stream=True)
    chunks = CompletionChunks(Submits(), ["a", "b"], ["a", "b"], body, [], ANONYMOUS)  # type: ignore[arg-type]
    end, sent = StreamsEnd(), bytearray()

    async def send(message: Any) -> None:
        sent.extend(message.get("body", b""))
        if b"data:" in sent:
            end.end()  # the server begins shutting down once the first chunk is out

    async def receive() -> Any:
        await asyncio.Event().wait()

    async with asyncio.timeout(10):
        await EventStream(chunks, ping_s=60, end=end, cut=CUT)({"method": "POST"}, receive, send)
    sse = {"content-type": "text/event-stream"}
    replay = httpx.MockTransport(lambda _: httpx.Response(200, content=bytes(sent), headers=sse))
    seen: list[int] = []

    async def read(client: openai.AsyncOpenAI) -> None:
        async for chunk in await client.completions.create(model="sim", prompt=["a", "b"], stream=True):
            seen.extend(choice.index for choice in chunk.choices)

    async with httpx.AsyncClient(transport=replay) as http:
        with pytest.raises(openai.APIError, match="shutting down"):
            await read(openai.AsyncOpenAI(base_url="http://x/v1", api_key="k", http_client=http))
    assert seen == [0], "the first prompt's chunk came before the cut"


# over the gateway's rig: prompts whose caller is gone --------------------------------------------


@pytest.mark.parametrize("reply_recheck_s", [0.1, 1.0])
async def test_the_prompts_left_when_one_is_refused_are_cancelled_as_at_a_disconnect(
    make_rig: RigFactory, reply_recheck_s: float
) -> None:
    """The caller got its error: the request's other prompts, on the bus already, are not computed. A
    single request's caller is watched only from the lost-reply sweep after ``reply_recheck_s`` (1.0 s,
    the default); these prompts are watched at once, else one cancelled where it waits (after
    ``GONE_GRACE_S``) would leave its task on the bus, computed for nobody."""
    rig = await make_rig(reply_recheck_s=reply_recheck_s)  # no worker: "a" waits on the bus
    refusing = asyncio.ensure_future(
        rig.client.post("/v1/completions", json={"model": "echo", "prompt": ["a", "fail: the model raises"]})
    )
    await eventually(lambda: rig.produced() == 2, "both prompts on the bus")
    requests = [request for records in rig.bus.log.records for request in records]
    failing = next(request for request in requests if request.input.startswith("fail:"))
    failed = TaskState(
        failing.task_id,
        TaskStatus.FAILED,
        failing.model,
        int(time.time() * 1000),
        failing.enqueued_at_ms,
        error_code="backend_error",
        error_message="the model raised",
        reply_to=failing.reply_to,
    )
    await rig.store.apply([failed])  # the model failed "fail:...", as a worker reports it
    refused = await refusing
    assert refused.status_code == 502, refused.text
    waiting = next(request for request in requests if request.input == "a")
    state = await rig.store.get(waiting.task_id)
    assert state is not None and state.status is TaskStatus.CANCELLED, state
    assert rig.gateway.inflight == 0


@pytest.mark.parametrize(("route", "field"), [("embeddings", "input"), ("completions", "prompt")])
@pytest.mark.parametrize(("bad", "status"), [("", 422), ("x" * 70_000, 413)], ids=["empty", "too long"])
async def test_a_request_with_a_string_refused_for_itself_leaves_nothing_behind(
    make_rig: RigFactory, route: str, field: str, bad: str, status: int
) -> None:
    """As a single request refused for its input (docs/operations.md, "Errors"): no string of it was
    queued, whatever the deployment's admission checks (none here: no queue read, no rate limit), so
    none is stored, produced, or computed for a caller who got its refusal."""
    rig = await make_rig()
    refused = await rig.client.post(f"/v1/{route}", json={"model": "echo", field: ["a", "b", bad]})
    assert refused.status_code == (400 if status == 422 else status), refused.text
    assert rig.produced() == 0, "a string of a refused request reached the bus"
    assert rig.store.created == [], "a string of a refused request was stored"


async def test_a_stream_whose_client_left_before_its_first_chunk_cancels_its_prompts(make_rig: RigFactory) -> None:
    rig = await make_rig(reply_recheck_s=0.1)  # no worker: the prompts wait
    body = json.dumps({"model": "sim", "prompt": ["a", "b", "c"], "stream": True}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, object]:
        return messages.pop() if messages else {"type": "http.disconnect"}  # the client has gone

    async def send(message: object) -> None:
        return None

    scope = http_scope("POST", "/v1/completions", headers=[(b"content-type", b"application/json")])
    await asyncio.wait_for(rig.app(scope, receive, send), 5)
    assert rig.gateway.inflight == 0, "the prompts give back their slots"
    for request in [request for records in rig.bus.log.records for request in records]:
        state = await rig.store.get(request.task_id)
        assert state is not None and state.status is TaskStatus.CANCELLED, state
