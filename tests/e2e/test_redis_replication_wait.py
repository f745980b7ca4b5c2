"""The Redis primary dies after a worker stored a batch's results and before any replica acknowledged them.

A cluster of its own (`batchwire stack up --brokers 1 --redis-replicas 1`: one broker, a Redis primary
with a replica, three Sentinels) carries a gateway, a batcher and a sim worker over the Sentinel URL
(``--redis-min-replicas auto``: one replica while the primary has one in sync). The replica is
stopped (SIGSTOP), so it acknowledges nothing, and more is written than the socket buffers hold, so
what the primary writes next never reaches it. A synchronous request is answered from the primary
while its batch stays uncommitted (the worker counts short stores and stores again), and an async
task sent meanwhile does not end. Then the primary is killed (SIGKILL) and the replica resumed
(SIGCONT); once the Sentinels promote it, both batches are committed with their results on the new
primary, written there by the worker (replication never brought them), each task completed with its
own answer and run once. And when the worker is killed while its results wait, its batch, never
committed, runs again on the next worker once the failover has lost them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from infra.ports import free_port
from infra.process import ServiceProcess
from infra.redis_sentinel import MASTER_NAME, sentinel_primary
from infra.stack import ENV_FILE_NAME, KAFKA_ENV, REDIS_ENV, read_env_file
from schemas.codec import decode_state
from schemas.records import TaskStatus
from schemas.wire import Names
from tests.support.cluster_checks import group_offsets
from tests.support.eventually import eventually_sync
from tests.support.processes import Cluster, launch, metric, respawn, stopped_after
from tests.support.stack_cli import discard_stack
from tests.support.stack_cli import stack_cli as _cli

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(180)]

SHAPE = ("--brokers", "1", "--redis-replicas", "1")
WAIT_S = 30.0
UNREPLICATED = "batchwire_results_unreplicated_total"
FILL_KEYS = 12
FILL_VALUE_BYTES = 4 * 1024 * 1024


@dataclass
class Backbone:
    bootstrap: str
    servers: list[dict[str, Any]]
    cluster: Cluster
    metrics_port: int

    def redis(self, role: str) -> dict[str, Any]:
        [server] = [s for s in self.servers if s["kind"] == "redis" and s["role"] == role]
        return server

    @property
    def sentinels(self) -> list[int]:
        return [s["port"] for s in self.servers if s["kind"] == "sentinel"]


@pytest.fixture
def backbone(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Backbone]:
    state_dir = tmp_path / "state"
    try:
        up = _cli(state_dir, "up", *SHAPE)
        assert up.returncode == 0, f"stack up exited {up.returncode}:\n{up.stderr}"
        env = read_env_file(state_dir / ENV_FILE_NAME)
        status = json.loads(_cli(state_dir, "status", "--json").stdout)
        [primary] = [s["port"] for s in status["servers"] if s["kind"] == "redis" and s["role"] == "primary"]
        # Before any worker counts replicas (auto): a replica still taking its first copy is not counted.
        eventually_sync(lambda: _in_sync(primary), "the replica to be in sync", timeout_s=WAIT_S, interval_s=0.1)
        port = free_port()
        worker_args = ("--metrics-port", str(port), "--redis-replica-wait-ms", "500")
        cluster = launch(
            tmp_path, env[KAFKA_ENV], env[REDIS_ENV], gateways=1, batchers=1, workers=1, worker_args=worker_args
        )
        with stopped_after(request, cluster):
            yield Backbone(env[KAFKA_ENV], status["servers"], cluster, port)
    finally:
        discard_stack(state_dir)


def _stored(port: int, names: Names, task_ids: list[str]) -> dict[str, Any]:
    """Each found task's stored state on the Redis server at ``port``."""
    with redis.Redis(port=port) as client:
        docs = [client.hget(names.task_key(task_id), "doc") for task_id in task_ids]
    return {task_id: decode_state(doc) for task_id, doc in zip(task_ids, docs, strict=True) if doc}


def _in_sync(port: int) -> bool:
    with redis.Redis(port=port) as client:
        replica = client.info("replication").get("slave0")
    return isinstance(replica, dict) and replica.get("state") == "online"


