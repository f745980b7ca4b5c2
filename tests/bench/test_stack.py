"""The stack a kafka-mode bench runs on: stopped at the end only if the bench started it."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from batchwire.bench.own_stack import OwnStack
from batchwire.bench.stack import Stack
from batchwire.bench.sut import SutError

FAILING_DOWN = [sys.executable, "-c", "import sys; sys.exit('no stack file here' if 'down' in sys.argv else 0)"]


def test_a_stack_down_that_fails_is_an_error_and_the_state_dir_is_kept(tmp_path: Path) -> None:
    """It was reported as stopped ("stopped the Kafka + Redis stack this run started") with exit status 0."""
    stack = Stack(command=FAILING_DOWN, own=OwnStack(tmp_path))
    stack.was_up = False
    with pytest.raises(SutError, match="exited with 1, leaving the stack this run started: no stack file here"):
        stack.restore(keep=False)
    assert tmp_path.is_dir()


def test_a_stack_that_was_up_before_the_run_is_left_up() -> None:
    stack = Stack(command=FAILING_DOWN)
    stack.was_up = True
    assert stack.restore(keep=False) is False


def test_a_stack_down_that_fails_names_the_own_state_dir_quoted(tmp_path: Path) -> None:
    """The command it gives pastes as written: a temporary folder's path may hold a space."""
    state_dir = tmp_path / "bench stack"
    state_dir.mkdir()
    stack = Stack(command=FAILING_DOWN, own=OwnStack(state_dir))
    stack.was_up = False
    with pytest.raises(SutError) as failed:
        stack.restore(keep=False)
    expected = f"stop it with batchwire stack down --state-dir {shlex.quote(str(state_dir))}"
    assert str(failed.value).endswith(expected), f"expected {expected!r} in: {failed.value}"
