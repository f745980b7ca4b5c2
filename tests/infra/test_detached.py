"""The commands `stack up`'s messages about one server give (a port taken, a config gone, a server silent)
name that stack's --state-dir and shape: followed as written, they act on that stack, not the default one.
A folder they say to delete is quoted, so a path with a space pastes.

No Kafka starts: each stack is refused at its Redis, a real redis-server where one must run."""

from __future__ import annotations

import asyncio
import shlex
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from infra.cluster_stack import SHAPE_FILE_NAME, Shape, cluster_up, nodes, up_any
from infra.errors import InfraError
from infra.kafka_cluster import harden_offsets_topic
from infra.ports import free_port
from infra.redis_server import CONFIG_NAME
from infra.stack import stack_up

HA = Shape(brokers=3, redis_replicas=1)
REDIS_CLUSTER = Shape(brokers=3, redis_replicas=0, redis_cluster=3)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """A state dir outside the default folder, with a space in its name."""
    return tmp_path / "my stack"


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port this test listens on and never answers."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield listener.getsockname()[1]


def _commands(state_dir: Path, shape: Shape | None) -> tuple[str, str]:
    where = f" --state-dir {shlex.quote(str(state_dir.resolve()))}"
    flags = "" if shape is None else f" {shape.flags()}"
    return f"`batchwire stack up{flags}{where}`", f"`batchwire stack down{where}`"


def _record_ha_shape(state_dir: Path) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / SHAPE_FILE_NAME).write_text(f"brokers={HA.brokers}\nredis_replicas={HA.redis_replicas}\n")


def _record_redis_port(work_dir: Path, port: int) -> None:
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / CONFIG_NAME).write_text(f"port {port}\n")


@pytest.fixture
def start_redis() -> Iterator[Callable[[Path], None]]:
    """Starts a real redis-server in a folder (a socket file, no port): the stack knows its server by its
    folder. Killed after the test."""
    found = shutil.which("redis-server")
    assert found is not None, "the test needs redis-server"
    started: list[subprocess.Popen[bytes]] = []

    def start(work_dir: Path) -> None:
        work_dir.mkdir(parents=True, exist_ok=True)
        argv = [found, "--port", "0", "--unixsocket", "redis.sock", "--save", "", "--appendonly", "no"]
        started.append(subprocess.Popen(argv, cwd=work_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    yield start
    for process in started:
        process.kill()
        process.wait(10)


@pytest.mark.parametrize("shape", [None, HA], ids=["single", "replicated"])
def test_a_taken_port_names_the_state_dir_and_shape_in_every_command(
    state_dir: Path, held_port: int, shape: Shape | None
) -> None:
    if shape is None:
        _record_redis_port(state_dir / "redis", held_port)
    else:
        _record_ha_shape(state_dir)
        _record_redis_port(state_dir / "redis-1", held_port)
    up, down = _commands(state_dir, shape)

    with pytest.raises(InfraError) as refused:
        up_any(state_dir, shape or Shape(brokers=1, redis_replicas=0), redis_maxmemory="64mb")

    message = str(refused.value)
    assert "is taken by another process; nothing was changed" in message, message
    assert f"run {up} again" in message and f"run {down}, delete" in message, f"expected {up} and {down}: {message}"
    assert "`batchwire stack up`" not in message and "`batchwire stack down`" not in message, message


@pytest.mark.kafka
def test_a_running_redis_whose_config_is_gone_names_the_state_dir_in_the_commands(
    state_dir: Path, start_redis: Callable[[Path], None]
) -> None:
    start_redis(state_dir / "redis")

    with pytest.raises(InfraError) as refused:
        stack_up(state_dir, timeout_s=30.0)
    up, down = _commands(state_dir, None)

    message = str(refused.value)
    assert f"which records its ports, is gone; it was left running. Run {down}, then {up}" in message, message


@pytest.mark.kafka
def test_a_silent_redis_node_names_the_state_dir_and_shape_in_the_commands(
    state_dir: Path, held_port: int, start_redis: Callable[[Path], None]
) -> None:
    _record_ha_shape(state_dir)
    _record_redis_port(state_dir / "redis-1", held_port)
    start_redis(state_dir / "redis-1")

    with pytest.raises(InfraError) as refused:
        cluster_up(state_dir, HA, redis_maxmemory="64mb", timeout_s=0.5)
    up, down = _commands(state_dir, HA)

    message = str(refused.value)
    assert f"did not answer before the deadline; it was left running. See {state_dir.resolve() / 'redis-1'}" in (
        message
    ), message
    assert f"{down} then {up} restarts it" in message, message


@pytest.mark.parametrize("shape", [None, HA], ids=["single", "replicated"])
def test_a_taken_port_s_folder_to_delete_is_quoted(state_dir: Path, held_port: int, shape: Shape | None) -> None:
    """A path with a space pastes into `rm -r` only quoted."""
    work_dir = state_dir / ("redis" if shape is None else "redis-1")
    if shape is not None:
        _record_ha_shape(state_dir)
    _record_redis_port(work_dir, held_port)

    with pytest.raises(InfraError) as refused:
        up_any(state_dir, shape or Shape(brokers=1, redis_replicas=0), redis_maxmemory="64mb")

    message = str(refused.value)
    assert f", delete {shlex.quote(str(work_dir.resolve()))} and run" in message, message


def test_kafka_nodes_partly_recorded_name_the_state_dir_to_delete_quoted(state_dir: Path) -> None:
    """Refused before any server starts: one Kafka node of three has its ports recorded."""
    _record_ha_shape(state_dir)
    kafka_1 = state_dir / "kafka-1"
    kafka_1.mkdir()
    (kafka_1 / "server.properties").write_text("listeners=PLAINTEXT://127.0.0.1:45001,CONTROLLER://127.0.0.1:45002\n")
    up, down = _commands(state_dir, HA)

    with pytest.raises(InfraError) as refused:
        up_any(state_dir, HA, redis_maxmemory="64mb")

    message = str(refused.value)
    delete = f"delete {shlex.quote(str(state_dir.resolve()))} and run {up} for a new cluster"
    assert f"have no recorded ports; run {down}, {delete}" in message, message


def test_redis_cluster_nodes_partly_recorded_name_the_state_dir_to_delete_quoted(state_dir: Path) -> None:
    """Refused before any server starts: one Redis Cluster node of six has its port recorded."""
    _record_redis_port(state_dir / "redis-1", free_port())
    up, down = _commands(state_dir, REDIS_CLUSTER)

    with pytest.raises(InfraError) as refused:
        up_any(state_dir, REDIS_CLUSTER, redis_maxmemory="64mb")

    message = str(refused.value)
    delete = f"delete {shlex.quote(str(state_dir.resolve()))} and run {up} for a new cluster"
    assert f"have no recorded ports; run {down}, {delete}" in message, message


def test_a_cluster_that_does_not_answer_names_the_state_dir_and_shape_in_status_and_up(state_dir: Path) -> None:
    """The offsets topic is hardened once every node runs: a broker silent then is reported, nothing started here."""
    commands = nodes(state_dir.resolve(), HA)[0].server.commands
    bootstrap = f"127.0.0.1:{free_port()}"  # nothing listens there
    up, _ = _commands(state_dir, HA)
    status = f"`batchwire stack status --state-dir {shlex.quote(str(state_dir.resolve()))}`"

    with pytest.raises(InfraError) as refused:
        asyncio.run(harden_offsets_topic(bootstrap, HA.brokers, commands=commands, timeout_s=1.0))

    message = str(refused.value)
    assert f"{status} shows which node is down, {up} tries again" in message, message
