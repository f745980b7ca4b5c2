"""`stack up` on a state dir that holds another shape: refused before any server starts, with the
commands that fit that dir (no servers run here)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from infra.cluster_stack import SHAPE_FILE_NAME, Shape, up_any
from infra.errors import InfraError


def _refusal(state_dir: Path, asked: Shape) -> str:
    with pytest.raises(InfraError) as refused:
        up_any(state_dir, asked, redis_maxmemory="64mb")
    return str(refused.value)


def test_another_shape_in_a_named_state_dir_is_refused_with_commands_that_name_that_dir(tmp_path: Path) -> None:
    state_dir = tmp_path / "ha stack"
    state_dir.mkdir()
    (state_dir / SHAPE_FILE_NAME).write_text("brokers=3\nredis_replicas=1\n")
    where = f"--state-dir {shlex.quote(str(state_dir.resolve()))}"

    message = _refusal(state_dir, Shape(brokers=1, redis_replicas=1))

    assert f"Run `batchwire stack up --brokers 3 --redis-replicas 1 {where}` for it" in message, message
    assert not (state_dir / "kafka").exists() and not (state_dir / "redis").exists(), "nothing was started"


def test_a_replicated_shape_asked_of_a_named_single_stack_dir_names_that_dir(tmp_path: Path) -> None:
    state_dir = tmp_path / "single"
    (state_dir / "redis").mkdir(parents=True)
    where = f"--state-dir {shlex.quote(str(state_dir.resolve()))}"

    message = _refusal(state_dir, Shape(brokers=3, redis_replicas=1))

    assert f"Run `batchwire stack up {where}` for it" in message, message
