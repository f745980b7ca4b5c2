"""The load a deployment puts on its Sentinels: each process asks them for the primary once a round
(``FOLLOW_INTERVAL_S``), however many Redis pools it has (``PrimaryFollower``, one per process)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.support.processes import launch, stopped_after
from tests.support.sentinels import SentinelCluster
from transport.redis.sentinel import FOLLOW_INTERVAL_S

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(120)]

WINDOW_S = 5.0
"""How long the Sentinel's commands are counted."""
PROCESSES = 3
PER_PROCESS_LIMIT = 1.5 / FOLLOW_INTERVAL_S
"""A process's follower asks once a round; the slack covers a connection opened, or a replica count
confirmed, in the window."""


@pytest.fixture(scope="module")
def lone_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelCluster]:
    """A primary watched by one Sentinel: it hears no other Sentinel, so every command it counts is a role's."""
    servers = SentinelCluster(Path(tmp_path_factory.mktemp("sentinel")), replicas=0, sentinels=1)
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()


def _commands(sentinel: redis.Redis) -> int:
    """Commands the Sentinel has processed (an INFO is counted once it has answered)."""
    return int(sentinel.info("stats")["total_commands_processed"])


def test_each_process_asks_the_sentinels_once_a_round(
    lone_sentinel: SentinelCluster, tmp_path: Path, request: pytest.FixtureRequest, infra: Any
) -> None:
    cluster = launch(tmp_path, infra.kafka_bootstrap, lone_sentinel.url, gateways=1, batchers=1, workers=1)
    with stopped_after(request, cluster):
        # One request opens the pools each role uses to serve it (store, change feed, credits, deliveries).
        answer = httpx.post(f"{cluster.gateway_urls[0]}/v1/inference", json={"input": "hello"}, timeout=30)
        assert answer.status_code == 200, answer.text
        with redis.Redis(port=lone_sentinel.sentinel_ports[0], socket_timeout=5) as sentinel:
            before, started = _commands(sentinel), time.monotonic()
            time.sleep(WINDOW_S)  # the window counted, not a wait for a condition
            after, elapsed_s = _commands(sentinel) - 1, time.monotonic() - started  # less the first INFO
    rate = (after - before) / elapsed_s
    limit = PROCESSES * PER_PROCESS_LIMIT
    assert rate <= limit, (
        f"a gateway, a batcher and a worker sent the Sentinel {rate:.1f} commands a second over {elapsed_s:.1f} s; "
        f"expected at most {limit:g} (one lookup every {FOLLOW_INTERVAL_S:g} s per process, with slack)"
    )
