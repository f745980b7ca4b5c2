"""The replicated backbone under load: a Kafka broker and then the Redis primary killed with SIGKILL.

A cluster of its own (`batchwire stack up --brokers 3 --redis-replicas 1`: three KRaft brokers, a
Redis primary with a replica, three Sentinels) carries two gateways, two batchers and three sim
workers. A client in its own process (``tests.e2e.chaos_client``) sends synchronous requests and
async tasks over both gateways for ``LOAD_S``, each with an Idempotency-Key, and sends a 503 again
after its Retry-After with the same key. Faults, from the load's start: the broker that leads the
most request partitions is killed at 10 s and restarted (`stack up`, which restarts only what is
dead) at 20 s; the Redis primary is killed at 26 s and brought back (as a replica) at 34 s.

Asserts that every request ends with its own answer, none is lost, none is answered twice, every
answered task reads back completed afterwards, and that the only refusals are 503 ``unavailable``
with Retry-After (before the first fault, ``overloaded`` too: ``ALLOWED_BEFORE_FAULTS``). Prints the
refusals and their window per fault, p99 before, during and after, and the client's offered rate and
lag and the machine's CPU (vmstat), which tell a load the machine could not carry from a fault the
service did not ride out.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient  # type: ignore[import-untyped, unused-ignore]
from aiokafka.admin.config_resource import (  # type: ignore[import-untyped, unused-ignore]
    ConfigResource,
    ConfigResourceType,
)

from infra.process import ServiceProcess
from infra.redis_sentinel import MASTER_NAME, sentinel_primary
from infra.stack import ENV_FILE_NAME, KAFKA_ENV, REDIS_ENV, read_env_file
from schemas.wire import Names
from tests.e2e import chaos_client
from tests.support.eventually import eventually_sync
from tests.support.processes import Cluster, launch, stopped_after
from tests.support.stack_cli import discard_stack
from tests.support.stack_cli import stack_cli as _cli
from tests.support.trail import trail

# timing: which refusals a fault may cost depends on the machine keeping up with the load, which it
# cannot while other tests share its two cores
pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timing, pytest.mark.timeout(480)]

SYNC_RATE_PER_S = 150.0
ASYNC_RATE_PER_S = 20.0
LOAD_S = 42.0
BROKER_KILL_AT_S = 10.0
BROKER_RESTART_AT_S = 20.0
REDIS_KILL_AT_S = 26.0
REDIS_RESTART_AT_S = 34.0
DURING = (BROKER_KILL_AT_S, REDIS_RESTART_AT_S)
"""Requests sent in this span are "during" the faults; before it "before", after it "after"."""
ALLOWED_REFUSALS = frozenset({"unavailable"})
"""What a fault may cost a request: a 503 ``unavailable`` with Retry-After, and a retry."""
ALLOWED_BEFORE_FAULTS = ALLOWED_REFUSALS | {"overloaded"}
"""Before the first fault, load shedding too: the cluster and the client share two cores, and when the
load starts while the machine is behind, the queue's first drain measure (half a second) can be low
enough that admission refuses a few requests for a second, each answered on its retry."""
SHAPE = ("--brokers", "3", "--redis-replicas", "1")
FAILOVER_DEADLINE_S = 40.0
"""The wait for the Sentinels' promotion: a failover whose vote splits is tried again after twice the
failover timeout (10 s), and on a loaded machine the first try can miss; this covers three tries."""


def _up(state_dir: Path) -> None:
    done = _cli(state_dir, "up", *SHAPE)
    assert done.returncode == 0, f"stack up exited {done.returncode}:\n{done.stderr}"


def _status(state_dir: Path) -> dict[str, Any]:
    done = _cli(state_dir, "status", "--json")
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def _kill9(pid: int) -> float:
    """SIGKILLs ``pid`` and waits for its end; returns when the signal went (monotonic)."""
    process = ServiceProcess.attach(pid, [])
    assert process is not None, f"process {pid} is not running"
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    assert process.wait_exit(10.0), f"process {pid} survived SIGKILL"
    return killed


@dataclass
class Backbone:
    state_dir: Path
    bootstrap: str
    sentinel_url: str
    cluster: Cluster


@pytest.fixture
def backbone(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Backbone]:
    state_dir = tmp_path / "state"
    try:
        _up(state_dir)
        env = read_env_file(state_dir / ENV_FILE_NAME)
        cluster = launch(
            tmp_path, env[KAFKA_ENV], env[REDIS_ENV], gateways=2, batchers=2, workers=3, sim_latency_ms=100
        )
        with stopped_after(request, cluster):
            yield Backbone(state_dir, env[KAFKA_ENV], env[REDIS_ENV], cluster)
    finally:
        discard_stack(state_dir)


async def _replication(bootstrap: str, topics: list[str]) -> dict[str, tuple[set[int], str | None]]:
    """Each topic's replica counts (one per partition) and its min.insync.replicas."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        described = await admin.describe_topics(topics)
        configs = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, t) for t in topics])
    finally:
        await admin.close()
    min_isr = {
        resource[3]: next((entry[1] for entry in resource[4] if entry[0] == "min.insync.replicas"), None)
        for response in configs
        for resource in response.resources
    }
    return {t["topic"]: ({len(p["replicas"]) for p in t["partitions"]}, min_isr[t["topic"]]) for t in described}


