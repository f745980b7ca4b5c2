"""A Kafka deployment over a Redis Cluster of three primaries, each with a replica (``replicated_cluster``):
two gateways, a batcher and two sim workers, every Redis transport routed by its keys' slots.

The three ways to get an answer, a task polled and streamed from the other gateway, a retry with the
same Idempotency-Key answered from the first computation, an answer cached by one gateway served by
the other, and a high-priority request. No process waits for replicas over a
cluster yet, so the batchers and workers run with ``--redis-min-replicas 0``; without it they stop at
start saying so.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.processes import Cluster, launch, metric, stopped_after

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(180)]

SETTINGS = {
    "BATCHWIRE_DETERMINISTIC_MODELS": "sim",  # its answers are cached, in the cluster
    "BATCHWIRE_CACHE_TTL_S": "60",
}


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, infra: Any, replicated_cluster: Any, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    """One deployment for the module's tests: each uses inputs and keys of its own."""
    base = tmp_path_factory.mktemp("cluster-deployment")
    started = launch(base, infra.kafka_bootstrap, replicated_cluster.url, gateways=2, workers=2, extra_env=SETTINGS)
    with stopped_after(request, started) as cluster:
        yield cluster


def test_the_three_ways_and_both_gateways_answer_over_the_cluster(deployment: Cluster) -> None:
    first, second = deployment.gateway_urls
    with httpx.Client(timeout=30) as client:
        answers = [client.post(f"{first}/v1/inference", json={"input": f"sync-{n}"}) for n in range(20)]
        assert [a.status_code for a in answers] == [200] * 20, [a.text for a in answers if a.status_code != 200]
        assert [a.json()["output"] for a in answers] == [f"sync-{n}"[::-1] for n in range(20)]

        task_ids = [client.post(f"{first}/v1/tasks", json={"input": f"task-{n}"}).json()["task_id"] for n in range(20)]
        for n, task_id in enumerate(task_ids):  # over as many slots, and primaries, as tasks
            done = client.get(f"{second}/v1/result/{task_id}", params={"wait": "20"}).json()
            assert (done["status"], done["output"]) == ("completed", f"task-{n}"[::-1]), done

        streamed = client.post(f"{second}/v1/tasks", json={"input": "streamed"}).json()["task_id"]
        with client.stream("GET", f"{first}/v1/result/{streamed}/events") as events:
            lines = [line for line in events.iter_lines() if line.startswith("event: ")]
        assert lines[-1] == "event: completed", lines


def test_a_retry_with_the_same_key_is_answered_from_the_first_computation(deployment: Cluster) -> None:
    first, second = deployment.gateway_urls
    headers = {"Idempotency-Key": "cluster-retry-1"}
    with httpx.Client(timeout=30) as client:
        answer = client.post(f"{first}/v1/inference", json={"input": "once"}, headers=headers)
        again = client.post(f"{second}/v1/inference", json={"input": "once"}, headers=headers)
    assert answer.status_code == again.status_code == 200, (answer.text, again.text)
    assert again.json()["task_id"] == answer.json()["task_id"], "one task behind both answers"
    assert again.json()["output"] == "ecno"


def test_an_answer_one_gateway_cached_is_served_by_the_other_and_priority_is_taken(deployment: Cluster) -> None:
    first, second = deployment.gateway_urls
    with httpx.Client(timeout=30) as client:
        computed = client.post(f"{first}/v1/inference", json={"input": "cached"})
        assert computed.status_code == 200, computed.text
        served = client.post(f"{second}/v1/inference", json={"input": "cached"})
        urgent = client.post(f"{second}/v1/inference", json={"input": "urgent", "priority": "high"})
    hits = metric(int(second.rsplit(":", 1)[1]), "batchwire_cache_hits_total")
    assert served.status_code == 200 and served.json()["output"] == "dehcac", served.text
    assert hits == 1, f"the second gateway answered from the cache: {hits} hits"
    assert urgent.status_code == 200 and urgent.json()["output"] == "tnegru", urgent.text
