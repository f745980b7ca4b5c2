"""The real thing: a local broker and Redis, restarts, and the detached `stack up/down`."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition  # type: ignore[import-untyped, unused-ignore]
from aiokafka.admin import AIOKafkaAdminClient  # type: ignore[import-untyped, unused-ignore]

from infra.aio import run_blocking
from infra.kafka_probe import kafka_serves
from infra.local_stack import LocalStack
from infra.process import ServiceProcess
from infra.redis_server import redis_pings
from infra.stack import ENV_FILE_NAME, KAFKA_ENV, REDIS_ENV, stack_down, stack_status, stack_up
from infra.topic_checks import TopicError
from infra.topics import ensure_topics

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]

WAIT_S = 20.0


def _topic() -> str:
    return f"infra-test-{uuid.uuid4().hex[:10]}"


async def _produce(bootstrap: str, topic: str, value: bytes, partition: int | None = None) -> tuple[int, int]:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await producer.start()
    try:
        meta = await asyncio.wait_for(producer.send_and_wait(topic, value, partition=partition), WAIT_S)
    finally:
        await producer.stop()
    return meta.partition, meta.offset


async def _read_one(bootstrap: str, topic: str, partition: int, offset: int) -> bytes:
    # Manual assignment: no consumer-group join, so the read costs one fetch.
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        consumer.seek(tp, offset)
        record = await asyncio.wait_for(consumer.getone(), WAIT_S)
    finally:
        await consumer.stop()
    value: bytes = record.value
    return value


async def _partition_count(bootstrap: str, topic: str) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        [described] = await admin.describe_topics([topic])
    finally:
        await admin.close()
    return len(described["partitions"])


@pytest.mark.asyncio
async def test_topic_with_three_partitions_carries_a_message(local_stack: LocalStack) -> None:
    bootstrap = local_stack.kafka_bootstrap
    topic = _topic()

    await ensure_topics(bootstrap, {topic: 3})
    await ensure_topics(bootstrap, {topic: 3})  # idempotent

    assert await _partition_count(bootstrap, topic) == 3
    partition, offset = await _produce(bootstrap, topic, b"hello", partition=2)
    assert (partition, offset) == (2, 0)
    assert await _read_one(bootstrap, topic, partition, offset) == b"hello"


@pytest.mark.asyncio
async def test_ensure_topics_refuses_a_different_partition_count(local_stack: LocalStack) -> None:
    topic = _topic()
    await ensure_topics(local_stack.kafka_bootstrap, {topic: 2})

    with pytest.raises(TopicError, match="exists with 2 partitions; wanted 4"):
        await ensure_topics(local_stack.kafka_bootstrap, {topic: 4})


@pytest.mark.asyncio
async def test_redis_set_get(local_stack: LocalStack) -> None:
    client = aioredis.Redis.from_url(local_stack.redis_url)
    try:
        await client.set("infra-test:key", b"value")
        assert await client.get("infra-test:key") == b"value"
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_kafka_restart_keeps_address_and_data(local_stack: LocalStack) -> None:
    bootstrap = local_stack.kafka_bootstrap
    topic = _topic()
    await ensure_topics(bootstrap, {topic: 1})
    _, before_offset = await _produce(bootstrap, topic, b"before")
    pid_before = local_stack.kafka.pid

    await asyncio.to_thread(local_stack.restart_kafka)

    assert local_stack.kafka_bootstrap == bootstrap
    assert local_stack.kafka.pid != pid_before, "expected a new broker process after restart"
    _, after_offset = await _produce(bootstrap, topic, b"after")
    assert after_offset == before_offset + 1, f"offsets continue across restart; got {after_offset}"
    assert await _read_one(bootstrap, topic, 0, before_offset) == b"before"


@pytest.mark.asyncio
async def test_kafka_recovers_from_a_crash(local_stack: LocalStack) -> None:
    bootstrap = local_stack.kafka_bootstrap
    topic = _topic()
    await ensure_topics(bootstrap, {topic: 1})

    await asyncio.to_thread(local_stack.kill_kafka)
    assert not await kafka_serves(bootstrap, request_timeout_s=1.0)
    await asyncio.to_thread(local_stack.start_kafka)

    _, offset = await _produce(bootstrap, topic, b"after-crash")
    assert await _read_one(bootstrap, topic, 0, offset) == b"after-crash"


@pytest.mark.asyncio
async def test_redis_restart_keeps_address_and_loses_data(local_stack: LocalStack) -> None:
    url = local_stack.redis_url
    before = aioredis.Redis.from_url(url)
    try:
        await before.set("infra-test:gone", b"1")
    finally:
        await before.aclose()

    await asyncio.to_thread(local_stack.restart_redis)

    assert local_stack.redis_url == url
    after = aioredis.Redis.from_url(url)
    try:
        assert await after.ping()
        assert await after.get("infra-test:gone") is None, "no persistence: a restart empties Redis"
    finally:
        await after.aclose()


def test_stack_up_status_down_round_trip(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    try:
        up = stack_up(state_dir, redis_maxmemory="64mb")
        env = up.env

        env_text = (state_dir / ENV_FILE_NAME).read_text()
        assert env_text == f"{KAFKA_ENV}={env[KAFKA_ENV]}\n{REDIS_ENV}={env[REDIS_ENV]}\n"
        assert env[KAFKA_ENV].startswith("127.0.0.1:")
        assert env[REDIS_ENV].startswith("redis://127.0.0.1:")
        assert env[REDIS_ENV].endswith("/0")
        status = stack_status(state_dir)
        assert status.healthy, f"expected a healthy stack, got {status}"
        assert status.env == env
        assert status.kafka.pid is not None
        assert status.redis.pid is not None
        pids = (status.kafka.pid, status.redis.pid)
        client = redis.Redis.from_url(env[REDIS_ENV])
        try:
            config = client.config_get("maxmemory*") | client.config_get("append*")
            client.set("infra-test:kept", b"1")
        finally:
            client.close()
        assert config["maxmemory"] == str(64 * 1024 * 1024)
        assert config["maxmemory-policy"] == "noeviction"
        assert (config["appendonly"], config["appendfsync"]) == ("yes", "everysec")

        started = time.monotonic()
        again_up = stack_up(state_dir)
        assert again_up.env == env, "a second `up` reuses the running stack"
        assert all("left alone" in action for action in again_up.actions), again_up.actions
        assert time.monotonic() - started < 10.0
        again = stack_status(state_dir)
        assert (again.kafka.pid, again.redis.pid) == pids
    finally:
        was_running = stack_down(state_dir)

    assert was_running
    assert not (state_dir / ENV_FILE_NAME).exists()
    for pid in pids:
        assert ServiceProcess.attach(pid, []) is None, f"process {pid} still alive after down"
    assert not redis_pings(_port(env[REDIS_ENV]))
    assert stack_down(state_dir) is False, "a second `down` finds nothing to stop"
    stopped = stack_status(state_dir)
    assert not stopped.anything_running
    assert stopped.env == env, "the ports stay recorded for the next `up`"

    try:
        assert stack_up(state_dir).env == env, "`up` after `down` comes back on the same addresses"
        assert _redis_get(env[REDIS_ENV], "infra-test:kept") == b"1", "`down` keeps Redis's data"
    finally:
        stack_down(state_dir)


# `batchwire stack up` on a half-dead stack: real processes, real SIGKILL, the CLI as a subprocess.


def _cli_env(state_dir: Path) -> dict[str, str]:
    """The environment without any BATCHWIRE_* setting, the developer's stack.env included."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("BATCHWIRE_")}
    env["BATCHWIRE_STACK_ENV"] = str(state_dir.parent / "no-stack.env")
    return env


