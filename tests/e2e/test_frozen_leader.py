"""One broker of three frozen (SIGSTOP) while it leads a request partition: the cluster fences it and
elects a new leader among the in-sync copies, and the gateway's request producer finds that leader and
is ready again while the broker is still frozen, instead of asking the frozen one for as long as it
stays frozen (a gateway whose cached metadata names it refuses every submit 503 meanwhile).

A stack of its own (`batchwire stack up --brokers 3`, a plain Redis) in a state dir of its own; the
request topic with RF 3 and min ISR 2, so a record is acked by the two brokers left.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.stack import ENV_FILE_NAME, KAFKA_ENV, read_env_file
from infra.topics import ensure_topics
from schemas.records import InferenceRequest
from schemas.wire import Names
from tests.support.stack_cli import discard_stack
from tests.support.stack_cli import stack_cli as _cli
from transport.kafka.producers import KafkaRequestProducer
from transport.routing import Partitioner

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(180)]

PARTITIONS = 2
READY_AGAIN_WITHIN_S = 30.0
"""The cluster fences a silent broker after its session timeout (3 s, `broker.session.timeout.ms`) and
moves its leaders at once; the producer then needs a metadata refresh or two (each at most its 5 s
request timeout when it asks the frozen broker first)."""


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("frozen-leader") / "state"
    done = _cli(path, "up", "--brokers", "3", "--redis-replicas", "0")
    try:
        assert done.returncode == 0, f"stack up exited {done.returncode}:\n{done.stderr}"
        yield path
    finally:
        discard_stack(path)


def leader_pid(state_dir: Path, topic: str, partition: int) -> int:
    """The pid of the broker that leads ``topic``[``partition``] (`stack status --json`)."""
    report = json.loads(_cli(state_dir, "status", "--json").stdout)
    leaders = [s for s in report["servers"] if s["kind"] == "kafka" and partition in s["leads"].get(topic, [])]
    assert len(leaders) == 1, f"one broker leads {topic}[{partition}]: {report['servers']}"
    pid: int = leaders[0]["pid"]
    return pid


def request(n: int) -> InferenceRequest:
    now_ms = int(time.time() * 1000)
    return InferenceRequest(f"frozen-{n}", "sim", f"input {n}", now_ms, now_ms + 30_000, "gw")


async def test_a_frozen_leader_replaced_by_the_cluster_leaves_the_request_producer_ready(state_dir: Path) -> None:
    bootstrap = read_env_file(state_dir / ENV_FILE_NAME)[KAFKA_ENV]
    names = Names(f"frozen-{uuid.uuid4().hex[:8]}")
    replication = await ensure_topics(bootstrap, {names.request_topic: PARTITIONS})
    assert (replication.replication_factor, replication.min_insync_replicas) == (3, 2), replication
    producer = KafkaRequestProducer(bootstrap, names, Partitioner(["sim"], PARTITIONS), ready_timeout_s=1.0)
    await producer.start()
    try:
        await producer.send(request(0))
        assert await producer.ready(), "ready before the freeze"
        # The probe asks the leader of the topic's first partition: freeze that one.
        pid = leader_pid(state_dir, names.request_topic, 0)
        os.kill(pid, signal.SIGSTOP)
        try:
            frozen_at = time.monotonic()
            probes: list[bool] = []
            while not (probes and probes[-1]):
                elapsed_s = time.monotonic() - frozen_at
                assert elapsed_s < READY_AGAIN_WITHIN_S, (
                    f"the producer is still not ready {elapsed_s:.1f} s into the freeze of one broker of three "
                    f"(probes: {probes.count(False)} down), though two in-sync copies of every partition remain"
                )
                probes.append(await producer.ready())  # each probe bounded by its own second
            assert not producer.breaker.open, "a ready probe closes the breaker"
            for n in range(1, 5):  # both partitions, one of which the frozen broker led
                await producer.send(request(n))
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        await producer.close()
