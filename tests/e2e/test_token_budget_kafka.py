"""The token budget and priority tiers over Kafka and Redis: gateways, a batcher and a worker as processes.

Gateway and batcher share ``--max-batch-tokens``: no batch the worker runs pads past it, an input over
it is refused 413 at the gateway, and a ``high`` request overtakes the ``low`` ones queued before it. A
second gateway without the budget admits an input over it: the batcher runs it alone and logs it once.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.eventually import eventually_sync
from tests.support.processes import Cluster, launch

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(180)]

BUDGET = 64
MAX_BATCH = 4
LOWS = 40


def tokens(text: str) -> int:
    """The gateways' and the batcher's count without a tokenizer (``batcher.tokens.estimated``)."""
    return max(1, math.ceil(len(text.encode()) / 4))


@pytest.fixture
def cluster(tmp_path: Path, infra: Any, clusters: list[Cluster]) -> Cluster:
    budget = ("--max-batch-tokens", str(BUDGET))
    started = launch(
        tmp_path,
        infra.kafka_bootstrap,
        infra.redis_url,
        workers=1,
        sim_latency_ms=300,
        gateway_args=budget,
        batcher_args=(*budget, "--max-batch", str(MAX_BATCH)),
    )
    clusters.append(started)
    started.gateway(1)  # without the budget
    return started


def test_batches_keep_the_budget_an_input_over_it_is_refused_and_high_overtakes_low(cluster: Cluster) -> None:
    url = cluster.gateway_urls[0]
    with httpx.Client(timeout=60) as client:
        over = client.post(f"{url}/v1/inference", json={"input": "y" * (4 * BUDGET + 4)})
        assert over.status_code == 413 and over.json()["error"]["code"] == "input_over_token_budget", over.text

        inputs = [f"{n:02d}-" + "x" * size for n, size in enumerate([1, 17, 37, 97, 197, 250] * 5)]
        with ThreadPoolExecutor(len(inputs)) as pool:
            answers = list(pool.map(lambda text: client.post(f"{url}/v1/inference", json={"input": text}), inputs))
        texts = {}
        for text, answer in zip(inputs, answers, strict=True):
            assert answer.status_code == 200 and answer.json()["output"] == text[::-1], answer.text
            texts[answer.json()["task_id"]] = text
        # The worker records a batch once it ran, which may be after its answers went out.
        eventually_sync(
            lambda: {task for batch in cluster.journal() for task in batch["task_ids"]} >= set(texts),
            "every batch in the worker's journal",
        )
        ran = [[texts[task] for task in batch["task_ids"]] for batch in cluster.journal()]
        for batch in ran:
            padded = len(batch) * max(map(tokens, batch))
            assert padded <= BUDGET, f"a batch of {len(batch)} pads to {padded} tokens, past {BUDGET}: {batch}"
        assert sorted(text for batch in ran for text in batch) == sorted(inputs), "each input ran once"

        def queue_low(n: int) -> str:
            queued = client.post(f"{url}/v1/tasks", json={"input": f"low-{n:03d}".ljust(40, "."), "priority": "low"})
            assert queued.status_code == 202, queued.text
            return str(queued.json()["task_id"])

        with ThreadPoolExecutor(LOWS) as pool:
            lows = set(pool.map(queue_low, range(LOWS)))
        high = client.post(f"{url}/v1/inference", json={"input": "high".ljust(40, "."), "priority": "high"})
        assert high.status_code == 200, high.text
        for task in lows:
            finished = client.get(f"{url}/v1/result/{task}", params={"wait": 30}).json()
            assert finished["status"] == "completed", finished
        eventually_sync(
            lambda: {task for batch in cluster.journal() for task in batch["task_ids"]} >= lows,
            "every low batch in the worker's journal",
        )
        order = [task for batch in cluster.journal() for task in batch["task_ids"]]  # as the one worker ran them
        after = len(lows & set(order[order.index(high.json()["task_id"]) :]))
        # In FIFO order none would: the lows were all queued before the high was sent (LOWS / MAX_BATCH
        # batches of work, and at most the batches in hand or sealed when it came run before it).
        assert after >= MAX_BATCH, f"{after} of {LOWS} lows queued before the high request ran after it"


def test_a_gateway_without_the_budget_admits_an_input_over_it_which_runs_alone_and_is_logged(
    cluster: Cluster,
) -> None:
    url = cluster.gateway_urls[1]
    warning = "over --max-batch-tokens (BATCHWIRE_MAX_BATCH_TOKENS)"
    with httpx.Client(timeout=60) as client:
        for letter in "yz":
            text = letter * (4 * BUDGET + 4)
            answer = client.post(f"{url}/v1/inference", json={"input": text})
            assert answer.status_code == 200 and answer.json()["output"] == text[::-1], answer.text
            assert answer.json()["batch_size"] == 1, "an input over the budget runs alone"
    log = next(proc for proc in cluster.procs if proc.name == "batcher0").log_path
    eventually_sync(lambda: warning in log.read_text(), "the batcher's warning")
    assert log.read_text().count(warning) == 1, "logged once per model"
