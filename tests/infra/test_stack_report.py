"""`stack status`'s advice on a server that is not running names the stack it reports on: its --state-dir,
and a replicated stack's shape, so `up` as written starts that stack, not the default one, and is not
refused for its shape. The default stack's advice stays bare.

No server runs: the status of a stopped stack is read from its recorded ports and shape alone."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from batchwire.cli import main
from infra.cluster_stack import SHAPE_FILE_NAME, Shape
from infra.redis_server import CONFIG_NAME

HA = Shape(brokers=3, redis_replicas=1)
REDIS_CLUSTER = Shape(brokers=3, redis_replicas=0, redis_cluster=3)
RECORDED_PORT = 45678


def _status(state_dir: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> list[str]:
    code = main(["stack", "status", "--state-dir", str(state_dir), *flags])
    out, err = capsys.readouterr()
    assert code == 1, f"expected exit 1 for a stopped stack, got {code}: {out}{err}"
    return out.splitlines()


def _up(state_dir: Path, shape: Shape | None) -> str:
    flags = "" if shape is None else f" {shape.flags()}"
    return f"`batchwire stack up{flags} --state-dir {shlex.quote(str(state_dir.resolve()))}`"


def _record_shape(state_dir: Path, shape: Shape) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    lines = f"brokers={shape.brokers}\nredis_replicas={shape.redis_replicas}\nredis_cluster={shape.redis_cluster}\n"
    (state_dir / SHAPE_FILE_NAME).write_text(lines)


def _record_redis_port(work_dir: Path) -> None:
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / CONFIG_NAME).write_text(f"port {RECORDED_PORT}\n")


def test_a_named_single_stack_names_its_state_dir_in_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state_dir = tmp_path / "my stack"
    _record_redis_port(state_dir / "redis")
    up = _up(state_dir, None)

    lines = _status(state_dir, capsys)

    assert f"# kafka: none yet ({up} starts one)" in lines, f"expected {up} in: {lines}"
    assert f"# redis: dead (port {RECORDED_PORT}; {up} starts it again with its data)" in lines, lines


@pytest.mark.parametrize("shape", [HA, REDIS_CLUSTER], ids=["replicas", "redis-cluster"])
def test_a_replicated_stack_names_its_shape_and_state_dir_in_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], shape: Shape
) -> None:
    state_dir = tmp_path / "ha stack"
    _record_shape(state_dir, shape)
    _record_redis_port(state_dir / "redis-1")
    up = _up(state_dir, shape)

    lines = [line for line in _status(state_dir, capsys) if line.startswith("# ")]

    assert f"# redis-1: dead (port {RECORDED_PORT}; {up} starts it again with its data)" in lines, lines
    assert sum(line.startswith("# kafka-") for line in lines) == shape.brokers, f"expected each node: {lines}"
    assert all(up in line for line in lines), f"expected {up} on every line: {lines}"


@pytest.mark.parametrize("absolute", [False, True], ids=["relative", "absolute"])
def test_the_default_stack_s_advice_stays_bare(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, absolute: bool
) -> None:
    monkeypatch.chdir(tmp_path)
    state_dir = Path(".batchwire")
    _record_redis_port(state_dir / "redis")

    lines = _status(state_dir.resolve() if absolute else state_dir, capsys)

    assert "# kafka: none yet (`batchwire stack up` starts one)" in lines, lines
    assert f"# redis: dead (port {RECORDED_PORT}; `batchwire stack up` starts it again with its data)" in lines, lines


@pytest.mark.parametrize("shape", [None, HA], ids=["single", "replicated"])
def test_the_json_form_gives_no_advice(tmp_path: Path, capsys: pytest.CaptureFixture[str], shape: Shape | None) -> None:
    state_dir = tmp_path / "my stack"
    if shape is not None:
        _record_shape(state_dir, shape)
    _record_redis_port(state_dir / ("redis" if shape is None else "redis-1"))

    document = json.loads("\n".join(_status(state_dir, capsys, "--json")))

    assert sorted(document) == ["env", "healthy", "redis_primary_port", "servers", "state_dir"], document
    assert "batchwire stack" not in json.dumps(document), document


def test_a_replicated_server_with_no_port_recorded_is_none_yet_as_in_the_single_stack(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A shape recorded before any server started (a first `up` that failed): nothing to start again, no data."""
    state_dir = tmp_path / "ha stack"
    _record_shape(state_dir, HA)
    up = _up(state_dir, HA)

    lines = [line for line in _status(state_dir, capsys) if line.startswith("# ")]

    assert f"# kafka-1: none yet ({up} starts one)" in lines, lines
    assert not any("port None" in line or "with its data" in line for line in lines), lines
