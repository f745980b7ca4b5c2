"""CPU accounting of process groups and finding the Kafka and Redis servers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchwire.bench.procstats import CpuSampler, discover_infra_pids, group_stats, read_env_file


def test_cpu_of_a_process_and_its_children_is_counted() -> None:
    # A parent that spins for 0.4 s of CPU inside a child: the child must be found under the root pid.
    code = (
        "import subprocess, sys; subprocess.run([sys.executable, '-c', "
        "'import time\\nend = time.process_time() + 0.4\\nwhile time.process_time() < end: pass'])"
    )
    with subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline(); " + code], stdin=subprocess.PIPE, text=True
    ) as parent:
        sampler = CpuSampler({"sut": [parent.pid], "empty": []})
        before = sampler.sample()
        assert parent.stdin is not None
        parent.stdin.write("go\n")
        parent.stdin.flush()
        # Sample while the child still runs: a finished child's time is gone from the tree.
        deadline = time.monotonic() + 10
        stats = group_stats(before, sampler.sample(), 1.0, 100)
        while stats["sut"]["cpu_s"] < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = group_stats(before, sampler.sample(), 1.0, 100)
    assert "empty" not in stats, "groups without pids are not reported"
    assert stats["sut"]["cpu_s"] >= 0.3
    assert len(stats["sut"]["pids"]) == 2
    assert stats["sut"]["us_per_request"] == pytest.approx(stats["sut"]["cpu_s"] * 1e6 / 100, rel=0.01)


def test_stack_env_is_read(tmp_path: Path) -> None:
    env = tmp_path / "stack.env"
    env.write_text(
        "# written by batchwire stack up\nBATCHWIRE_KAFKA_BOOTSTRAP=127.0.0.1:9092\n"
        "BATCHWIRE_REDIS_URL='redis://127.0.0.1:6390/0'\n"
    )
    assert read_env_file(env) == {
        "BATCHWIRE_KAFKA_BOOTSTRAP": "127.0.0.1:9092",
        "BATCHWIRE_REDIS_URL": "redis://127.0.0.1:6390/0",
    }
    assert read_env_file(tmp_path / "missing.env") == {}


def test_infra_is_found_by_its_pid_files_first(tmp_path: Path) -> None:
    (tmp_path / "kafka.pid").write_text(f"{os.getpid()}\n")
    (tmp_path / "redis.pid").write_text("not a pid\n")
    found, how = discover_infra_pids(tmp_path, {"BATCHWIRE_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert (found, how) == ({"kafka": [os.getpid()], "redis": []}, "pid file")


def test_infra_is_found_by_its_listening_port(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        found, how = discover_infra_pids(
            tmp_path,
            {
                "BATCHWIRE_REDIS_URL": f"redis://127.0.0.1:{port}/0",
                "BATCHWIRE_KAFKA_BOOTSTRAP": "127.0.0.1:1,127.0.0.1:2",
            },
        )
    assert how == "listening port"
    assert found == {"kafka": [], "redis": [os.getpid()]}


def test_a_cluster_stack_is_found_by_its_pid_files(tmp_path: Path) -> None:
    """A stack of several servers names its pid files kafka-1.pid, redis-1.pid, sentinel-1.pid...: the
    bench looked for kafka.pid alone, then took the Sentinels' ports from the Redis URL as Redis's."""
    for name in ("kafka-1", "kafka-2", "redis-1", "sentinel-1"):
        (tmp_path / f"{name}.pid").write_text(f"{os.getpid()}\n")
    found, how = discover_infra_pids(tmp_path, {"BATCHWIRE_REDIS_URL": "redis+sentinel://127.0.0.1:1/m"})
    me = os.getpid()
    assert (found, how) == ({"kafka": [me, me], "redis": [me], "sentinel": [me]}, "pid file")


def test_the_ports_of_a_sentinel_url_are_the_sentinels(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        found, _ = discover_infra_pids(tmp_path, {"BATCHWIRE_REDIS_URL": f"redis+sentinel://127.0.0.1:{port}/m"})
    assert found == {"kafka": [], "redis": [], "sentinel": [os.getpid()]}, "a Sentinel is not the Redis server"