@dataclass
class Faults:
    """When each fault happened, seconds from the load's start, and what it hit."""

    broker_node: int = 0
    broker_leads: int = 0
    broker_killed_s: float = math.nan
    broker_back_s: float = math.nan
    redis_port: int = 0
    redis_killed_s: float = math.nan
    failover_s: float = math.nan
    redis_back_s: float = math.nan


def _inject(backbone: Backbone, servers: list[dict[str, Any]], t0: float, request_topic: str) -> Faults:
    """Kills and restarts servers at fixed offsets from ``t0`` (the load's start).

    ``servers`` is ``stack status --json``'s list, read before the load: a status (it asks Kafka)
    or a ``stack up`` can take seconds on a busy machine, and would push the faults off schedule.
    The Redis primary at its fault is the one the Sentinels name then. The broker's restart ends
    before the Redis kill (a slow ``stack up`` delays the kill past its offset): ``stack up``
    restarts every dead server, so a primary killed while it ran would come back instead of
    failing over.
    """
    state_dir = backbone.state_dir
    faults = Faults()

    def at(offset_s: float) -> None:
        time.sleep(max(0.0, t0 + offset_s - time.monotonic()))  # the fault schedule, not a synchronisation

    def now() -> float:
        return time.monotonic() - t0

    brokers = [s for s in servers if s["kind"] == "kafka"]
    victim = max(brokers, key=lambda s: len(s["leads"].get(request_topic, [])))
    faults.broker_node, faults.broker_leads = victim["node_id"], len(victim["leads"].get(request_topic, []))
    redis_pids = {s["port"]: s["pid"] for s in servers if s["kind"] == "redis"}
    sentinels = [s["port"] for s in servers if s["kind"] == "sentinel"]
    at(BROKER_KILL_AT_S)
    faults.broker_killed_s = _kill9(victim["pid"]) - t0

    at(BROKER_RESTART_AT_S)
    _up(state_dir)  # before the Redis kill: `stack up` restarts every dead server, a killed primary too
    faults.broker_back_s = now()
    _fail_over_redis(faults, t0, redis_pids, sentinels)
    at(REDIS_RESTART_AT_S)
    _up(state_dir)  # the old primary rejoins as a replica: the backbone is whole again
    faults.redis_back_s = now()
    return faults


def _fail_over_redis(faults: Faults, t0: float, redis_pids: dict[int, int], sentinels: list[int]) -> None:
    """Kills the Redis primary at ``REDIS_KILL_AT_S`` and waits for the Sentinels to promote the replica."""
    time.sleep(max(0.0, t0 + REDIS_KILL_AT_S - time.monotonic()))  # the fault schedule
    primary = sentinel_primary(sentinels, MASTER_NAME)
    assert primary in redis_pids, f"the Sentinels name the primary {primary}; the servers are {redis_pids}"
    faults.redis_port = primary
    faults.redis_killed_s = _kill9(redis_pids[primary]) - t0
    eventually_sync(
        lambda: sentinel_primary(sentinels, MASTER_NAME) not in (None, primary),
        "the Sentinels to promote the replica",
        timeout_s=FAILOVER_DEADLINE_S,
        interval_s=0.1,
    )
    faults.failover_s = time.monotonic() - t0


