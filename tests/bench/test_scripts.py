"""The summaries that bench/cpu_floor.sh and bench/mechanisms_ab.sh print over a sitting's runs, run
on results.json files written here (the scripts themselves start systems and send load)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _summary(script: str) -> str:
    """The Python of the script's ``<<'PY'`` heredoc."""
    text = (BENCH / script).read_text()
    return text.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]


def _rate(p50_ms: float | None) -> dict[str, Any]:
    group = {"pids": [1], "cpu_s": 1.0, "cores": 0.5, "us_per_request": 400.0 if p50_ms else None}
    return {
        "latency_ms": {"count": 0.0} if p50_ms is None else {"count": 9.0, "p50": p50_ms, "p99": 2 * p50_ms},
        "lag_ms": {"count": 0.0} if p50_ms is None else {"count": 9.0, "p99": 1.0},
        "generator": {"cores": 0.1},
        "processes": {"batchwire": group, "batchwire.gateway": group, "kafka": group, "redis": group},
    }


def _write(folder: Path, rates: list[dict[str, Any]], lone: bool = True) -> None:
    folder.mkdir(parents=True)
    run: dict[str, Any] = {"label": "x", "policy": None, "sut": None, "rates": rates}
    if lone:
        run["lone"] = {"latency_ms": {"count": 20.0, "p50": 105.0}}
    (folder / "results.json").write_text(json.dumps({"runs": [run]}))


def _run(script: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-", *argv], input=_summary(script), capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("failed", ["no rate", "no answer"])
def test_cpu_floor_leaves_out_a_run_that_measured_nothing(tmp_path: Path, failed: str) -> None:
    """One run whose system did not start (no rate), or that answered nothing, ended the sitting's summary
    in an IndexError or a KeyError."""
    for mode in ("echo", "echo-asgi", "embedded", "kafka"):
        _write(tmp_path / f"{mode}-1", [_rate(100.0)])
    _write(tmp_path / "kafka-2", [] if failed == "no rate" else [_rate(None)], lone=False)
    done = _run("cpu_floor.sh", str(tmp_path))
    assert done.returncode == 0, done.stderr
    row = done.stdout.splitlines()[-1].split()
    assert row[:5] == ["kafka", "400", "1.00", "800", "200.0"], f"expected the good run's figures alone:\n{done.stdout}"


@pytest.mark.parametrize("rates", [[], ["good"], ["good", "none"]])
def test_mechanisms_ab_leaves_out_a_run_that_measured_less_than_both_rates(tmp_path: Path, rates: list[str]) -> None:
    _write(tmp_path / "default-1", [_rate(100.0), _rate(150.0)])
    _write(tmp_path / "default-2", [_rate(100.0) if r == "good" else _rate(None) for r in rates], lone=False)
    done = _run("mechanisms_ab.sh", str(tmp_path), "default")
    assert done.returncode == 0, done.stderr
    row = done.stdout.splitlines()[-1].split()
    assert row[:6] == ["default", "100.0", "200.0", "300.0", "400", "800"], done.stdout