def _stack_cli(state_dir: Path, action: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "batchwire.cli", "stack", action, "--state-dir", str(state_dir), *extra],
        env=_cli_env(state_dir),
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )


def _up(state_dir: Path) -> str:
    """`batchwire stack up`; its stdout (the stack.env lines) once it succeeded."""
    done = _stack_cli(state_dir, "up")
    assert done.returncode == 0, f"stack up exited {done.returncode}:\n{done.stderr}"
    return done.stdout


def _port(redis_url: str) -> int:
    return int(redis_url.rsplit(":", 1)[1].split("/")[0])


def _redis_set(url: str, key: str, value: bytes) -> None:
    client = redis.Redis.from_url(url)
    try:
        client.set(key, value)
    finally:
        client.close()


def _redis_get(url: str, key: str) -> bytes | None:
    client = redis.Redis.from_url(url)
    try:
        value = client.get(key)
    finally:
        client.close()
    assert value is None or isinstance(value, bytes)
    return value


def _kill9(pid: int | None) -> None:
    assert pid is not None, "expected a live process to kill"
    process = ServiceProcess.attach(pid, [])
    assert process is not None, f"process {pid} is not running"
    os.kill(pid, signal.SIGKILL)
    assert process.wait_exit(10.0), f"process {pid} survived SIGKILL"


