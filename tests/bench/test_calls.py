"""The record of a rate's backend calls: read from the workers' batch journal, stored compactly, and
taken by a real bench run of the real service."""

from __future__ import annotations

import contextlib
import io
import json
import statistics
import tempfile
from pathlib import Path

import pytest

from batchwire.bench import calls
from batchwire.bench.cli import main
from batchwire.bench.sends import SendsError
from batchwire.capacity.curve import Curve
from batchwire.capacity.measured import read_runs


def _line(start: float, end: float, size: int = 3, outcome: str = "ok", delivery: int = 1) -> str:
    entry = {"size": size, "start": start, "end": end, "outcome": outcome, "delivery": delivery}
    return json.dumps({"worker": "w0", "batch_id": "b", "task_ids": ["t"] * size, **entry})


def test_the_window_holds_the_first_deliveries_successful_calls_that_started_in_it(tmp_path: Path) -> None:
    journal = tmp_path / "batches.jsonl"
    lines = [
        _line(9.9, 10.05),  # started before the window
        _line(10.0, 10.02, size=1),
        _line(10.5, 10.6, outcome="partial"),  # a poison input's call: not the backend's usual time
        _line(11.0, 11.5, delivery=2),  # a batch that came back runs carefully, in parts
        _line(19.99, 20.3, size=7),  # ends after the window: its start counts
        _line(20.0, 20.1),  # the window is half-open
    ]
    journal.write_text("\n".join(lines) + '\n{"size": 2, "sta')  # a line a worker is still writing
    got = calls.read(journal, 10.0, 20.0)
    assert [(round(c.at_s, 6), c.size, round(c.seconds, 6)) for c in got] == [(0.0, 1, 0.02), (9.99, 7, 0.31)]
    assert calls.read(tmp_path / "missing.jsonl", 0.0, 1.0) == [], "a service without a journal records none"


def test_the_record_keeps_sizes_and_microseconds_and_refuses_what_is_not_one() -> None:
    record = [calls.Call(0.0, 1, 0.000001), calls.Call(0.0000015, 100, 0.1234567), calls.Call(19.5, 37, 2.5)]
    back = calls.decode(calls.encode(record))
    assert back == [(0.0, 1, 0.000001), (0.000002, 100, 0.123457), (19.5, 37, 2.5)]
    assert calls.decode(calls.encode([])) == []
    with pytest.raises(SendsError, match="call record"):
        calls.decode("not base64!")


@pytest.mark.slow
def test_a_run_of_the_real_service_records_its_calls_and_leaves_no_journal(tmp_path: Path) -> None:
    scratch = set(Path(tempfile.gettempdir()).glob("batchwire-bench-*.batches.jsonl"))
    out = tmp_path / "out"
    argv = ["--start", "embedded", "--workers", "2", "--sim-latency-ms", "20", "--rate", "60", "--duration", "2"]
    with contextlib.redirect_stdout(io.StringIO()):
        status = main([*argv, "--warmup", "0.3", "--lone", "0", "--warm", "0", "--out", str(out)])
    assert status == 0
    (run,) = read_runs(out / "results.json")
    (rate,) = run.rates
    extras = rate.call_extras_ms(Curve.flat(20.0, 100))
    assert rate.batches is not None and len(extras) == pytest.approx(rate.batches, abs=2), (
        f"{len(extras)} calls recorded, {rate.batches} batches scraped in the same window"
    )
    starts = [at for at, _ in extras]
    # The window's ends are read when the bench's sleeps wake, so a busy loop can stretch it a little.
    assert starts == sorted(starts) and starts[0] >= 0.0 and starts[-1] < 2.5, "starts within the 2 s window"
    assert all(extra > -1.0 for _, extra in extras), "a 20 ms sleep cannot end much sooner"
    assert statistics.median(extra for _, extra in extras) < 20.0, "a call of the 20 ms sim backend"
    left = set(Path(tempfile.gettempdir()).glob("batchwire-bench-*.batches.jsonl")) - scratch
    assert not left, f"the bench's scratch journal must go with its run: {left}"
