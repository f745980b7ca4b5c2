"""Garbage on the request topic of a running batcher: it skips what does not decode and keeps serving.

A real deployment (gateway, batcher, worker processes over the session's Kafka and Redis) gets a
few hundred undecodable records on every request partition: random bytes, random bodies behind a
real header, truncated and corrupted requests, other kinds' records, huge length claims, empty
values and tombstones. Afterwards every real request is still answered, the batcher is alive and
has logged the skipped records, and its consumer group commits past all of them (lag 0).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaProducer

from schemas.codec import (
    MAGIC,
    CodecError,
    Kind,
    decode_batch,
    decode_request,
    encode_batch,
    encode_credit,
    encode_request,
    encode_state,
)
from schemas.deadletter import DeadLetter, DeadLetterItem, encode_dead_letter
from schemas.records import Batch, BatchItem, Credit, InferenceRequest, TaskState, TaskStatus
from schemas.wire import Names
from tests.fuzz.avro_wire import varint
from tests.support.processes import Cluster, launch, stopped_after
from transport.kafka.lag import KafkaQueueDepth

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(120)]

SEED = 20261121
REQUEST_PARTITIONS = 12  # the CLI's default --request-partitions, which launch() keeps
REAL_REQUESTS = 24


@pytest.fixture
def cluster(tmp_path: Path, infra: Any, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with stopped_after(
        request,
        launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, gateways=1, batchers=1, workers=1, sim_latency_ms=5),
    ) as started:
        yield started


def _garbage(rng: random.Random) -> Iterator[bytes | None]:
    """Record values a batcher must skip; every one is checked to be undecodable before it is sent."""
    request = encode_request(InferenceRequest("q3bY0h2mXw1kL9aF5cZr6Q", "sim", "fuzz", 1, 2**42, "gw-x", "owner"))
    yield None  # a tombstone (sent with a key, as Kafka wants)
    yield b""
    for _ in range(60):
        yield rng.randbytes(rng.randint(1, 200))
    for _ in range(60):
        yield request[:3] + rng.randbytes(rng.randint(0, 120))
    for cut in range(len(request)):
        yield request[:cut]
    for _ in range(60):
        flipped = bytearray(request)
        for _ in range(rng.randint(1, 3)):
            flipped[rng.randrange(3, len(flipped))] ^= rng.randint(1, 255)
        yield bytes(flipped)
    for _ in range(40):
        at = rng.randrange(3, len(request))
        yield request[:at] + varint(rng.choice([2**31, 2**40, 2**62, -1, -(2**40)])) + request[at + 1 :]
    yield request + b"\x00"  # a trailing byte
    yield bytes((MAGIC, int(Kind.REQUEST), 99)) + request[3:]  # a schema version from the future
    yield encode_batch(Batch("b", "sim", "bt", 1, "size", None, (BatchItem("t", "in", 1, 2),)))
    yield encode_credit(Credit("w", "sim", 0, 1, 2, 3))
    yield encode_state(TaskState("t", TaskStatus.QUEUED, "sim", 1, 1))
    yield encode_dead_letter(DeadLetter("b", "sim", "bt", "w", 3, "died", 5, (DeadLetterItem("t", "in", 1, 3),)))


def _undecodable(value: bytes | None) -> bool:
    if value is None:
        return True
    try:
        decode_request(value)
    except CodecError:
        return True
    return False


async def _infer(client: httpx.AsyncClient, text: str) -> None:
    response = await client.post("/v1/inference", json={"input": text, "timeout_ms": 10_000})
    assert response.status_code == 200, f"expected 200 for {text!r}, got {response.status_code}: {response.text}"
    assert response.json()["output"] == text[::-1], f"wrong answer for {text!r}: {response.text}"


async def test_batcher_skips_undecodable_records_and_commits_past_them(cluster: Cluster) -> None:
    names = Names(cluster.namespace)
    garbage = [value for value in _garbage(random.Random(SEED)) if _undecodable(value)]
    assert len(garbage) > 250, f"expected a few hundred undecodable records, made {len(garbage)}"
    client = httpx.AsyncClient(base_url=cluster.gateway_urls[0], timeout=15)
    producer = AIOKafkaProducer(bootstrap_servers=cluster.kafka_bootstrap, acks="all")
    lag = KafkaQueueDepth(cluster.kafka_bootstrap, names, REQUEST_PARTITIONS)
    await producer.start()
    await lag.start()
    try:
        await _infer(client, "before the garbage")
        partitions = sorted(await producer.partitions_for(names.request_topic))
        assert len(partitions) == REQUEST_PARTITIONS, f"request topic has partitions {partitions}"
        sent = [
            await producer.send(
                names.request_topic, value, key=b"fuzz-%d" % index, partition=partitions[index % len(partitions)]
            )
            for index, value in enumerate(garbage)
        ]
        await asyncio.gather(*sent)  # every record is on the broker before the real requests follow

        # The batcher commits past a record it cannot decode at once, not with its next batch: the
        # lag gateways admit by falls back to 0 with no other request to carry the commit.
        depth = -1
        for _ in range(60):
            depth = await lag.refresh()
            if depth == 0:
                break
            await asyncio.sleep(0.25)
        assert depth == 0, f"the batchers' group still lags {depth} records behind the request topic"

        await asyncio.gather(*(_infer(client, f"after the garbage {n}") for n in range(REAL_REQUESTS)))
        print(f"\n{len(garbage)} undecodable records skipped and committed past")
    finally:
        await lag.close()
        await producer.stop()
        await client.aclose()
    batcher = next(proc for proc in cluster.procs if proc.name == "batcher0")
    assert batcher.alive(), f"the batcher died:\n{batcher.tail()}"
    log = batcher.log_path.read_text(errors="replace")
    assert "undecodable record(s)" in log, f"the batcher never reported skipping a record:\n{batcher.tail()}"
    assert "Traceback" not in log, f"the batcher logged a traceback:\n{log[-6000:]}"


def _batch_garbage(rng: random.Random) -> Iterator[bytes | None]:
    """Record values a worker must skip: a newer batcher's batch (a schema version from the future),
    truncated and corrupted batches, other kinds' records, random bytes and a tombstone."""
    batch = encode_batch(Batch("b-fuzz", "sim", "bt", 1, "size", "w:1", (BatchItem("t-fuzz", "in", 1, 2**42),)))
    yield None
    yield b""
    yield bytes((MAGIC, int(Kind.BATCH), 99)) + batch[3:]
    for cut in range(0, len(batch), 3):
        yield batch[:cut]
    for _ in range(30):
        flipped = bytearray(batch)
        flipped[rng.randrange(3, len(flipped))] ^= rng.randint(1, 255)
        yield bytes(flipped)
    for _ in range(20):
        yield rng.randbytes(rng.randint(1, 100))
    yield encode_request(InferenceRequest("q3bY0h2mXw1kL9aF5cZr6Q", "sim", "fuzz", 1, 2**42))
    yield encode_credit(Credit("w", "sim", 0, 1, 2, 3))


