"""The open-loop sender against a fake server: timing from the schedule, and every error kind.

The tests that bound a time are marked ``timing``; those that count outcomes run with the unit tests."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from batchwire.bench import sends
from batchwire.bench.client import ClientKind
from infra.ports import free_port
from tests.support.bench_rates import one_rate
from tests.support.fake_inference_server import Behaviour, FakeServer


@pytest.fixture(params=["aiohttp", "raw"])
def client(request: pytest.FixtureRequest) -> ClientKind:
    """The tests run with both HTTP clients: they must classify outcomes alike."""
    kind: ClientKind = request.param
    return kind


@pytest.fixture
def behaviour() -> Behaviour:
    return Behaviour(delay_s=0.2)


@pytest.mark.timing
async def test_latency_is_the_server_delay_at_low_rate(fake: FakeServer, client: ClientKind) -> None:
    rate = await one_rate(fake.url, 20.0, metrics=fake.metrics_url, client=client)
    assert rate["errors"] == {}
    assert rate["ok"] == rate["scheduled"] > 5
    p50 = rate["latency_ms"]["p50"]
    assert 195 <= p50 <= 320, f"a 200 ms server at 20 req/s should give p50 near 200 ms, got {p50}"
    assert rate["lag_ms"]["p50"] < 20
    server = rate["server"]
    assert server is not None
    assert server["batch_size_mean"] == pytest.approx(2.0)
    assert server["flushes"].get("full", 0) > 0


@pytest.mark.timing
async def test_throughput_counts_answers_inside_the_window(fake: FakeServer, client: ClientKind) -> None:
    rate = await one_rate(fake.url, 50.0, duration=1.0, warmup=0.3, client=client)
    # Requests sent in the last 200 ms of the window are answered after it: they are drained, not throughput.
    assert rate["drained_answers"] > 0
    assert 0.0 < rate["drain_s"] < 0.5
    assert rate["throughput_rps"] == pytest.approx(rate["answers_in_window"] / 1.0)
    assert 25 <= rate["throughput_rps"] <= 80


@pytest.mark.timing
@pytest.mark.parametrize("behaviour", [Behaviour()])
async def test_latency_counts_from_the_schedule_not_the_send(fake: FakeServer, client: ClientKind) -> None:
    """A stalled client must show up as latency and lag (no coordinated omission)."""
    loop = asyncio.get_running_loop()
    loop.call_later(0.6, time.sleep, 0.25)  # freezes the event loop mid-window
    rate = await one_rate(fake.url, 100.0, duration=1.0, warmup=0.2, client=client)
    assert rate["lag_ms"]["max"] >= 200, f"the 250 ms stall should appear as lag, got {rate['lag_ms']}"
    assert rate["latency_ms"]["max"] >= 200, f"... and as latency, got {rate['latency_ms']}"
    recorded = sends.decode(rate["sends"])
    assert len(recorded) == rate["sent"], "one record per measured send"
    assert [due for due, _ in recorded] == sorted(due for due, _ in recorded), "in the schedule's order"
    assert 0.0 <= recorded[0][0] < 1.0, "due times count from the window's start"
    stalled = [due for due, lag in recorded if lag >= 0.2]
    assert stalled and all(0.3 <= due <= 0.7 for due in stalled), f"the stall's sends, due while it froze: {stalled}"


@pytest.mark.parametrize("behaviour", [Behaviour(fail_every=4)])
async def test_http_errors_are_counted_by_status(fake: FakeServer, client: ClientKind) -> None:
    rate = await one_rate(fake.url, 100.0, client=client)
    failed = rate["errors"].get("http_503", 0)
    assert 0.15 * rate["sent"] <= failed <= 0.35 * rate["sent"], f"1 in 4 should fail, got {rate['errors']}"
    assert rate["ok"] + rate["error_total"] == rate["scheduled"]
    assert rate["latency_all_ms"]["count"] == rate["sent"]


@pytest.mark.parametrize("behaviour", [Behaviour(wrong_every=5)])
async def test_check_catches_wrong_answers(fake: FakeServer, client: ClientKind) -> None:
    checked = await one_rate(fake.url, 100.0, expect="reverse", client=client)
    assert checked["errors"].get("wrong_answer", 0) > 0.1 * checked["sent"]
    unchecked = await one_rate(fake.url, 100.0, expect="none", client=client)
    assert unchecked["errors"] == {}


@pytest.mark.timing
@pytest.mark.parametrize("behaviour", [Behaviour(delay_s=0.3)])
async def test_concurrency_limit_counts_instead_of_blocking(fake: FakeServer, client: ClientKind) -> None:
    rate = await one_rate(fake.url, 50.0, concurrency_limit=3, client=client)
    assert rate["errors"].get("client_limit", 0) > 0.5 * rate["scheduled"]
    assert rate["generator"]["max_outstanding"] <= 3
    # A send that waited for a free slot would lag by the server's 300 ms, and most sends find none free:
    # the typical send's lag stays under half of that (the tail moves with the machine's own stalls).
    assert rate["lag_ms"]["p50"] < 150, "refused sends must not delay the schedule"


@pytest.mark.parametrize("behaviour", [Behaviour(delay_s=1.0)])
async def test_timeouts_are_counted(fake: FakeServer, client: ClientKind) -> None:
    rate = await one_rate(fake.url, 20.0, duration=0.5, warmup=0.0, timeout_s=0.2, client=client)
    assert rate["errors"].get("timeout", 0) == rate["sent"] > 0


async def test_connection_errors_are_counted(client: ClientKind) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1/inference"  # nothing listens there
    rate = await one_rate(url, 50.0, duration=0.5, warmup=0.0, client=client)
    assert rate["errors"].get("connection", 0) == rate["sent"] > 0
    assert rate["ok"] == 0


@pytest.mark.timing
@pytest.mark.parametrize("behaviour", [Behaviour(delay_s=0.2, script=("200", "503", "429", "200", "503"))])
async def test_refusals_are_timed_apart_from_answers(fake: FakeServer, client: ClientKind) -> None:
    rate = await one_rate(fake.url, 50.0, duration=1.0, warmup=0.0, client=client)
    script = Counter(fake.answered)
    refused = rate["refused_ms"]
    assert refused["count"] == script["503"] + script["429"] == rate["error_total"] > 10, (rate["errors"], script)
    assert rate["latency_ms"]["count"] == rate["ok"] == script["200"]
    # The fake refuses at once and answers after 200 ms: the two must not be mixed up. Every answer
    # takes the full 200 ms, and most refusals take next to nothing even when the generator lags.
    answers = rate["latency_ms"]
    assert refused["p50"] < 100 and answers["min"] >= 195, f"refused {refused}, answers {answers}"
    from_send = rate["refused_from_send_ms"]
    assert from_send["count"] == refused["count"]
    assert from_send["max"] <= refused["max"], "timed from the send, the generator's lag is left out"
    assert rate["after_504"]["answered"] == 0
