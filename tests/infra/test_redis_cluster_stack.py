"""`batchwire stack up --redis-cluster 3`: three primaries, each with a replica, and one broker, detached.

A stack of its own in a state dir of its own; real SIGKILLs.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from infra.process import ServiceProcess
from infra.stack import ENV_FILE_NAME, REDIS_ENV, read_env_file
from tests.support.stack_cli import discard_stack
from tests.support.stack_cli import stack_cli as _cli

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(120)]

SHAPE = ("--redis-cluster", "3")
FAILOVER_DEADLINE_S = 20.0


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    state = tmp_path / "state"
    try:
        done = _cli(state, "up", *SHAPE)
        assert done.returncode == 0, f"stack up exited {done.returncode}:\n{done.stderr}"
        yield state
    finally:
        discard_stack(state)


def _redis(state_dir: Path) -> list[dict[str, Any]]:
    report: dict[str, Any] = json.loads(_cli(state_dir, "status", "--json").stdout)
    return sorted((s for s in report["servers"] if s["kind"] == "redis"), key=lambda s: s["node_id"])


def test_up_starts_a_cluster_a_killed_primary_is_replaced_and_comes_back_as_a_replica(state_dir: Path) -> None:
    url = read_env_file(state_dir / ENV_FILE_NAME)[REDIS_ENV]
    servers = _redis(state_dir)
    assert url.startswith("redis+cluster://") and url.count(",") == 5, url
    assert sorted(s["role"] for s in servers) == ["primary"] * 3 + ["replica"] * 3, servers
    with redis.RedisCluster(host="127.0.0.1", port=servers[0]["port"]) as client:
        client.set("stack-test:mark", b"kept")
        holder = client.get_node_from_key("stack-test:mark")
        assert client.wait(1, 5_000, target_nodes=holder) == 1, "its replica acknowledged the write"
    old = next(s for s in servers if s["port"] == int(holder.port))

    process = ServiceProcess.attach(old["pid"], [])
    assert process is not None
    os.kill(old["pid"], signal.SIGKILL)
    assert process.wait_exit(10.0)
    killed = time.monotonic()
    alive = next(s for s in servers if s["port"] != old["port"])
    while True:  # the replica's promotion: the cluster's node timeout, then its election
        with redis.RedisCluster(host="127.0.0.1", port=alive["port"]) as client:
            if int(client.get_node_from_key("stack-test:mark").port) != old["port"]:
                assert client.get("stack-test:mark") == b"kept"
                break
        assert time.monotonic() - killed < FAILOVER_DEADLINE_S, "the replica did not take over"
        time.sleep(0.2)

    done = _cli(state_dir, "up", *SHAPE)
    assert done.returncode == 0, done.stderr
    assert "restarted over its data as a cluster node (pid" in done.stdout + done.stderr, done.stdout + done.stderr
    back = next(s for s in _redis(state_dir) if s["node_id"] == old["node_id"])
    assert (back["port"], back["role"]) == (old["port"], "replica"), back

    refused = _cli(state_dir, "up")
    assert refused.returncode == 1 and "--redis-cluster 3" in refused.stderr, refused.stderr