def p99(values: list[float]) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def _vmstat_summary(path: Path) -> str:
    """Mean run queue and CPU split over the vmstat samples taken during the test (the first is since boot)."""
    lines = [line.split() for line in path.read_text().splitlines() if line.split()]
    header = next((line for line in lines if line[0] == "r"), None)
    rows = [[float(value) for value in line] for line in lines if line[0].isdigit()][1:]
    if header is None or not rows:
        return "no vmstat samples"
    mean = {name: sum(row[i] for row in rows) / len(rows) for i, name in enumerate(header)}
    least_idle = min(row[header.index("id")] for row in rows)
    return (
        f"{len(rows)} samples: run queue {mean['r']:.1f} on {os.cpu_count()} cores, "
        f"us {mean['us']:.0f}% sy {mean['sy']:.0f}% id {mean['id']:.0f}% wa {mean['wa']:.0f}% "
        f"(least idle sample {least_idle:.0f}%)"
    )


def test_a_broker_and_the_redis_primary_killed_under_load_lose_nothing(backbone: Backbone, tmp_path: Path) -> None:
    cluster = backbone.cluster
    names = Names(cluster.namespace)
    topics = [names.request_topic, names.batch_topic("sim")]
    replication = asyncio.run(_replication(backbone.bootstrap, topics))
    assert replication == {topic: ({3}, "2") for topic in topics}, f"RF 3 and min ISR 2 on 3 brokers: {replication}"

    out, t0_file, vmstat_path = tmp_path / "client.json", tmp_path / "t0", tmp_path / "vmstat.log"
    servers = _status(backbone.state_dir)["servers"]
    client_log = (tmp_path / "client.log").open("wb")
    vmstat_log = vmstat_path.open("wb")
    vmstat = subprocess.Popen(["vmstat", "-n", "5"], stdout=vmstat_log)
    client = chaos_client.spawn(
        cluster.gateway_urls,
        sync_rate=SYNC_RATE_PER_S,
        async_rate=ASYNC_RATE_PER_S,
        duration_s=LOAD_S,
        out=out,
        t0_file=t0_file,
        log=client_log,
    )
    try:
        eventually_sync(
            lambda: t0_file.exists() and t0_file.read_text() != "", "the client to start its load", timeout_s=30
        )
        faults = _inject(backbone, servers, float(t0_file.read_text()), names.request_topic)
        code = client.wait(240)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(10)
        vmstat.terminate()
        vmstat.wait(10)
        client_log.close()
        vmstat_log.close()
    client_tail = (tmp_path / "client.log").read_text(errors="replace")[-3000:]
    assert code == 0, f"the client exited {code}:\n{client_tail}"
    result = json.loads(out.read_text())
    report, failures = judge(result, faults, cluster.journal())
    report.append(f"cpu (vmstat, every 5 s): {_vmstat_summary(vmstat_path)}")
    records = result["records"]
    lost = [a["task_id"] for r in records if not chaos_client.succeeded(r) for a in r["attempts"] if a["task_id"]]
    if lost:  # where their trail ends, read while the cluster still runs
        report.extend(trail(backbone.bootstrap, names, "sim", lost[:8]))
    text = "\nBACKBONE " + "\nBACKBONE ".join(report)
    print(text)
    assert not failures, "\n".join(failures) + text