def _processes_in(folder: Path) -> list[int]:
    """Pids of live processes whose working folder is `folder` (the stack's servers run in theirs)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "cwd") == str(folder.resolve()) and ServiceProcess.attach(int(entry.name), []):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """A state dir of this test's own; its stack is stopped afterwards."""
    path = tmp_path / "state"
    yield path
    stack_down(path)


class _Marks:
    """A Kafka record and a Redis key written before a crash, to read back after `stack up`."""

    def __init__(self, env: dict[str, str]) -> None:
        self.bootstrap = env[KAFKA_ENV]
        self.redis_url = env[REDIS_ENV]
        self.topic = _topic()
        self.value = uuid.uuid4().bytes
        asyncio.run(ensure_topics(self.bootstrap, {self.topic: 1}))
        _, self.offset = asyncio.run(_produce(self.bootstrap, self.topic, self.value))
        _redis_set(self.redis_url, "infra-test:mark", self.value)

    def assert_kept(self) -> None:
        assert asyncio.run(_read_one(self.bootstrap, self.topic, 0, self.offset)) == self.value, "Kafka lost a record"
        assert _redis_get(self.redis_url, "infra-test:mark") == self.value, "Redis lost a key"


def test_up_after_redis_is_killed_restarts_redis_alone_on_its_port_with_its_data(state_dir: Path) -> None:
    first = _up(state_dir)
    before = stack_status(state_dir)
    marks = _Marks(before.env)

    _kill9(before.redis.pid)
    assert not stack_status(state_dir).redis.alive
    second = _up(state_dir)

    after = stack_status(state_dir)
    assert second == first, "the same stack.env lines"
    assert after.healthy, after
    assert after.kafka.pid == before.kafka.pid, "the healthy broker was left alone"
    assert after.redis.pid not in (None, before.redis.pid)
    assert (after.kafka.ports, after.redis.ports) == (before.kafka.ports, before.redis.ports)
    marks.assert_kept()


def test_up_after_kafka_is_killed_restarts_kafka_alone_on_its_ports_with_its_data(state_dir: Path) -> None:
    first = _up(state_dir)
    before = stack_status(state_dir)
    marks = _Marks(before.env)

    _kill9(before.kafka.pid)
    second = _up(state_dir)

    after = stack_status(state_dir)
    assert second == first
    assert after.healthy, after
    assert after.redis.pid == before.redis.pid, "the healthy Redis was left alone"
    assert after.kafka.pid not in (None, before.kafka.pid)
    assert (after.kafka.ports, after.redis.ports) == (before.kafka.ports, before.redis.ports)
    marks.assert_kept()


def test_up_with_both_dead_and_pid_files_naming_another_process_signals_nothing(state_dir: Path) -> None:
    first = _up(state_dir)
    before = stack_status(state_dir)
    marks = _Marks(before.env)
    _kill9(before.kafka.pid)
    _kill9(before.redis.pid)
    # The pids were reused by a program that is not ours: `up` and `down` must never signal it.
    stranger = subprocess.Popen(["sleep", "300"])
    try:
        for name in ("kafka.pid", "redis.pid"):
            (state_dir / name).write_text(f"{stranger.pid}\n")
        status = stack_status(state_dir)
        assert not status.anything_running, f"a stranger's pid was taken for the stack's: {status}"

        second = _up(state_dir)

        assert stranger.poll() is None, "stack up signalled a process that is not the stack's"
        after = stack_status(state_dir)
        assert second == first
        assert after.healthy, after
        assert stranger.pid not in (after.kafka.pid, after.redis.pid)
        assert (after.kafka.ports, after.redis.ports) == (before.kafka.ports, before.redis.ports)
        marks.assert_kept()
    finally:
        stranger.kill()
        stranger.wait(10)


def test_a_live_server_whose_pid_file_is_lost_or_stale_is_found_by_its_folder_and_left_alone(state_dir: Path) -> None:
    first = _up(state_dir)
    before = stack_status(state_dir)
    stranger = subprocess.Popen(["sleep", "300"])
    try:
        (state_dir / "redis.pid").unlink()
        (state_dir / "kafka.pid").write_text(f"{stranger.pid}\n")
        (state_dir / "redis" / "redis.conf").unlink()  # as a stack made before Redis had one: stack.env has its port

        assert _up(state_dir) == first

        after = stack_status(state_dir)
        assert (after.kafka.pid, after.redis.pid) == (before.kafka.pid, before.redis.pid), "nothing restarted"
        assert stranger.poll() is None
        assert (state_dir / "kafka.pid").read_text() == f"{before.kafka.pid}\n"
        assert (state_dir / "redis.pid").read_text() == f"{before.redis.pid}\n"
    finally:
        stranger.kill()
        stranger.wait(10)


