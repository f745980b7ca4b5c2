"""Kafka records and bytes per request, from the brokers' segment files: whole v2 batches are counted,
a replica's copy is not counted again, and a real broker's appends match what was produced."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from batchwire.bench.kafka_log import HEADER_BYTES, KafkaLogs, log_dirs, writes
from batchwire.bench.procstats import _listening
from tests.support.eventually import eventually_sync
from tests.support.transport_kits import ensure_topics


def _batch(records: int, body: int) -> bytes:
    """A v2 batch header for ``records`` records, then ``body`` bytes standing for them."""
    header = bytearray(HEADER_BYTES)
    header[8:12] = (HEADER_BYTES - 12 + body).to_bytes(4, "big")
    header[16] = 2
    header[57:61] = records.to_bytes(4, "big")
    return bytes(header) + bytes(body)


def _append(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as file:
        file.write(data)


def test_appends_after_the_first_read_are_counted_by_whole_batches(tmp_path: Path) -> None:
    segment = tmp_path / "ns.requests-0" / "00000000000000000000.log"
    _append(segment, _batch(5, 100))
    logs = KafkaLogs([tmp_path])
    assert logs.advance() == {}, "the first read only marks where each file ends"
    _append(segment, _batch(3, 40) + _batch(2, 10))
    _append(segment, _batch(9, 500)[:70])  # a batch still being written
    assert logs.advance() == {"ns.requests-0": (5, 2 * HEADER_BYTES + 50)}
    _append(segment, _batch(9, 500)[70:])
    rolled = tmp_path / "ns.requests-0" / "00000000000000000042.log"
    _append(rolled, _batch(1, 0))
    assert logs.advance() == {"ns.requests-0": (10, 2 * HEADER_BYTES + 500)}, "the finished batch and a new segment"
    assert logs.advance() == {"ns.requests-0": (0, 0)}


def test_a_partition_counts_its_largest_replica_once(tmp_path: Path) -> None:
    leader, follower = tmp_path / "a", tmp_path / "b"
    for folder in (leader, follower):
        (folder / "ns.batches.sim-0").mkdir(parents=True)
    logs = KafkaLogs([leader, follower])
    logs.advance()
    _append(leader / "ns.batches.sim-0" / "0.log", _batch(2, 200))
    _append(follower / "ns.batches.sim-0" / "0.log", _batch(1, 100))  # behind the leader
    _append(leader / "ns.requests-1" / "0.log", _batch(4, 80))
    grown = logs.advance()
    assert grown == {"ns.batches.sim-0": (2, HEADER_BYTES + 200), "ns.requests-1": (4, HEADER_BYTES + 80)}
    report = writes(grown, answers=4)
    assert report["records"] == 6
    assert report["records_per_request"] == 1.5
    assert report["bytes_per_request"] == (2 * HEADER_BYTES + 280) / 4
    assert list(report["by_topic"]) == ["ns.batches.sim", "ns.requests"], "largest first"


def test_a_brokers_log_dirs_come_from_its_properties_file(tmp_path: Path) -> None:
    (tmp_path / "server.properties").write_text("node.id=1\nlog.dirs=data,/elsewhere/more\n")
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()", "server.properties"],
        cwd=tmp_path,
        stdin=subprocess.PIPE,
    )
    try:
        # /proc shows an empty command line for a moment as the child starts
        eventually_sync(lambda: log_dirs(sleeper.pid) != [], "the child's command line to show", timeout_s=10)
        assert log_dirs(sleeper.pid) == [tmp_path / "data", Path("/elsewhere/more")]
    finally:
        assert sleeper.stdin is not None
        sleeper.stdin.close()
        sleeper.wait(timeout=10)
    assert log_dirs(sleeper.pid) == [], "a process that is gone has none"


@pytest.mark.kafka
async def test_a_real_brokers_appends_are_the_records_produced(infra: Any) -> None:
    port = int(str(infra.kafka_bootstrap).rpartition(":")[2])
    logs = KafkaLogs.of_brokers(_listening({port}))
    assert logs is not None, f"the broker listening on {port} has readable log dirs"
    topic = f"t{uuid.uuid4().hex[:10]}.requests"
    await ensure_topics(infra.kafka_bootstrap, {topic: 1})
    producer = AIOKafkaProducer(bootstrap_servers=infra.kafka_bootstrap, linger_ms=0)
    await producer.start()
    try:
        logs.advance()
        for n in range(50):
            await producer.send_and_wait(topic, f"record {n}".encode() * 10, partition=0)
    finally:
        await producer.stop()
    grown = logs.advance()
    records, size = grown[f"{topic}-0"]
    assert records == 50
    assert 50 * 90 < size < 50 * (90 + HEADER_BYTES + 40), "each record in its own batch, with its framing"
