"""Tasks answered 504, read back after the run: how many the service computed for nobody."""

from __future__ import annotations

from collections import Counter

import pytest
from yarl import URL

from batchwire.bench.late import read_back
from batchwire.bench.report import run_table
from batchwire.bench.results import RunReport
from batchwire.bench.runner import summary_line
from infra.ports import free_port
from tests.support.bench_rates import one_rate
from tests.support.fake_inference_server import Behaviour, FakeServer

SCRIPT = ("200", "504:completed", "200", "504:expired", "503", "504:completed", "200", "200")


@pytest.mark.parametrize("behaviour", [Behaviour(delay_s=0.05, script=SCRIPT)])
async def test_tasks_answered_504_are_read_back_and_counted(fake: FakeServer) -> None:
    rate = await one_rate(fake.url, 60.0, duration=1.0, warmup=0.0, timeout_s=5.0)
    script = Counter(fake.answered)
    after = rate["after_504"]
    assert after["answered"] == rate["errors"]["http_504"] == script["504:completed"] + script["504:expired"]
    assert after["statuses"] == {"completed": script["504:completed"], "expired": script["504:expired"]}
    assert after["computed"] == script["504:completed"] > 0
    assert rate["ok"] == script["200"]
    share = after["share_of_computed"]
    assert share == pytest.approx(after["computed"] / (rate["ok"] + after["computed"]), abs=1e-5)
    assert after["without_task_id"] == 0
    unended = [note for note in rate["notes"] if "had not ended" in note]
    assert unended == [], "every task had ended when read back"  # a lag note may come from a busy machine

    table = run_table(RunReport(label="t", policy=None, sut=None, rates=[rate]))
    assert share is not None
    assert f"504 {after['answered']}: computed after the 504 {after['computed']} ({100 * share:.2f}% of" in table
    assert f"refused (503/429) {script['503']}: p50" in table
    summary = summary_line(rate)
    assert f"refused p99 {rate['refused_ms']['p99']:.2f} ms" in summary
    assert f"504 {after['answered']} (computed after: {after['computed']})" in summary


@pytest.mark.parametrize("behaviour", [Behaviour(script=("504:queued", "504"))])
async def test_unended_tasks_and_504s_without_a_task_id_are_noted(fake: FakeServer) -> None:
    rate = await one_rate(fake.url, 40.0, duration=0.5, warmup=0.0)
    script = Counter(fake.answered)
    after = rate["after_504"]
    assert after["answered"] == script["504:queued"] + script["504"]
    assert after["without_task_id"] == script["504"] > 0
    assert after["statuses"] == {"queued": script["504:queued"]}
    assert after["computed"] == 0
    assert after["share_of_computed"] is None, "nothing was computed: no share to give"
    notes = " | ".join(rate["notes"])
    assert "may still be computed" in notes and "queued=" in notes, notes
    assert "carried no error.task_id" in notes, notes


@pytest.mark.parametrize("behaviour", [Behaviour(delay_s=1.0)])
async def test_client_timeouts_are_counted_apart_and_noted(fake: FakeServer) -> None:
    rate = await one_rate(fake.url, 20.0, duration=0.5, warmup=0.0, timeout_s=0.2)
    assert rate["errors"].get("timeout", 0) == rate["sent"] > 0
    assert rate["after_504"]["answered"] == 0
    assert any("timed out in the client" in note for note in rate["notes"]), rate["notes"]
    assert f"client timeouts {rate['sent']}" in summary_line(rate)


@pytest.mark.parametrize("behaviour", [Behaviour(script=("504:completed",))])
async def test_read_back_asks_the_origin_that_answered(fake: FakeServer) -> None:
    fake.task_status["known"] = "completed"
    dead = URL(f"http://127.0.0.1:{free_port()}/v1/inference")
    statuses = await read_back([(URL(fake.url), "known"), (URL(fake.url), "unknown"), (dead, "known")], wait_s=0.5)
    assert statuses == {"completed": 1, "http_404": 1, "unreadable": 1}
