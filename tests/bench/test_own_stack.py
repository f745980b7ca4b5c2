"""A stack of the run's own: the roles' environment points at it alone; its servers' pids by kind."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchwire.bench.command import stack_settings
from batchwire.bench.own_stack import OwnStack, child_env, server_pids


def test_the_own_stack_replaces_the_addresses_and_keeps_other_settings(tmp_path: Path) -> None:
    base = {
        "BATCHWIRE_KAFKA_BOOTSTRAP": "elsewhere:9092",
        "BATCHWIRE_REDIS_URL": "redis://elsewhere:6379/0",
        "BATCHWIRE_GC_THRESHOLD": "off",
        "PATH": "/bin",
    }
    env = child_env(base, OwnStack(tmp_path, brokers=3, redis_replicas=1))
    assert env == {
        "BATCHWIRE_GC_THRESHOLD": "off",
        "PATH": "/bin",
        "PYTHONUNBUFFERED": "1",
        "BATCHWIRE_STACK_ENV": str(tmp_path / "stack.env"),
    }
    assert base["BATCHWIRE_KAFKA_BOOTSTRAP"] == "elsewhere:9092", "the bench's own environment is left alone"


def test_without_an_own_stack_the_environment_is_passed_on(tmp_path: Path) -> None:
    base = {"BATCHWIRE_KAFKA_BOOTSTRAP": "elsewhere:9092"}
    assert child_env(base, None) == {"BATCHWIRE_KAFKA_BOOTSTRAP": "elsewhere:9092", "PYTHONUNBUFFERED": "1"}


def test_flags_give_stack_up_the_shape_and_the_dir(tmp_path: Path) -> None:
    assert OwnStack(tmp_path, brokers=3, redis_replicas=1).flags() == [
        "--state-dir",
        str(tmp_path),
        "--brokers",
        "3",
        "--redis-replicas",
        "1",
    ]


def test_server_pids_by_kind_live_ones_only() -> None:
    status = {
        "servers": [
            {"kind": "kafka", "node_id": 1, "pid": 11, "alive": True},
            {"kind": "kafka", "node_id": 2, "pid": None, "alive": False},
            {"kind": "kafka", "node_id": 3, "pid": 13, "alive": True},
            {"kind": "redis", "node_id": 1, "pid": 21, "alive": True},
            {"kind": "redis", "node_id": 2, "pid": 22, "alive": True},
            {"kind": "sentinel", "node_id": 1, "pid": 31, "alive": True},
        ]
    }
    assert server_pids(status) == {"kafka": [11, 13], "redis": [21, 22], "sentinel": [31]}
    assert server_pids({}) == {"kafka": [], "redis": []}, "no stack: empty groups, never a missing kind"


def test_the_bench_reads_the_redis_its_roles_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a stack of the run's own, a BATCHWIRE_REDIS_URL set in the shell named another Redis, whose
    commands the bench then counted while the roles used the stack's."""
    own = OwnStack(tmp_path / "own")
    own.state_dir.mkdir()
    (own.state_dir / "stack.env").write_text("BATCHWIRE_REDIS_URL=redis://127.0.0.1:7001/0\n")
    shell = {"BATCHWIRE_REDIS_URL": "redis://elsewhere:6379/0"}
    assert stack_settings(own, shell)["BATCHWIRE_REDIS_URL"] == "redis://127.0.0.1:7001/0"
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".batchwire").mkdir()
    (tmp_path / ".batchwire" / "stack.env").write_text("BATCHWIRE_REDIS_URL=redis://127.0.0.1:7002/0\n")
    assert stack_settings(None, shell)["BATCHWIRE_REDIS_URL"] == "redis://elsewhere:6379/0", (
        "set ones win, as in the roles"
    )
    assert stack_settings(None, {})["BATCHWIRE_REDIS_URL"] == "redis://127.0.0.1:7002/0"
