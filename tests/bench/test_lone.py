"""The lone-request probe: nearest-rank percentiles, one request at a time after an idle gap, errors apart."""

from __future__ import annotations

import random

import pytest

from batchwire.bench.client import ClientKind
from batchwire.bench.lone import LoneReport, lone_line, lone_probe, nearest_rank_ms
from batchwire.bench.report import compare_table, run_table
from batchwire.bench.results import RunReport
from batchwire.bench.runner import make_client
from batchwire.bench.schedule import InputFactory
from tests.support.fake_inference_server import Behaviour, FakeServer


@pytest.fixture(params=["aiohttp", "raw"])
def client(request: pytest.FixtureRequest) -> ClientKind:
    kind: ClientKind = request.param
    return kind


def test_nearest_rank_of_twenty_samples() -> None:
    samples = [float(value) for value in range(20, 0, -1)]  # 20 down to 1: the order sent does not matter
    summary = nearest_rank_ms(samples)
    assert summary == {
        "count": 20.0,
        "min": 1.0,
        "mean": 10.5,
        "p50": 10.0,
        "p90": 18.0,
        "p99": 20.0,
        "max": 20.0,
    }, "p50 is the 10th of 20, p90 the 18th, p99 the slowest"


def test_nearest_rank_of_one_and_of_none() -> None:
    assert nearest_rank_ms([7.5]) == {
        "count": 1.0,
        "min": 7.5,
        "mean": 7.5,
        "p50": 7.5,
        "p90": 7.5,
        "p99": 7.5,
        "max": 7.5,
    }
    assert nearest_rank_ms([]) == {"count": 0.0}


async def _probe(server: FakeServer, kind: ClientKind, count: int, gap_s: float) -> LoneReport:
    http = make_client(kind, 10, 5.0)
    try:
        inputs = InputFactory(16, random.Random(1), nonce="t")
        return await lone_probe(http, [server.url], inputs, count=count, gap_s=gap_s, expect="reverse")
    finally:
        await http.close()


@pytest.mark.parametrize("behaviour", [Behaviour(delay_s=0.05)])
async def test_requests_go_one_at_a_time_each_after_the_gap(fake: FakeServer, client: ClientKind) -> None:
    report = await _probe(fake, client, count=5, gap_s=0.04)
    assert report["count"] == 5 and report["ok"] == 5 and report["errors"] == {}
    assert len(report["samples_ms"]) == 5
    assert all(50.0 <= sample < 500.0 for sample in report["samples_ms"]), report["samples_ms"]
    assert report["latency_ms"]["p50"] == sorted(report["samples_ms"])[2]
    assert report["gap_ms"] == 40.0
    assert fake.max_in_flight == 1, "a lone request must never overlap another"
    assert len(fake.spans) == 6, "one unmeasured request opens the connection, then the 5 measured"
    idle = [nxt[0] - prev[1] for prev, nxt in zip(fake.spans, fake.spans[1:], strict=False)]
    assert min(idle) >= 0.04, f"each request should reach the server at least the gap after the last answer: {idle}"


@pytest.mark.parametrize("behaviour", [Behaviour(fail_every=2)])
async def test_refusals_are_errors_not_latencies(fake: FakeServer, client: ClientKind) -> None:
    report = await _probe(fake, client, count=4, gap_s=0.0)
    # The server counts the unmeasured first request too: the measured ones are its 2nd to 5th.
    assert report["errors"] == {"http_503": 2}
    assert report["ok"] == 2
    assert report["latency_ms"]["count"] == 2.0


def test_the_table_and_the_comparison_show_the_probe() -> None:
    lone = LoneReport(
        count=3, gap_ms=300.0, ok=2, errors={"http_503": 1}, latency_ms=nearest_rank_ms([104.0, 108.0]), samples_ms=[]
    )
    assert lone_line(lone) == (
        "lone requests (3 one at a time, 300 ms idle before each): p50 104.0, p99 108.0, min 104.0, max 108.0 ms, "
        "errors http_503=1"
    )
    a = RunReport(label="rf1", policy=None, sut=None, rates=[], lone=lone)
    faster = LoneReport(**{**lone, "latency_ms": nearest_rank_ms([52.0, 54.0])})
    b = RunReport(label="rf3", policy=None, sut=None, rates=[], lone=faster)
    assert run_table(a).endswith("  " + lone_line(lone))
    compared = compare_table(a, b)
    assert "lone p50: A 104.0, B 52.0 ms, B/A 0.50x" in compared
    assert "lone p99: A 108.0, B 54.0 ms, B/A 0.50x" in compared