def test_up_refuses_a_port_someone_else_took_and_changes_nothing(state_dir: Path) -> None:
    first = _up(state_dir)
    before = stack_status(state_dir)
    marks = _Marks(before.env)
    _kill9(before.redis.pid)
    port = before.redis.ports[0]
    squatter = socket.socket()
    try:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port))
        squatter.listen(1)

        refused = _stack_cli(state_dir, "up")

        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert f"127.0.0.1:{port}" in refused.stderr, refused.stderr
        assert "nothing was changed" in refused.stderr and "ss -ltnp" in refused.stderr, refused.stderr
        during = stack_status(state_dir)
        assert during.kafka.pid == before.kafka.pid and during.kafka.serving, "the broker was touched"
        assert not during.redis.alive
        assert (state_dir / ENV_FILE_NAME).read_text() == first
    finally:
        squatter.close()

    assert _up(state_dir) == first, "once the port is free, the same stack comes back"
    assert stack_status(state_dir).kafka.pid == before.kafka.pid
    marks.assert_kept()


def test_two_ups_at_once_make_one_stack(state_dir: Path) -> None:
    argv = [sys.executable, "-m", "batchwire.cli", "stack", "up", "--state-dir", str(state_dir)]
    env = _cli_env(state_dir)
    racers = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in "ab"]
    outputs = [racer.communicate(timeout=150) for racer in racers]

    assert [racer.returncode for racer in racers] == [0, 0], outputs
    assert outputs[0][0] == outputs[1][0], "both print the one stack's addresses"
    status = stack_status(state_dir)
    assert status.healthy, status
    assert _processes_in(state_dir / "kafka") == [status.kafka.pid], "exactly one broker"
    assert _processes_in(state_dir / "redis") == [status.redis.pid], "exactly one Redis"


def test_status_names_each_server_alive_or_dead_with_pid_and_port(state_dir: Path) -> None:
    _up(state_dir)
    before = stack_status(state_dir)
    _kill9(before.redis.pid)

    done = _stack_cli(state_dir, "status")

    assert done.returncode == 1, "a half-dead stack is not healthy"
    assert f"# kafka: alive, serving (pid {before.kafka.pid}, port {before.kafka.ports[0]})" in done.stdout
    assert f"# redis: dead (port {before.redis.ports[0]};" in done.stdout, done.stdout

    as_json = _stack_cli(state_dir, "status", "--json")
    report = json.loads(as_json.stdout)
    assert as_json.returncode == 1 and not report["healthy"]
    kafka, redis_server = report["servers"]
    assert (kafka["kind"], kafka["node_id"], kafka["pid"], kafka["port"], kafka["alive"]) == (
        "kafka",
        1,
        before.kafka.pid,
        before.kafka.ports[0],
        True,
    )
    assert kafka["leads"], "the lone broker leads every partition"
    assert (redis_server["kind"], redis_server["alive"], redis_server["role"]) == ("redis", False, None)
    assert report["redis_primary_port"] is None


def test_provide_infra_local_can_restart(tmp_path: Path) -> None:
    from infra.select import provide_infra

    with provide_infra("local", work_dir=tmp_path) as provided:
        assert provided.kind == "local"
        assert provided.can_restart
        assert redis_pings(int(provided.redis_url.rsplit(":", 1)[1].split("/")[0]))
        provided.restart_redis()
        provided.stop_kafka()
        assert not run_blocking(lambda: kafka_serves(provided.kafka_bootstrap, request_timeout_s=1.0))
        provided.start_kafka()
        assert run_blocking(lambda: kafka_serves(provided.kafka_bootstrap))


def test_up_without_java_says_so_and_starts_nothing(state_dir: Path, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    redis_binary = shutil.which("redis-server")
    assert redis_binary is not None, "the test needs redis-server"
    (bin_dir / "redis-server").symlink_to(redis_binary)
    env = {key: value for key, value in _cli_env(state_dir).items() if key != "JAVA_HOME"}
    env["PATH"] = str(bin_dir)  # redis-server, but no java

    done = subprocess.run(
        [sys.executable, "-m", "batchwire.cli", "stack", "up", "--state-dir", str(state_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )

    assert done.returncode == 1 and "java not found" in done.stderr, done.stderr
    assert _processes_in(state_dir / "redis") == [], "Redis was started and left running"
    assert not stack_status(state_dir).anything_running
