"""Gateway processes over the real Kafka and Redis: limits wired through the CLI and shared between gateways."""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.eventually import eventually_sync
from tests.support.processes import Cluster

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]

KEYS = ("process-key-a-0123456789", "process-key-b-0123456789")


@pytest.fixture
def gateways(tmp_path: Path, infra: Any) -> Iterator[Cluster]:
    """Two gateways, no batcher and no worker: nothing leaves the request topic."""
    cluster = Cluster(
        tmp_path,
        infra.kafka_bootstrap,
        infra.redis_url,
        f"gwp{uuid.uuid4().hex[:8]}",
        extra_env={
            "BATCHWIRE_MAX_QUEUE_DEPTH": "3",
            "BATCHWIRE_RATE_LIMIT_PER_S": "0.05",
            "BATCHWIRE_RATE_LIMIT_BURST": "2",
            # no batcher takes anything: the model would read stalled (503) after the default 5 s, which a
            # busy machine can reach before the test's last submit; stalls are tested elsewhere
            "BATCHWIRE_STALL_S": "600",
            # one key as its digest, one as text: both forms work; the first reads /metrics
            "BATCHWIRE_API_KEYS": f"operator sha256:{hashlib.sha256(KEYS[0].encode()).hexdigest()},{KEYS[1]}",
        },
    )
    try:
        cluster.gateway(0)
        cluster.gateway(1)
        yield cluster
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        cluster.stop()


def _lag(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=_auth(KEYS[0]), timeout=5).text
    found = re.search(r"^batchwire_request_topic_lag (\S+)$", text, flags=re.MULTILINE)
    return float(found.group(1)) if found else -1.0


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_limits_and_keys_hold_across_gateway_processes(gateways: Cluster) -> None:
    first, second = gateways.gateway_urls
    for url in (first, second):  # each says where it serves, as the batcher and the worker say they are up
        assert re.search(rf"gateway \S+ on {re.escape(url)}: namespace gwp\w+, models ", gateways.logs()), url
    ready = httpx.get(f"{first}/readyz", timeout=5).json()
    # each part probed once: the transports by their names, no second probe as the gateway's "bus" and "store"
    assert ready["checks"] == {"kafka": True, "redis": True, "queue_depth": True, "gateway": True}, ready
    assert httpx.post(f"{first}/v1/tasks", json={"input": "x"}, timeout=5).status_code == 401

    def submit(url: str, key: str) -> httpx.Response:
        headers = {**_auth(key), "X-Client-Id": "claims-to-be-someone-else"}
        return httpx.post(f"{url}/v1/tasks", json={"input": "x"}, headers=headers, timeout=5)

    # A key is one client whichever gateway it talks to: a burst of 2 across both.
    answers = [submit(url, KEYS[0]) for url in (first, second, first)]
    assert [a.status_code for a in answers] == [202, 202, 429], [a.text for a in answers]
    task_url = answers[0].json()["result_url"]
    assert httpx.get(f"{second}{task_url}", headers=_auth(KEYS[0]), timeout=5).json()["status"] == "queued"
    assert httpx.get(f"{second}{task_url}", headers=_auth(KEYS[1]), timeout=5).status_code == 404
    refused = submit(second, KEYS[0])
    assert refused.status_code == 429, refused.text
    assert "BATCHWIRE_RATE_LIMIT_PER_S" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) >= 1

    # The third request in the deployment (no batcher takes any) fills max_queue_depth = 3.
    assert submit(second, KEYS[1]).status_code == 202
    eventually_sync(lambda: _lag(first) >= 3 and _lag(second) >= 3, "both gateways to see a lag of 3", timeout_s=30)
    full = submit(first, KEYS[1])  # KEYS[1] has a token left: the refusal is the queue's
    assert full.status_code == 503, full.text
    assert full.json()["error"]["code"] == "overloaded"
    assert "BATCHWIRE_MAX_QUEUE_DEPTH" in full.json()["error"]["message"]
