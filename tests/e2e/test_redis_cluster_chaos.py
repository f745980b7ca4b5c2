"""A Redis Cluster primary killed with SIGKILL under 300 requests/s.

A cluster of its own (three primaries, each with a replica: ``LocalRedisCluster``) and the session's
Kafka carry two gateways, a batcher and two sim workers; the batcher and the workers count each
primary's replica and wait for it (``WAIT`` per primary) before they commit. The chaos client
(``tests.e2e.chaos_client``, its own process) sends synchronous requests and async tasks over both
gateways for ``LOAD_S``, each with an Idempotency-Key, and sends a 503 again after its Retry-After
with the same key. At ``KILL_AT_S`` the primary that holds the first gateway's reply channel is
killed; its replica takes over after the node timeout, and the old primary comes back (as a replica)
at ``RESTART_AT_S``.

Asserts that every request ends with its own answer, none is answered twice, every answered task
reads back completed afterwards, and that the only refusals are 503 with Retry-After.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from infra.redis_cluster import LocalRedisCluster
from infra.redis_server import RedisServer
from schemas.wire import Names
from tests.e2e import chaos_client
from tests.support.eventually import eventually_sync
from tests.support.processes import Cluster, launch, stopped_after

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(300)]

SYNC_RATE_PER_S = 280.0
ASYNC_RATE_PER_S = 20.0
LOAD_S = 10.0
KILL_AT_S = 2.5
RESTART_AT_S = 8.0
ALLOWED_REFUSALS = frozenset({"unavailable", "overloaded"})
"""What the failover may cost a request: a 503 with Retry-After, and a retry. ``overloaded`` too: the
queue that builds while the writes of one shard wait for its new primary is shed by admission."""
FAILOVER_DEADLINE_S = 30.0


@dataclass
class Deployment:
    redis: LocalRedisCluster
    cluster: Cluster


@pytest.fixture
def deployment(tmp_path: Path, infra: Any, request: pytest.FixtureRequest) -> Iterator[Deployment]:
    with LocalRedisCluster(tmp_path / "redis", replicas=1) as redis_cluster:
        started = launch(tmp_path, infra.kafka_bootstrap, redis_cluster.url, gateways=2, workers=2)
        with stopped_after(request, started) as cluster:
            yield Deployment(redis_cluster, cluster)


def _primary_port(nodes: list[RedisServer], slot: int) -> int:
    """The port of the node that serves ``slot`` as a primary, by the first running node's slot map."""
    running = next(node for node in nodes if node.is_running())
    with redis.RedisCluster(host="127.0.0.1", port=running.port) as client:
        return int(client.nodes_manager.get_node_from_slot(slot).port)


def _served_by_another(nodes: list[RedisServer], slot: int, dead: RedisServer) -> bool:
    """The cluster is whole again, with ``slot`` served by a node other than ``dead``."""
    alive = next(node for node in nodes if node is not dead)
    with redis.Redis(port=alive.port) as client:
        if client.cluster("INFO").get("cluster_state") != "ok":
            return False
    return _primary_port([alive], slot) != dead.port


@dataclass
class Fault:
    port: int = 0
    killed_s: float = math.nan
    promoted_s: float = math.nan
    back_s: float = math.nan


def test_a_primary_killed_under_300_requests_per_s_loses_nothing(deployment: Deployment, tmp_path: Path) -> None:
    cluster, nodes = deployment.cluster, deployment.redis.nodes
    reply_slot = key_slot(Names(cluster.namespace).reply_channel("gw0").encode())
    out, t0_file = tmp_path / "client.json", tmp_path / "t0"
    client_log = (tmp_path / "client.log").open("wb")
    client = chaos_client.spawn(
        cluster.gateway_urls,
        sync_rate=SYNC_RATE_PER_S,
        async_rate=ASYNC_RATE_PER_S,
        duration_s=LOAD_S,
        out=out,
        t0_file=t0_file,
        log=client_log,
    )
    fault = Fault()
    try:
        eventually_sync(
            lambda: t0_file.exists() and t0_file.read_text() != "", "the client to start its load", timeout_s=30
        )
        t0 = float(t0_file.read_text())
        victim = next(node for node in nodes if node.port == _primary_port(nodes, reply_slot))
        fault.port = victim.port
        time.sleep(max(0.0, t0 + KILL_AT_S - time.monotonic()))  # the fault schedule, not a synchronisation
        fault.killed_s = time.monotonic() - t0
        victim.kill()
        eventually_sync(
            lambda: _served_by_another(nodes, reply_slot, victim),
            "the replica to take over the killed primary's slots",
            timeout_s=FAILOVER_DEADLINE_S,
            interval_s=0.1,
        )
        fault.promoted_s = time.monotonic() - t0
        time.sleep(max(0.0, t0 + RESTART_AT_S - time.monotonic()))  # the fault schedule
        victim.start()  # it rejoins as the new primary's replica
        fault.back_s = time.monotonic() - t0
        code = client.wait(240)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(10)
        client_log.close()
    client_tail = (tmp_path / "client.log").read_text(errors="replace")[-3000:]
    assert code == 0, f"the client exited {code}:\n{client_tail}"
    report, failures = judge(json.loads(out.read_text()), fault)
    text = "\nREDIS-CLUSTER " + "\nREDIS-CLUSTER ".join(report)
    print(text)
    assert not failures, "\n".join(failures) + text


def judge(result: dict[str, Any], fault: Fault) -> tuple[list[str], list[str]]:
    """The report's lines, and what broke the promise (empty when nothing did)."""
    records: list[dict[str, Any]] = result["records"]
    checked = chaos_client.verdict(result, ALLOWED_REFUSALS)
    failures = checked.failures()
    lost, refusals, twice, missing = checked.lost, checked.refusals, checked.twice, checked.missing
    load_s = result["load_end_s"]
    refused_at = sorted(a["at_s"] + a["took_s"] for a in refusals)
    lines = [
        f"client: {len(records)} requests ({len(records) / load_s:.0f}/s offered, "
        f"{SYNC_RATE_PER_S + ASYNC_RATE_PER_S:.0f}/s asked) over {load_s:.1f} s; client CPU {result['cpu_s']:.1f} s",
        f"fault: kill -9 of the primary on port {fault.port} at {fault.killed_s:.1f} s, its replica serves its slots "
        f"by {fault.promoted_s:.1f} s, the old primary back as a replica at {fault.back_s:.1f} s",
        f"outcome: {len(records) - len(lost)} of {len(records)} ended with their own answer; {len(twice)} answered "
        f"twice; {len(missing)} results missing afterwards",
        f"refusals: {len(refusals)} ({dict(Counter(a['code'] for a in refusals))})"
        + (f", from {refused_at[0]:.2f} s to {refused_at[-1]:.2f} s" if refused_at else ""),
    ]
    return lines, failures