def _fill_replication_stream(port: int, key: str) -> None:
    """Writes more than the loopback socket buffers hold, so what the primary writes next stays in its
    own memory, behind this, and dies with it: a stopped replica never sees it, even once resumed."""
    with redis.Redis(port=port) as client:
        for index in range(FILL_KEYS):
            client.set(f"{key}:{index}", b"x" * FILL_VALUE_BYTES)


def _signal(pid: int, sig: signal.Signals) -> None:
    assert ServiceProcess.attach(pid, []) is not None, f"process {pid} is not running"
    os.kill(pid, sig)


def test_a_batch_whose_results_no_replica_acknowledged_is_committed_only_after_they_reach_the_new_primary(
    backbone: Backbone,
) -> None:
    cluster = backbone.cluster
    names = Names(cluster.namespace)
    group, topic = names.worker_group("sim"), names.batch_topic("sim")
    url = cluster.gateway_urls[0]
    warm = httpx.post(f"{url}/v1/inference", json={"input": "warm"}, timeout=WAIT_S)
    assert warm.status_code == 200 and warm.json()["output"] == "mraw", warm.text

    def committed_all(batches: int) -> bool:
        """Whether ``batches`` batches are on the topic and every one is committed."""
        committed, ends = asyncio.run(group_offsets(backbone.bootstrap, group, topic))
        return sum(committed.values()) == sum(ends.values()) == batches

    eventually_sync(lambda: committed_all(1), "the warm-up batch to be committed", timeout_s=WAIT_S, interval_s=0.2)
    before, _ = asyncio.run(group_offsets(backbone.bootstrap, group, topic))
    primary, replica = backbone.redis("primary"), backbone.redis("replica")

    _signal(replica["pid"], signal.SIGSTOP)  # alive to the primary, acknowledging nothing
    resumed = False
    fill = f"{cluster.namespace}:fill"
    try:
        _fill_replication_stream(primary["port"], fill)
        answer = httpx.post(f"{url}/v1/inference", json={"input": "kept across"}, timeout=WAIT_S)
        assert answer.status_code == 200 and answer.json()["output"] == "ssorca tpek", answer.text
        first = answer.json()["task_id"]
        eventually_sync(lambda: metric(backbone.metrics_port, UNREPLICATED) >= 2, "two short stores", timeout_s=WAIT_S)
        assert _stored(primary["port"], names, [first])[first].status is TaskStatus.COMPLETED
        queued = httpx.post(f"{url}/v1/tasks", json={"input": "async too"}, timeout=WAIT_S)
        assert queued.status_code == 202, queued.text
        later = queued.json()["task_id"]
        shorts = metric(backbone.metrics_port, UNREPLICATED)
        eventually_sync(
            lambda: metric(backbone.metrics_port, UNREPLICATED) >= shorts + 2, "two more short stores", timeout_s=WAIT_S
        )

        held = _stored(primary["port"], names, [later])[later]
        assert not held.status.terminal, f"no later batch ends while one waits for replicas: {held}"
        committed, ends = asyncio.run(group_offsets(backbone.bootstrap, group, topic))
        assert committed == before, f"nothing committed while no replica holds the results: {before} -> {committed}"
        # The later task's batch is on the topic too when the batcher held a credit from before the wait.
        assert sum(ends.values()) >= 2, f"the first batch is on its topic, uncommitted: ends {ends}"

        _signal(primary["pid"], signal.SIGKILL)
        _signal(replica["pid"], signal.SIGCONT)
        resumed = True
        eventually_sync(
            lambda: sentinel_primary(backbone.sentinels, MASTER_NAME) == replica["port"],
            "the Sentinels to promote the replica",
            timeout_s=WAIT_S,
            interval_s=0.1,
        )
        # Without a credit held from before, the later task's batch goes out once the first is committed.
        eventually_sync(lambda: committed_all(3), "both batches to be committed", timeout_s=WAIT_S, interval_s=0.2)
    finally:
        if not resumed:
            os.kill(replica["pid"], signal.SIGCONT)

    expected = {first: "ssorca tpek", later: "oot cnysa"}
    task_ids = list(expected)
    with redis.Redis(port=replica["port"]) as client:
        assert not client.exists(f"{fill}:{FILL_KEYS - 1}"), "the new primary never got what followed the fill"
    on_new = _stored(replica["port"], names, task_ids)
    assert {t: (s.status, s.output) for t, s in on_new.items()} == {
        t: (TaskStatus.COMPLETED, output) for t, output in expected.items()
    }, "the committed batch's results are on the new primary"
    for task_id, output in expected.items():
        polled = httpx.get(f"{url}/v1/result/{task_id}", timeout=WAIT_S)
        assert polled.status_code == 200 and (polled.json()["status"], polled.json()["output"]) == (
            "completed",
            output,
        ), polled.text
    runs = Counter(task_id for run in cluster.journal() for task_id in run["task_ids"])
    assert all(runs[task_id] == 1 for task_id in task_ids), f"each task ran once: {runs}"
    assert all(proc.alive() for proc in cluster.procs), cluster.logs()


