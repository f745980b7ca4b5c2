"""A Redis Cluster scaled out while it serves: a primary added and a share of the slots moved to it.

A cluster of its own (three primaries, each with a replica: ``LocalRedisCluster``) and the session's
Kafka carry two gateways, a batcher and two sim workers. The chaos client (``tests.e2e.chaos_client``)
sends synchronous requests and async tasks (long-polled on the other gateway) over both gateways, and
this test streams tasks (SSE) meanwhile. Once the load runs, a fourth primary and its replica join
(``redis-cli --cluster add-node``); the slots of the credit pool (whose claims block on it) and of
both gateways' reply channels move to it first, then ``redis-cli --cluster rebalance
--cluster-use-empty-masters`` moves a quarter of all, key by key (``MIGRATE``): commands on a
migrating slot answer ASK or TRYAGAIN, and a node ends the shard subscriptions of a slot that leaves it.

Asserts that every request ends with its own answer, none is answered twice, every answered task
reads back completed afterwards, every stream ends ``completed`` with its own output, no request is
refused ``unavailable`` (the gateways stay ready), and no answer waits for a recheck instead of its
reply.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from redis.crc import key_slot

from infra.ports import LOOPBACK
from infra.redis_cluster import LocalRedisCluster
from infra.redis_server import RedisServer
from schemas.wire import Names
from tests.e2e import chaos_client
from tests.support.eventually import eventually_sync
from tests.support.processes import Cluster, launch, stopped_after

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(300)]

SYNC_RATE_PER_S = 50.0
ASYNC_RATE_PER_S = 10.0
LOAD_S = 30.0
SCALE_AT_S = 2.0
STREAMS = 3
"""Threads that each stream one task at a time for the whole load, and until the slots moved."""
RECHECK_S = 10.0
"""The gateways' reply and stream rechecks, so that a caller whose reply or event was lost waits
this long, which stands out from every quiet answer (a batch's sim latency and batching)."""
SLOW_S = RECHECK_S / 2
SCALE_DEADLINE_S = 120.0
ALLOWED_REFUSALS = frozenset({"overloaded"})
"""A 503 with Retry-After that admission may shed on a busy machine. Not ``unavailable``: the slots
move between live primaries, and the gateways stay ready meanwhile."""


@dataclass
class Deployment:
    redis: LocalRedisCluster
    joining: list[RedisServer]
    """The primary, then its replica, to add."""
    cluster: Cluster


@pytest.fixture
def deployment(tmp_path: Path, infra: Any, request: pytest.FixtureRequest) -> Iterator[Deployment]:
    joining = [RedisServer(tmp_path / "redis" / f"join-{index}", cluster=True) for index in range(2)]
    with LocalRedisCluster(tmp_path / "redis", replicas=1) as redis_cluster:
        try:
            for node in joining:
                node.start()
            rechecks = ("--reply-recheck-s", str(RECHECK_S), "--stream-recheck-s", str(RECHECK_S))
            started = launch(
                tmp_path, infra.kafka_bootstrap, redis_cluster.url, gateways=2, workers=2, gateway_args=rechecks
            )
            with stopped_after(request, started) as cluster:
                yield Deployment(redis_cluster, joining, cluster)
        finally:
            for node in joining:
                node.stop()


def _cli(*args: str, timeout_s: float = SCALE_DEADLINE_S) -> str:
    cli = shutil.which("redis-cli")
    assert cli is not None, "redis-cli is not installed"
    done = subprocess.run([cli, *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0, f"redis-cli {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout


def _agree(entry: str) -> bool:
    """Whether ``redis-cli --cluster check`` finds every node agreeing on who serves each slot."""
    cli = shutil.which("redis-cli")
    assert cli is not None, "redis-cli is not installed"
    done = subprocess.run([cli, "--cluster", "check", entry], capture_output=True, text=True, timeout=30, check=False)
    return done.returncode == 0 and "All nodes agree about slots configuration" in done.stdout


def _node_id(port: int) -> str:
    with redis.Redis(port=port, decode_responses=True) as client:
        return str(client.execute_command("CLUSTER", "MYID"))


def _known_by_all(ports: list[int], node_id: str) -> bool:
    """Every node on ``ports`` lists ``node_id`` in its view of the cluster."""
    for port in ports:
        with redis.Redis(port=port, decode_responses=True) as client:
            if node_id not in str(client.execute_command("CLUSTER", "NODES")):
                return False
    return True


def _whole(port: int) -> bool:
    """The node on ``port`` sees every slot served (a node that does not refuses a ``MIGRATE`` to it)."""
    with redis.Redis(port=port, decode_responses=True) as client:
        return client.cluster("INFO").get("cluster_state") == "ok"


def _has_online_replica(port: int) -> bool:
    with redis.Redis(port=port) as client:
        info = client.info("replication")
    replica = info.get("slave0")
    return isinstance(replica, dict) and replica.get("state") == "online"


def _slots_of(port: int, node_id: str) -> int:
    """How many slots ``node_id`` serves, by the view of the node on ``port``."""
    with redis.Redis(port=port, decode_responses=True) as client:
        for line in str(client.execute_command("CLUSTER", "NODES")).splitlines():
            fields = line.split()
            if fields[0] == node_id:
                return sum(_count(spec) for spec in fields[8:] if not spec.startswith("["))
    return 0


def _count(spec: str) -> int:
    first, _, last = spec.partition("-")
    return int(last or first) - int(first) + 1


@dataclass
class ScaleOut:
    started_s: float = 0.0
    moving_s: float = 0.0
    done_s: float = 0.0
    slots_moved: int = 0


def _owner_port(port: int, slot: int) -> int:
    """The port of the primary that serves ``slot``, by the view of the node on ``port``."""
    with redis.RedisCluster(host=LOOPBACK, port=port) as client:
        return int(client.nodes_manager.get_node_from_slot(slot).port)


def migrate_slot(primaries: list[int], slot: int, source: int, target: int) -> None:
    """Moves ``slot`` with its keys from the primary on ``source`` to the one on ``target`` as
    ``redis-cli --cluster reshard`` moves each slot: importing and migrating, the keys ``MIGRATE``d in
    rounds, then the new owner told to the target, the source and every other primary."""
    source_client, target_client = redis.Redis(port=source), redis.Redis(port=target)
    with source_client, target_client:
        source_id = source_client.execute_command("CLUSTER", "MYID").decode()
        target_id = target_client.execute_command("CLUSTER", "MYID").decode()
        target_client.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        source_client.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        while keys := source_client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10):
            source_client.migrate(LOOPBACK, target, keys, 0, 5000)
    for port in sorted(primaries, key=lambda port: (port != target, port != source)):
        with redis.Redis(port=port) as client:
            client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)


def scale_out(deployment: Deployment, t0: float, record: ScaleOut) -> None:
    """Adds the joining primary and its replica, then moves a share of the slots to the primary: first
    the slots of the keys every request goes through (the credit pool, whose claims block on it, the
    fleet registry and each gateway's reply channel), then a quarter of all by ``redis-cli --cluster
    rebalance``."""
    ports = [node.port for node in deployment.redis.nodes]
    primary, replica = deployment.joining
    entry = f"{LOOPBACK}:{ports[0]}"
    record.started_s = time.monotonic() - t0
    _cli("--cluster", "add-node", f"{LOOPBACK}:{primary.port}", entry)
    primary_id = _node_id(primary.port)
    with redis.Redis(port=primary.port) as client:  # its replica's first copy starts at once, not 5 s later
        client.config_set("repl-diskless-sync-delay", 0)
    eventually_sync(lambda: _known_by_all(ports, primary_id), "every node to know the new primary", timeout_s=30)
    _cli(
        "--cluster",
        "add-node",
        f"{LOOPBACK}:{replica.port}",
        entry,
        "--cluster-slave",
        "--cluster-master-id",
        primary_id,
    )
    # Slots move once the replica holds its first copy: until then a write that waits for a replica
    # (--redis-min-replicas) on the new primary waits its whole --redis-replica-wait-ms.
    eventually_sync(lambda: _has_online_replica(primary.port), "the new primary's replica to sync", timeout_s=60)
    eventually_sync(lambda: _whole(primary.port), "the new primary to see every slot served", timeout_s=30)
    record.moving_s = time.monotonic() - t0
    names = Names(deployment.cluster.namespace)
    hot = {names.credit_queue("sim"), names.fleet, *(names.reply_channel(f"gw{n}") for n in range(2))}
    primaries = [*deployment.redis.primary_ports(), primary.port]
    for slot in sorted({key_slot(key.encode()) for key in hot}):
        migrate_slot(primaries, slot, _owner_port(ports[0], slot), primary.port)
    # redis-cli refuses to rebalance a cluster whose nodes have not all heard of those moves yet.
    eventually_sync(lambda: _agree(entry), "every node to agree on the slots moved by hand", timeout_s=30)
    _cli("--cluster", "rebalance", entry, "--cluster-use-empty-masters", "--cluster-pipeline", "20")
    record.done_s = time.monotonic() - t0
    record.slots_moved = _slots_of(ports[0], primary_id)


@dataclass
class Stream:
    input: str
    started_s: float
    took_s: float = 0.0
    events: list[str] = field(default_factory=list)
    output: str | None = None
    error: str | None = None


def stream_tasks(gateways: list[str], stop: threading.Event, t0: float, tag: str, out: list[Stream]) -> None:
    """Submits a task on the first gateway and streams its events on the second, one at a time."""
    n = 0
    with httpx.Client(timeout=40) as client:
        while not stop.is_set():
            stream = Stream(f"sse-{tag}-{n}", time.monotonic() - t0)
            n += 1
            out.append(stream)
            try:
                accepted = client.post(f"{gateways[0]}/v1/tasks", json={"input": stream.input})
                if accepted.status_code != 202:
                    stream.error = f"submit answered {accepted.status_code}: {accepted.text[:200]}"
                    continue
                task_id = accepted.json()["task_id"]
                with client.stream("GET", f"{gateways[1]}/v1/result/{task_id}/events") as events:
                    event = ""
                    for line in events.iter_lines():
                        if line.startswith("event: "):
                            event = line.removeprefix("event: ")
                            stream.events.append(event)
                        elif line.startswith("data: ") and event == "completed":
                            stream.output = json.loads(line.removeprefix("data: ")).get("output")
            except httpx.HTTPError as err:
                stream.error = f"{type(err).__name__}: {err}"
            finally:
                stream.took_s = time.monotonic() - t0 - stream.started_s


def test_a_primary_added_and_slots_moved_to_it_under_load_lose_nothing(deployment: Deployment, tmp_path: Path) -> None:
    cluster = deployment.cluster
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
    scaled = ScaleOut()
    streams: list[Stream] = []
    stop = threading.Event()
    streamers: list[threading.Thread] = []
    try:
        eventually_sync(
            lambda: t0_file.exists() and t0_file.read_text() != "", "the client to start its load", timeout_s=30
        )
        t0 = float(t0_file.read_text())
        streamers += [
            threading.Thread(target=stream_tasks, args=(cluster.gateway_urls, stop, t0, str(i), streams))
            for i in range(STREAMS)
        ]
        for streamer in streamers:
            streamer.start()
        time.sleep(max(0.0, t0 + SCALE_AT_S - time.monotonic()))  # the schedule, not a synchronisation
        scale_out(deployment, t0, scaled)
        time.sleep(max(0.0, t0 + LOAD_S - time.monotonic()))  # the streams' schedule: the load's length at least
        stop.set()
        code = client.wait(240)
    finally:
        stop.set()
        for streamer in streamers:
            streamer.join(60)
        if client.poll() is None:
            client.kill()
            client.wait(10)
        client_log.close()
    client_tail = (tmp_path / "client.log").read_text(errors="replace")[-3000:]
    assert code == 0, f"the client exited {code}:\n{client_tail}"
    report, failures = judge(json.loads(out.read_text()), streams, scaled)
    text = "\nRESHARD " + "\nRESHARD ".join(report)
    print(text)
    assert scaled.slots_moved >= 16384 // 4 - 100, f"the new primary serves {scaled.slots_moved} slots" + text
    assert scaled.moving_s < LOAD_S - 5, "the slots moved while the client's load ran" + text
    assert not failures, "\n".join(failures) + text


def judge(result: dict[str, Any], streams: list[Stream], scaled: ScaleOut) -> tuple[list[str], list[str]]:
    """The report's lines, and what broke the promise (empty when nothing did)."""
    records: list[dict[str, Any]] = result["records"]
    checked = chaos_client.verdict(result, ALLOWED_REFUSALS)
    failures = checked.failures()
    lost, refusals, twice, missing = checked.lost, checked.refusals, checked.twice, checked.missing
    bad_streams = [s for s in streams if s.events[-1:] != ["completed"] or s.output != s.input[::-1]]
    if bad_streams:
        failures.append(f"{len(bad_streams)} of {len(streams)} streams did not end completed, e.g.: {bad_streams[:3]}")
    waits = sorted(
        [r["done_s"] - r["sent_s"] for r in records if chaos_client.succeeded(r)]
        + [s.took_s for s in streams if s.output is not None]
    )
    slow = [w for w in waits if w > SLOW_S]
    if slow:
        failures.append(f"{len(slow)} answers took over {SLOW_S} s (a recheck, not the reply): {slow[:10]}")
    lines = [
        f"client: {len(records)} requests and {len(streams)} streams over {result['load_end_s']:.1f} s",
        f"scale-out: add-node at {scaled.started_s:.1f} s, slots moving from {scaled.moving_s:.1f} s to "
        f"{scaled.done_s:.1f} s, {scaled.slots_moved} slots on the new primary",
        f"outcome: {len(records) - len(lost)} of {len(records)} ended with their own answer; {len(twice)} answered "
        f"twice; {len(missing)} results missing afterwards; {len(streams) - len(bad_streams)} streams completed",
        f"refusals: {len(refusals)} ({dict(Counter((a['status'], a['code']) for a in refusals))})",
        "answer waits: "
        + (f"median {waits[len(waits) // 2]:.2f} s, p99 {waits[int(len(waits) * 0.99)]:.2f} s, max {waits[-1]:.2f} s"),
    ]
    return lines, failures
