"""One client cannot hold every long-poll and stream slot: each client has a share of ``--max-watchers``.

A real ``batchwire up``; the clients come from distinct loopback addresses (127.0.0.2, 127.0.0.3),
so the gateway sees two peers, as it would see two hosts.
"""

from __future__ import annotations

import contextlib

import httpx
import pytest

from tests.support.adversarial_rig import ServiceFactory

pytestmark = pytest.mark.slow

SHARE = 4
HOG = "127.0.0.2"
OTHER = "127.0.0.3"


def client_at(url: str, address: str) -> httpx.Client:
    return httpx.Client(base_url=url, transport=httpx.HTTPTransport(local_address=address), timeout=30)


def test_a_client_holding_its_share_of_streams_leaves_the_others_served(
    embedded_service_factory: ServiceFactory,
) -> None:
    # A 3 s call: the task stays open while the hog holds its streams on it.
    service = embedded_service_factory(
        "--max-watchers", "100", "--max-watchers-per-client", str(SHARE), sim_latency_ms=3000.0
    )
    with client_at(service.url, HOG) as hog, client_at(service.url, OTHER) as other, contextlib.ExitStack() as held:
        task_id = hog.post("/v1/tasks", json={"input": "slow"}).json()["task_id"]
        lines = []  # each stream's line iterator, kept: a dropped one closes its stream
        for _ in range(SHARE):
            stream = held.enter_context(hog.stream("GET", f"/v1/result/{task_id}/events"))
            assert stream.status_code == 200, stream.read()
            lines.append(stream.iter_lines())
            next(lines[-1])  # the first event: the stream is open and counted
        refused = hog.get(f"/v1/result/{task_id}/events")
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "overloaded" and refused.headers["retry-after"], refused.text
        assert "BATCHWIRE_MAX_WATCHERS_PER_CLIENT" in refused.json()["error"]["message"], refused.text
        over_poll = hog.get(f"/v1/result/{task_id}", params={"wait": 10})
        assert over_poll.status_code == 503, f"a long-poll counts against the same share: {over_poll.text}"

        served = other.get(f"/v1/result/{task_id}", params={"wait": 20})
        assert served.status_code == 200 and served.json()["status"] == "completed", served.text
        assert served.json()["output"] == "wols"