def judge(result: dict[str, Any], faults: Faults, journal: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The report's lines, and what broke the promise (empty when nothing did)."""
    records: list[dict[str, Any]] = result["records"]
    finals: dict[str, dict[str, Any]] = result["final_reads"]
    failures: list[str] = []

    def show(record: dict[str, Any]) -> str:
        attempts = [(round(a["at_s"], 2), a["status"], a["code"], a["task_id"]) for a in record["attempts"]]
        reads = [(round(a["at_s"], 2), a["status"], a["state"] or a["code"]) for a in record["reads"]]
        named = [a["task_id"] for a in record["attempts"] if a["task_id"]]
        afterwards = {t: (finals[t]["status"], finals[t]["state"] or finals[t]["code"]) for t in named if t in finals}
        return (
            f"{record['kind']} {record['input']} (gateway {record['gateway']}, sent at {record['sent_s']:.2f} s): "
            f"attempts {attempts}" + (f", reads {reads}" if reads else "") + f"; read back at the end: {afterwards}"
        )

    # every request ended with its own answer -------------------------------------------------------
    lost = [r for r in records if not chaos_client.succeeded(r)]
    if lost:
        failures.append(
            f"{len(lost)} requests did not end with their own answer, e.g.:\n  " + "\n  ".join(map(show, lost[:8]))
        )

    # refusals: 503 unavailable with Retry-After (overloaded too before the faults), nothing else ---------
    refusals = [(r, a) for r in records for a in (*r["attempts"], *r["reads"]) if a["status"] not in (200, 202)]

    def allowed(attempt: dict[str, Any]) -> frozenset[str]:
        before = attempt["at_s"] + attempt["took_s"] < faults.broker_killed_s
        return ALLOWED_BEFORE_FAULTS if before else ALLOWED_REFUSALS

    wrong = [(r, a) for r, a in refusals if a["status"] != 503 or a["code"] not in allowed(a) or not a["retry_after"]]
    if wrong:
        kinds = Counter((a["status"], a["code"], bool(a["retry_after"])) for _, a in wrong)
        failures.append(
            f"{len(wrong)} answers other than 503 unavailable (or overloaded before the faults) with Retry-After: "
            f"{dict(kinds)}; e.g.:\n  " + "\n  ".join(show(r) for r, _ in wrong[:5])
        )

    # none answered twice: one task per key (unless a refused one's retry), the same result on every read
    twice: list[str] = []
    recomputed = 0
    recomputed_in_broker_fault: list[str] = []
    for record in records:
        if not chaos_client.succeeded(record):
            continue
        accepted = [a["task_id"] for a in record["attempts"] if a["status"] in (200, 202)]
        if accepted != [record["task_id"]]:
            twice.append(f"{show(record)}: answered by {accepted}")
        reads = [a for a in record["reads"] if a["status"] == 200]
        if any(a["task_id"] != record["task_id"] for a in reads) or any(
            a["state"] == "completed" and a["output"] != record["output"] for a in reads
        ):
            twice.append(f"{show(record)}: its reads name another task or another output")
        for attempt in record["attempts"]:
            refused_id = attempt["task_id"] if attempt["status"] == 503 else None
            done = finals.get(refused_id, {}).get("state") == "completed" if refused_id else False
            if done and refused_id != record["task_id"]:
                recomputed += 1
                if attempt["at_s"] < faults.redis_killed_s:  # Redis is whole: the bus refused it
                    recomputed_in_broker_fault.append(f"{show(record)}: refused task {refused_id} completed")
    if recomputed_in_broker_fault:
        failures.append(
            f"{len(recomputed_in_broker_fault)} requests answered 503 by a bus that did not take them were computed "
            "anyway, and again on their retry:\n  " + "\n  ".join(recomputed_in_broker_fault[:8])
        )
    if twice:
        failures.append(f"{len(twice)} requests answered twice or inconsistently:\n  " + "\n  ".join(twice[:8]))

    # no completed result missing afterwards ----------------------------------------------------------
    missing = [(r, finals.get(r["task_id"])) for r in chaos_client.missing_afterwards(result)]
    if missing:
        failures.append(
            f"{len(missing)} answered tasks do not read back completed with their output afterwards, e.g.:\n  "
            + "\n  ".join(f"{show(r)}; read back: {final}" for r, final in missing[:8])
        )

    # figures -------------------------------------------------------------------------------------------
    syncs = [r for r in records if r["kind"] == "sync"]
    tasks = [r for r in records if r["kind"] == "async"]
    lags = [r["lag_s"] for r in records]
    load_s = result["load_end_s"]
    lines = [
        f"client: {len(syncs)} sync ({len(syncs) / load_s:.1f}/s offered, {SYNC_RATE_PER_S:.0f}/s asked) and "
        f"{len(tasks)} async ({len(tasks) / load_s:.1f}/s, {ASYNC_RATE_PER_S:.0f}/s asked) over {load_s:.1f} s; "
        f"send lag p99 {p99(lags) * 1e3:.0f} ms, max {max(lags) * 1e3:.0f} ms; "
        f"all answered {result['answered_s']:.1f} s after t0; client CPU {result['cpu_s']:.1f} s",
        f"faults: kill -9 broker {faults.broker_node} (led {faults.broker_leads} request partitions) at "
        f"{faults.broker_killed_s:.1f} s, back at {faults.broker_back_s:.1f} s; kill -9 Redis primary "
        f"(port {faults.redis_port}) at {faults.redis_killed_s:.1f} s, replica promoted by {faults.failover_s:.1f} s, "
        f"old primary back as a replica at {faults.redis_back_s:.1f} s",
        f"outcome: {len(records) - len(lost)} of {len(records)} ended with their own answer; "
        f"{len(twice)} answered twice; {len(missing)} results missing afterwards; "
        f"{recomputed} refused tasks that also completed (their retry's task answered), "
        f"{len(recomputed_in_broker_fault)} of them refused by the bus",
    ]
    periods = [
        ("before the faults", -math.inf, faults.broker_killed_s),
        ("broker killed/restarted", faults.broker_killed_s, faults.redis_killed_s),
        ("Redis primary killed", faults.redis_killed_s, math.inf),
    ]
    successes = sorted(
        a["at_s"] + a["took_s"] for r in records for a in (*r["attempts"], *r["reads"]) if a["status"] in (200, 202)
    )
    for label, start, end in periods:
        # By when the refusal came: a request sent just before a kill may be refused just after it.
        seen = sorted(
            ((a["at_s"] + a["took_s"], r, a) for r, a in refusals if start <= a["at_s"] + a["took_s"] < end),
            key=lambda item: item[0],
        )
        if not seen:
            lines.append(f"refusals, {label}: none")
            continue
        first, last = seen[0][0], seen[-1][0]
        next_success = next((s for s in successes if s > first), math.nan)
        # The refused requests themselves: when the first of them got an answer on a retry.
        refused_back = min(
            (
                b["at_s"] + b["took_s"]
                for refused_at, r, _ in seen
                for b in (*r["attempts"], *r["reads"])
                if b["status"] in (200, 202) and b["at_s"] >= refused_at
            ),
            default=math.nan,
        )
        codes = Counter(f"{a['status']} {a['code']}" for _, _, a in seen)
        lines.append(
            f"refusals, {label}: {len(seen)} ({dict(codes)}) in {len({id(r) for _, r, _ in seen})} requests; "
            f"first at {first:.2f} s, last at {last:.2f} s; first refusal -> next success "
            f"{(next_success - first) * 1e3:.0f} ms, -> first refused request answered {refused_back - first:.2f} s"
        )

    def window(kind: str, start: float, end: float) -> list[float]:
        return [
            r["done_s"] - r["sent_s"]
            for r in records
            if r["kind"] == kind and chaos_client.succeeded(r) and start <= r["sent_s"] < end
        ]

    for kind in ("sync", "async"):
        spans = [
            ("before", 0.0, DURING[0]),
            ("during", *DURING),
            ("after", DURING[1], math.inf),
            ("of which broker", DURING[0], REDIS_KILL_AT_S),
            ("Redis", REDIS_KILL_AT_S, DURING[1]),
        ]
        parts = []
        for label, start, end in spans:
            values = window(kind, start, end)
            parts.append(f"{label} ({start:.0f}-{min(end, LOAD_S):.0f} s) {p99(values) * 1e3:.0f} ms of {len(values)}")
        lines.append(f"p99 {kind}: " + ", ".join(parts))
    runs = Counter(task for entry in journal for task in entry.get("task_ids", []))
    lines.append(
        f"worker batch journal: {len(journal)} batch calls, {sum(1 for n in runs.values() if n > 1)} tasks computed "
        "more than once (a redelivered batch; each still answered once)"
    )
    return lines, failures
