"""Prometheus parsing and the per-window difference of two scrapes."""

from __future__ import annotations

import pytest

from batchwire.bench.prom import Scrape, backend_ms_per_call, default_metrics_url, parse_samples, server_stats

BEFORE = """
# TYPE batchwire_batch_size histogram
batchwire_batch_size_bucket{model="m",le="1.0"} 2.0
batchwire_batch_size_bucket{model="m",le="4.0"} 2.0
batchwire_batch_size_bucket{model="m",le="+Inf"} 2.0
batchwire_batch_size_count{model="m"} 2.0
batchwire_batch_size_sum{model="m"} 2.0
# TYPE batchwire_flushes counter
batchwire_flushes_total{model="m",reason="max_wait"} 2.0
batchwire_flushes_created{model="m",reason="max_wait"} 1.7e9
# TYPE batchwire_worker_busy_seconds counter
batchwire_worker_busy_seconds_total{worker="w0"} 1.0
# TYPE batchwire_backend_cpu_seconds counter
batchwire_backend_cpu_seconds_total{worker="w0"} 0.25
# TYPE batchwire_queue_wait_seconds histogram
batchwire_queue_wait_seconds_count{model="m"} 10.0
batchwire_queue_wait_seconds_sum{model="m"} 0.5
"""

AFTER = """
# TYPE batchwire_batch_size histogram
batchwire_batch_size_bucket{model="m",le="1.0"} 3.0
batchwire_batch_size_bucket{model="m",le="4.0"} 6.0
batchwire_batch_size_bucket{model="m",le="+Inf"} 7.0
batchwire_batch_size_count{model="m"} 7.0
batchwire_batch_size_sum{model="m"} 22.0
# TYPE batchwire_flushes counter
batchwire_flushes_total{model="m",reason="max_wait"} 3.0
batchwire_flushes_total{model="m",reason="full"} 4.0
# TYPE batchwire_worker_busy_seconds counter
batchwire_worker_busy_seconds_total{worker="w0"} 2.5
batchwire_worker_busy_seconds_total{worker="w1"} 0.5
# TYPE batchwire_backend_cpu_seconds counter
batchwire_backend_cpu_seconds_total{worker="w0"} 1.0
batchwire_backend_cpu_seconds_total{worker="w1"} 0.125
# TYPE batchwire_queue_wait_seconds histogram
batchwire_queue_wait_seconds_count{model="m"} 14.0
batchwire_queue_wait_seconds_sum{model="m"} 0.53
# TYPE batchwire_backend_items counter
batchwire_backend_items_total{model="m"} 20.0
# TYPE batchwire_request_stage_seconds counter
batchwire_request_stage_seconds_total{model="m",stage="call"} 2.0
batchwire_request_stage_seconds_total{model="m",stage="sealed_to_started"} 0.4
# TYPE batchwire_request_stage_inputs counter
batchwire_request_stage_inputs_total{model="m"} 25.0
# TYPE batchwire_batches_redelivered counter
batchwire_batches_redelivered_total{worker="w1"} 2.0
"""


def test_default_metrics_url_keeps_the_origin() -> None:
    assert default_metrics_url("http://h:8000/v1/inference?x=1") == "http://h:8000/metrics"


def test_parse_drops_created_samples() -> None:
    samples = parse_samples(BEFORE)
    assert not any(name.endswith("_created") for name, _ in samples)
    assert samples[("batchwire_flushes_total", frozenset({("model", "m"), ("reason", "max_wait")}))] == 2.0


def test_server_stats_is_the_difference_over_the_window() -> None:
    url = "http://x/metrics"
    before = Scrape(at=10.0, by_endpoint={url: parse_samples(BEFORE)})
    after = Scrape(at=12.0, by_endpoint={url: parse_samples(AFTER)})
    stats = server_stats(before, after, [url])
    assert stats["batches"] == 5
    assert stats["batch_size_mean"] == pytest.approx(20 / 5)
    assert [(b["le"], b["count"]) for b in stats["batch_size_buckets"]] == [("1.0", 1), ("4.0", 3), ("+Inf", 1)]
    assert stats["flushes"] == {"max_wait": 1.0, "full": 4.0}
    assert stats["workers"] == 2
    # 1.5 + 0.5 busy seconds over 2 s and 2 workers
    assert stats["busy_fraction"] == pytest.approx(0.5)
    assert backend_ms_per_call(stats) == pytest.approx(2000.0 / 5), "2 busy seconds over 5 calls"
    assert stats["backend_cpu_s"] == pytest.approx(0.75 + 0.125), "the backends' threads' CPU, summed over workers"
    assert stats["redelivered"] == 2, "a worker's counter that appeared in the window counts from 0"
    # the window's 4 requests waited 30 ms in all to be sealed; its 25 inputs 2 s in calls, 0.4 s
    # before (the backends ran 20: duplicates once)
    assert stats["stages_ms"] == {
        "queue_wait_ms_mean": pytest.approx(7.5),
        "call_ms_mean": pytest.approx(80.0),
        "sealed_to_started_ms_mean": pytest.approx(16.0),
    }


def test_workers_hint_wins_and_missing_metrics_give_none() -> None:
    url = "http://x/metrics"
    empty = Scrape(at=0.0, by_endpoint={url: {}})
    later = Scrape(at=1.0, by_endpoint={url: {}}, errors={"http://y/metrics": "HTTP 404"})
    stats = server_stats(empty, later, [url], workers_hint=3)
    assert stats["batch_size_mean"] is None
    assert stats["busy_fraction"] == 0.0
    assert backend_ms_per_call(stats) is None, "no call in the window"
    assert stats["backend_cpu_s"] is None, "a service that does not export it"
    assert stats["scrape_errors"] == {"http://y/metrics": "HTTP 404"}
    assert stats["stages_ms"] == {}, "no stage counted anything"
    assert stats["redelivered"] == 0


def test_an_older_service_divides_its_stages_by_the_inputs_the_backends_ran() -> None:
    """A service without ``batchwire_request_stage_inputs`` (its results.json read back, or a scrape)."""
    url = "http://x/metrics"
    older = "\n".join(line for line in AFTER.splitlines() if "request_stage_inputs" not in line)
    before = Scrape(at=10.0, by_endpoint={url: parse_samples(BEFORE)})
    after = Scrape(at=12.0, by_endpoint={url: parse_samples(older)})
    stages = server_stats(before, after, [url])["stages_ms"]
    assert stages["call_ms_mean"] == pytest.approx(100.0), "2 s over the 20 inputs the backends ran"