def test_a_worker_killed_while_its_results_wait_for_a_replica_leaves_the_batch_to_run_again(
    backbone: Backbone,
) -> None:
    cluster = backbone.cluster
    names = Names(cluster.namespace)
    group, topic = names.worker_group("sim"), names.batch_topic("sim")
    url = cluster.gateway_urls[0]
    warm = httpx.post(f"{url}/v1/inference", json={"input": "warm"}, timeout=WAIT_S)
    assert warm.status_code == 200, warm.text

    def committed_all(batches: int) -> bool:
        committed, ends = asyncio.run(group_offsets(backbone.bootstrap, group, topic))
        return sum(committed.values()) == sum(ends.values()) == batches

    eventually_sync(lambda: committed_all(1), "the warm-up batch to be committed", timeout_s=WAIT_S, interval_s=0.2)
    primary, replica = backbone.redis("primary"), backbone.redis("replica")
    [worker] = [proc for proc in cluster.procs if proc.name == "worker0"]

    _signal(replica["pid"], signal.SIGSTOP)
    resumed = False
    try:
        _fill_replication_stream(primary["port"], f"{cluster.namespace}:fill")
        answer = httpx.post(f"{url}/v1/inference", json={"input": "run twice"}, timeout=WAIT_S)
        assert answer.status_code == 200 and answer.json()["output"] == "eciwt nur", answer.text
        task_id = answer.json()["task_id"]
        eventually_sync(lambda: metric(backbone.metrics_port, UNREPLICATED) >= 2, "two short stores", timeout_s=WAIT_S)
        assert not committed_all(2), "a batch whose results no replica holds is not committed"

        worker.kill9()
        _signal(primary["pid"], signal.SIGKILL)
        _signal(replica["pid"], signal.SIGCONT)
        resumed = True
        eventually_sync(
            lambda: sentinel_primary(backbone.sentinels, MASTER_NAME) == replica["port"],
            "the Sentinels to promote the replica",
            timeout_s=WAIT_S,
            interval_s=0.1,
        )
    finally:
        if not resumed:
            os.kill(replica["pid"], signal.SIGCONT)
    assert task_id not in _stored(replica["port"], names, [task_id]), "the result died with the old primary"

    respawn(cluster, worker)
    eventually_sync(
        lambda: committed_all(2), "the batch to run again and be committed", timeout_s=WAIT_S, interval_s=0.2
    )

    stored = _stored(replica["port"], names, [task_id])[task_id]
    assert (stored.status, stored.output) == (TaskStatus.COMPLETED, "eciwt nur"), stored
    polled = httpx.get(f"{url}/v1/result/{task_id}", timeout=WAIT_S)
    assert polled.status_code == 200 and polled.json()["output"] == "eciwt nur", polled.text
    runs = [run for run in cluster.journal() if task_id in run["task_ids"]]
    assert len(runs) == 2 and runs[0]["pid"] != runs[1]["pid"], f"run by the killed worker and its successor: {runs}"