def _undecodable_batch(value: bytes | None) -> bool:
    if value is None:
        return True
    try:
        decode_batch(value)
    except CodecError:
        return True
    return False


async def test_worker_skips_undecodable_batches_at_the_head_of_its_partitions(cluster: Cluster) -> None:
    """Garbage ahead of the real batches on every partition of a model's batch topic: the worker commits
    past each record (no partition blocks) and answers every request after it."""
    names = Names(cluster.namespace)
    garbage = [value for value in _batch_garbage(random.Random(SEED)) if _undecodable_batch(value)]
    assert len(garbage) > 40, f"expected dozens of undecodable records, made {len(garbage)}"
    client = httpx.AsyncClient(base_url=cluster.gateway_urls[0], timeout=15)
    producer = AIOKafkaProducer(bootstrap_servers=cluster.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        await _infer(client, "before the garbage")
        topic = names.batch_topic("sim")
        partitions = sorted(await producer.partitions_for(topic))
        sent = [
            await producer.send(topic, value, key=b"fuzz-%d" % index, partition=partition)
            for partition in partitions
            for index, value in enumerate(garbage)
        ]
        await asyncio.gather(*sent)
        await asyncio.gather(*(_infer(client, f"after the garbage {n}") for n in range(REAL_REQUESTS)))
    finally:
        await producer.stop()
        await client.aclose()
    worker = next(proc for proc in cluster.procs if proc.name.startswith("worker"))
    assert worker.alive(), f"the worker died:\n{worker.tail()}"
    log = worker.log_path.read_text(errors="replace")
    assert "undecodable batch" in log, f"the worker never reported skipping a batch:\n{worker.tail()}"
    assert "Traceback" not in log, f"the worker logged a traceback:\n{log[-6000:]}"
