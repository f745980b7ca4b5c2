"""A heartbeat's figures: what the process's own metrics did in the last window, as Prometheus would say."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from telemetry.heartbeat import Reader, batcher_figures, gateway_figures, worker_figures
from telemetry.metrics import REGISTRY, REQUEST_LATENCY
from tests.support.fake_clock import FakeClock


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def test_quantiles_interpolate_within_a_bucket_as_histogram_quantile_does(registry: CollectorRegistry) -> None:
    latency = Histogram("lat_seconds", "", buckets=(0.1, 0.2, 0.5), registry=registry)
    clock = FakeClock()
    reader = Reader(registry, clock)
    for _ in range(10):
        latency.observe(0.05)
        latency.observe(0.15)
    clock.advance(1.0)
    window = reader.advance()
    assert window.quantile("lat_seconds", 0.5) == pytest.approx(0.1)
    assert window.quantile("lat_seconds", 0.75) == pytest.approx(0.15)
    assert window.quantile("lat_seconds", 1.0) == pytest.approx(0.2)


def test_a_window_holds_only_what_happened_since_the_last_read(registry: CollectorRegistry) -> None:
    latency = Histogram("lat_seconds", "", buckets=(0.1, 1.0), registry=registry)
    served = Counter("served", "", ["route"], registry=registry)
    clock = FakeClock()
    reader = Reader(registry, clock)
    latency.observe(0.05)
    served.labels(route="/a").inc(100)
    clock.advance(1.0)
    reader.advance()
    latency.observe(0.5)
    served.labels(route="/a").inc(30)
    served.labels(route="/b").inc(10)
    clock.advance(2.0)
    window = reader.advance()
    assert window.quantile("lat_seconds", 0.5) == pytest.approx(0.55), "the earlier 50 ms is not in this window"
    assert window.rate("served_total") == pytest.approx(20.0)
    assert window.by("served_total", "route") == {"/a": pytest.approx(15.0), "/b": pytest.approx(5.0)}
    clock.advance(1.0)
    quiet = reader.advance()
    assert quiet.quantile("lat_seconds", 0.5) is None, "nothing observed: no quantile, not a zero"
    assert quiet.rate("served_total") == 0.0


def test_an_observation_past_the_last_bucket_reads_as_that_bucket_s_bound(registry: CollectorRegistry) -> None:
    latency = Histogram("lat_seconds", "", buckets=(0.1, 1.0), registry=registry)
    clock = FakeClock()
    reader = Reader(registry, clock)
    latency.observe(30.0)
    clock.advance(1.0)
    assert reader.advance().quantile("lat_seconds", 0.99) == pytest.approx(1.0)


def test_a_gateway_counts_its_api_not_its_probes_and_refusals_by_status(registry: CollectorRegistry) -> None:
    requests = Counter("batchwire_requests", "", ["route", "status"], registry=registry)
    latency = Histogram("batchwire_request_latency_seconds", "", ["model"], buckets=(0.1, 0.2, 1.0), registry=registry)
    Gauge("batchwire_inflight_requests", "", registry=registry).set(4)
    submits = Counter("batchwire_tier_submits", "", ["model", "priority", "outcome"], registry=registry)
    clock = FakeClock()
    reader = Reader(registry, clock)
    requests.labels(route="/v1/inference", status="200").inc(40)
    requests.labels(route="/v1/inference", status="503").inc(6)
    requests.labels(route="/v1/tasks", status="429").inc(2)
    requests.labels(route="/metrics", status="200").inc(50)
    requests.labels(route="/healthz", status="200").inc(50)
    requests.labels(route="unmatched", status="404").inc(50)
    submits.labels(model="sim", priority="normal", outcome="refused").inc(6)
    for _ in range(40):
        latency.labels(model="sim").observe(0.15)
    clock.advance(2.0)
    figures, breakdowns, per_model = gateway_figures(reader.advance(), ("sim", "other"))
    assert figures["requests_per_s"] == pytest.approx(24.0), (
        "48 API requests in 2 s; probes, scrapes and unknown paths left out"
    )
    assert figures["answered_per_s"] == pytest.approx(20.0)
    assert figures["inflight"] == 4
    assert figures["refused_per_s"] == pytest.approx(4.0)
    assert breakdowns == {"refusals_per_s": {"503": pytest.approx(3.0), "429": pytest.approx(1.0)}}
    assert 100 < figures["p50_ms"] <= 200 and 100 < figures["p99_ms"] <= 200
    assert per_model["sim"]["refused_per_s"] == pytest.approx(3.0)
    assert per_model["other"] == {"answered_per_s": 0.0, "refused_per_s": 0.0}


def test_a_gateway_s_unready_probes_and_unreadable_fleet_are_not_refusals(registry: CollectorRegistry) -> None:
    requests = Counter("batchwire_requests", "", ["route", "status"], registry=registry)
    clock = FakeClock()
    reader = Reader(registry, clock)
    requests.labels(route="/v1/inference", status="503").inc(2)
    requests.labels(route="/readyz", status="503").inc(10)  # a load balancer probing an unready gateway
    requests.labels(route="/v1/fleet", status="503").inc(4)  # the fleet's store cannot be read
    requests.labels(route="/dashboard/events", status="503").inc(4)
    clock.advance(2.0)
    figures, breakdowns, _ = gateway_figures(reader.advance(), ("sim",))
    assert figures["refused_per_s"] == pytest.approx(1.0), "only the API's 503s are refusals"
    assert breakdowns == {"refusals_per_s": {"503": pytest.approx(1.0)}}


def test_a_batcher_s_batches_sizes_queue_and_flush_reasons(registry: CollectorRegistry) -> None:
    sizes = Histogram("batchwire_batch_size", "", ["model"], buckets=(1, 10, 100), registry=registry)
    flushes = Counter("batchwire_flushes", "", ["model", "reason"], registry=registry)
    pending = Gauge("batchwire_batcher_pending", "", ["model"], registry=registry)
    clock = FakeClock()
    reader = Reader(registry, clock)
    for size in (10, 30, 50):
        sizes.labels(model="sim").observe(size)
    flushes.labels(model="sim", reason="full").inc(2)
    flushes.labels(model="sim", reason="idle_worker").inc(1)
    pending.labels(model="sim").set(12)
    clock.advance(1.0)
    figures, breakdowns, per_model = batcher_figures(reader.advance(), ("sim",))
    assert figures == {"batches_per_s": 3.0, "mean_batch_size": 30.0, "queue_depth": 12.0}
    assert breakdowns == {"flushes_per_s": {"full": 2.0, "idle_worker": 1.0}}
    assert per_model == {"sim": {"batches_per_s": 3.0, "mean_batch_size": 30.0, "queue_depth": 12.0}}


def test_a_worker_s_busy_share_and_mean_batch_are_its_own(registry: CollectorRegistry) -> None:
    busy = Counter("batchwire_worker_busy_seconds", "", ["worker"], registry=registry)
    batches = Counter("batchwire_worker_batches", "", ["worker", "outcome"], registry=registry)
    items = Counter("batchwire_worker_items", "", ["worker"], registry=registry)
    clock = FakeClock()
    reader = Reader(registry, clock)
    busy.labels(worker="w1").inc(1.5)
    batches.labels(worker="w1", outcome="ok").inc(15)
    batches.labels(worker="w1", outcome="partial").inc(5)
    items.labels(worker="w1").inc(400)
    busy.labels(worker="w2").inc(0.2)
    clock.advance(2.0)
    window = reader.advance()
    assert worker_figures(window, "w1") == {"batches_per_s": 10.0, "busy_fraction": 0.75, "mean_batch_size": 20.0}
    assert worker_figures(window, "w2") == {"batches_per_s": 0.0, "busy_fraction": pytest.approx(0.1)}


def test_a_dead_letter_is_no_batch_a_worker_ran(registry: CollectorRegistry) -> None:
    """A letter set aside runs nothing and adds no input: counted as a batch, it would read as one of size 0
    and pull the worker's mean batch size down (a redelivered batch that ran a half and set the other aside
    would count twice)."""
    batches = Counter("batchwire_worker_batches", "", ["worker", "outcome"], registry=registry)
    items = Counter("batchwire_worker_items", "", ["worker"], registry=registry)
    clock = FakeClock()
    reader = Reader(registry, clock)
    batches.labels(worker="w1", outcome="ok").inc(2)
    items.labels(worker="w1").inc(16)
    batches.labels(worker="w1", outcome="dead_lettered").inc(2)
    batches.labels(worker="w2", outcome="dead_lettered").inc(1)
    clock.advance(1.0)
    window = reader.advance()
    assert worker_figures(window, "w1") == {"batches_per_s": 2.0, "busy_fraction": 0.0, "mean_batch_size": 8.0}
    assert worker_figures(window, "w2") == {"batches_per_s": 0.0, "busy_fraction": 0.0}


def test_a_worker_s_call_counts_busy_as_it_runs_and_once_over_its_end(registry: CollectorRegistry) -> None:
    """A call longer than a beat: each beat it spans counts its own share, and the beat of its end adds only
    what is left, as the busy seconds take the whole call then."""
    busy = Counter("batchwire_worker_busy_seconds", "", ["worker"], registry=registry)
    running = Gauge("batchwire_worker_call_running_seconds", "", ["worker"], registry=registry)
    clock = FakeClock()
    reader = Reader(registry, clock)
    shares = []
    for ran_s in (0.6, 1.6):  # a call started 0.4 s into the first beat, still running at the second's end
        running.labels(worker="w1").set(ran_s)
        clock.advance(1.0)
        shares.append(worker_figures(reader.advance(), "w1")["busy_fraction"])
    running.labels(worker="w1").set(0.0)  # it ended 0.5 s into the third beat: 2.1 s in all
    busy.labels(worker="w1").inc(2.1)
    clock.advance(1.0)
    shares.append(worker_figures(reader.advance(), "w1")["busy_fraction"])
    assert shares == [pytest.approx(0.6), pytest.approx(1.0), pytest.approx(0.5)]


def test_an_answer_slower_than_the_default_longest_deadline_reads_as_its_own_latency() -> None:
    """``--max-timeout-ms`` may be raised past its 30 s default (a model generating for minutes): the
    latency buckets go on past it, so such an answer is not read as 30 s in beats and dashboards."""
    clock = FakeClock()
    reader = Reader(REGISTRY, clock)
    try:
        for latency_s in (45.0, 250.0):
            REQUEST_LATENCY.labels(model="slow-figures").observe(latency_s)
            clock.advance(1.0)
            p99 = reader.advance().quantile("batchwire_request_latency_seconds", 0.99, model="slow-figures")
            assert p99 is not None and latency_s * 2 / 3 < p99 <= latency_s * 2, (latency_s, p99)
    finally:
        REQUEST_LATENCY.remove("slow-figures")
