"""`batchwire stack up --brokers 3 --redis-replicas 1`: a real cluster on loopback, real SIGKILLs.

One cluster for the module (three KRaft nodes, a Redis primary and replica, three Sentinels), in
a state dir of its own; the tests run in file order and each leaves the cluster whole again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition  # type: ignore[import-untyped, unused-ignore]
from aiokafka.admin import AIOKafkaAdminClient, NewTopic  # type: ignore[import-untyped, unused-ignore]
from aiokafka.admin.config_resource import (  # type: ignore[import-untyped, unused-ignore]
    ConfigResource,
    ConfigResourceType,
)

from infra.process import ServiceProcess
from infra.redis_sentinel import MASTER_NAME, sentinel_primary
from infra.stack import ENV_FILE_NAME, KAFKA_ENV, REDIS_ENV, read_env_file
from tests.support.stack_cli import discard_stack
from tests.support.stack_cli import stack_cli as _cli

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(120)]

SHAPE = ("--brokers", "3", "--redis-replicas", "1")
WAIT_S = 20.0
FAILOVER_DEADLINE_S = 15.0


def _up(state_dir: Path) -> str:
    done = _cli(state_dir, "up", *SHAPE)
    assert done.returncode == 0, f"stack up exited {done.returncode}:\n{done.stderr}"
    return done.stdout


def _status(state_dir: Path) -> dict[str, Any]:
    done = _cli(state_dir, "status", "--json")
    report: dict[str, Any] = json.loads(done.stdout)
    report["exit_code"] = done.returncode
    return report


def _servers(report: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [server for server in report["servers"] if server["kind"] == kind]


def _alive(pid: int | None) -> bool:
    return pid is not None and ServiceProcess.attach(pid, []) is not None


def _kill9(pid: int) -> None:
    process = ServiceProcess.attach(pid, [])
    assert process is not None, f"process {pid} is not running"
    os.kill(pid, signal.SIGKILL)
    assert process.wait_exit(10.0), f"process {pid} survived SIGKILL"


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("cluster") / "state"
    started = time.monotonic()
    _up(path)
    print(f"cluster up in {time.monotonic() - started:.1f} s")
    yield path
    discard_stack(path)


async def _admin(bootstrap: str) -> AIOKafkaAdminClient:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    return admin


async def _create_replicated_topic(bootstrap: str, topic: str) -> None:
    admin = await _admin(bootstrap)
    try:
        new = NewTopic(topic, num_partitions=1, replication_factor=3, topic_configs={"min.insync.replicas": "2"})
        await admin.create_topics([new])
    finally:
        await admin.close()


async def _topic_min_isr(bootstrap: str, topic: str) -> str:
    admin = await _admin(bootstrap)
    try:
        [described] = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    finally:
        await admin.close()
    entries = {entry[0]: entry[1] for entry in described.resources[0][4]}
    return str(entries["min.insync.replicas"])


async def _replicas(bootstrap: str, topic: str) -> list[int]:
    admin = await _admin(bootstrap)
    try:
        [described] = await admin.describe_topics([topic])
    finally:
        await admin.close()
    return list(described["partitions"][0]["replicas"])


async def _produce_all_acks(bootstrap: str, topic: str, value: bytes) -> int:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        meta = await asyncio.wait_for(producer.send_and_wait(topic, value, partition=0), WAIT_S)
    finally:
        await producer.stop()
    offset: int = meta.offset
    return offset


async def _read(bootstrap: str, topic: str, offset: int) -> bytes:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek(tp, offset)
        record = await asyncio.wait_for(consumer.getone(), WAIT_S)
    finally:
        await consumer.stop()
    value: bytes = record.value
    return value


def _sentinel_ports(env: dict[str, str]) -> list[int]:
    hosts = env[REDIS_ENV].removeprefix("redis+sentinel://").split("/", 1)[0]
    return [int(host.rsplit(":", 1)[1]) for host in hosts.split(",")]


def test_up_writes_every_broker_and_the_sentinels_to_stack_env_and_status_lists_every_server(state_dir: Path) -> None:
    env = read_env_file(state_dir / ENV_FILE_NAME)
    report = _status(state_dir)

    assert report["exit_code"] == 0 and report["healthy"], report
    kafka, redis_nodes, sentinels = (_servers(report, kind) for kind in ("kafka", "redis", "sentinel"))
    assert [s["node_id"] for s in kafka] == [1, 2, 3]
    assert env[KAFKA_ENV] == ",".join(f"127.0.0.1:{s['port']}" for s in kafka)
    assert sorted(s["role"] for s in redis_nodes) == ["primary", "replica"], redis_nodes
    assert len(sentinels) == 3
    assert env[REDIS_ENV] == "redis+sentinel://" + ",".join(f"127.0.0.1:{s['port']}" for s in sentinels) + "/batchwire"
    for server in report["servers"]:
        assert server["alive"] and _alive(server["pid"]), f"not a live process: {server}"
    primary = next(s["port"] for s in redis_nodes if s["role"] == "primary")
    assert report["redis_primary_port"] == primary
    assert {s["primary_port"] for s in sentinels} == {primary}, "every Sentinel names the primary"
    assert sum(len(parts) for s in kafka for parts in s["leads"].values()) >= 1, "leaders are reported"
    offsets_leaders = [s["node_id"] for s in kafka if "__consumer_offsets" in s["leads"]]
    assert len(offsets_leaders) == 1, kafka
    assert len(asyncio.run(_replicas(env[KAFKA_ENV], "__consumer_offsets"))) == 3
    assert asyncio.run(_topic_min_isr(env[KAFKA_ENV], "__consumer_offsets")) == "2"


def test_a_topic_with_rf_3_and_min_isr_2_takes_an_acks_all_produce(state_dir: Path) -> None:
    bootstrap = read_env_file(state_dir / ENV_FILE_NAME)[KAFKA_ENV]
    topic = f"cluster-test-{uuid.uuid4().hex[:10]}"
    asyncio.run(_create_replicated_topic(bootstrap, topic))

    offset = asyncio.run(_produce_all_acks(bootstrap, topic, b"replicated"))

    assert sorted(asyncio.run(_replicas(bootstrap, topic))) == [1, 2, 3]
    assert asyncio.run(_read(bootstrap, topic, offset)) == b"replicated"


def test_a_killed_partition_leader_comes_back_on_its_port_and_a_record_from_before_is_read(state_dir: Path) -> None:
    bootstrap = read_env_file(state_dir / ENV_FILE_NAME)[KAFKA_ENV]
    topic = f"cluster-test-{uuid.uuid4().hex[:10]}"
    asyncio.run(_create_replicated_topic(bootstrap, topic))
    offset = asyncio.run(_produce_all_acks(bootstrap, topic, b"before the crash"))
    before = _status(state_dir)
    [leader] = [s for s in _servers(before, "kafka") if topic in s["leads"]]

    _kill9(leader["pid"])
    during = _status(state_dir)
    assert not next(s for s in _servers(during, "kafka") if s["node_id"] == leader["node_id"])["alive"]
    assert during["exit_code"] == 1, "a stack with a dead broker is not healthy"
    started = time.monotonic()
    _up(state_dir)
    print(f"broker {leader['node_id']} back in {time.monotonic() - started:.1f} s")

    after = _status(state_dir)
    assert after["healthy"], after
    back = next(s for s in _servers(after, "kafka") if s["node_id"] == leader["node_id"])
    assert back["port"] == leader["port"] and back["pid"] != leader["pid"] and _alive(back["pid"])
    others = {s["node_id"]: s["pid"] for s in _servers(before, "kafka") if s["node_id"] != leader["node_id"]}
    assert {s["node_id"]: s["pid"] for s in _servers(after, "kafka") if s["node_id"] in others} == others, (
        "live brokers were left alone"
    )
    assert asyncio.run(_read(bootstrap, topic, offset)) == b"before the crash"
    assert asyncio.run(_read(back_bootstrap := f"127.0.0.1:{back['port']}", topic, offset)) == b"before the crash", (
        back_bootstrap
    )


def test_a_killed_redis_primary_is_replaced_by_its_replica_and_up_brings_it_back_as_a_replica(state_dir: Path) -> None:
    env = read_env_file(state_dir / ENV_FILE_NAME)
    sentinels = _sentinel_ports(env)
    before = _status(state_dir)
    [old] = [s for s in _servers(before, "redis") if s["role"] == "primary"]
    [replica] = [s for s in _servers(before, "redis") if s["role"] == "replica"]
    with redis.Redis(port=old["port"]) as client:
        client.set("cluster-test:mark", b"kept")
        assert client.wait(1, 5000) == 1, "the replica acknowledged the write"

    _kill9(old["pid"])
    killed = time.monotonic()
    while sentinel_primary(sentinels, MASTER_NAME) != replica["port"]:
        assert time.monotonic() - killed < FAILOVER_DEADLINE_S, "the Sentinels did not promote the replica"
        time.sleep(0.1)
    print(f"failover in {time.monotonic() - killed:.1f} s")

    during = _status(state_dir)
    assert during["redis_primary_port"] == replica["port"], during
    assert next(s for s in _servers(during, "redis") if s["node_id"] == replica["node_id"])["role"] == "primary"
    _up(state_dir)

    after = _status(state_dir)
    assert after["healthy"], after
    back = next(s for s in _servers(after, "redis") if s["node_id"] == old["node_id"])
    assert (back["port"], back["role"]) == (old["port"], "replica"), back
    assert back["pid"] != old["pid"] and _alive(back["pid"])
    assert after["redis_primary_port"] == replica["port"], "up does not undo the failover"
    with redis.Redis(port=back["port"]) as client:
        role = client.execute_command("ROLE")
        assert int(role[2]) == replica["port"], f"replicates the new primary: {role}"
    with redis.Redis(port=replica["port"]) as client:
        assert client.get("cluster-test:mark") == b"kept"


def test_up_with_another_shape_on_a_cluster_state_dir_is_refused_and_changes_nothing(state_dir: Path) -> None:
    before = _status(state_dir)

    refused = _cli(state_dir, "up")

    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "--brokers 3 --redis-replicas 1" in refused.stderr and "nothing was changed" in refused.stderr, (
        refused.stderr
    )
    after = _status(state_dir)
    assert [s["pid"] for s in after["servers"]] == [s["pid"] for s in before["servers"]]
    assert not (state_dir / "kafka").exists() and not (state_dir / "redis").exists()


def test_down_then_up_brings_the_whole_cluster_back_on_its_ports_with_the_promoted_primary(state_dir: Path) -> None:
    first = read_env_file(state_dir / ENV_FILE_NAME)
    before = _status(state_dir)
    primary = before["redis_primary_port"]  # node 2's, in file order: the test before promoted it

    stopped = _cli(state_dir, "down")
    assert stopped.returncode == 0, stopped.stderr
    assert not any(_alive(s["pid"]) for s in before["servers"]), "down stopped every server"
    _up(state_dir)

    after = _status(state_dir)
    assert after["healthy"], after
    assert read_env_file(state_dir / ENV_FILE_NAME) == first, "the same addresses"
    assert [s["port"] for s in after["servers"]] == [s["port"] for s in before["servers"]]
    assert after["redis_primary_port"] == primary, "the Sentinels' files keep the failover across a restart"
    with redis.Redis(port=primary) as client:
        assert client.get("cluster-test:mark") == b"kept", "Redis's append-only file survived"
