"""The simulation's invariants, and its agreement with closed forms where they exist."""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections import defaultdict

import pytest

from batcher.policy import FlushPolicy
from batchwire.capacity import arrivals, extras
from batchwire.capacity.curve import Curve, CurvePoint
from batchwire.capacity.engine import SimConfig, Simulation
from batchwire.capacity.outcome import BatchRecord
from batchwire.capacity.simulate import capacity, policy_for, simulate_rate
from gpu_worker.pipeline import HAND_OVER_POLL_S

FLAT = Curve.flat(100.0, 100)
PURE_WC = FlushPolicy.work_conserving(max_batch=100, reserve_ms=0.0)


def run(config: SimConfig, rate: float, count: int, seed: int = 1) -> tuple[list[float], list[BatchRecord]]:
    times = arrivals.poisson(rate, count, seed)
    out = Simulation(config).run(times)
    return times, out.records


def busy_intervals(records: list[BatchRecord]) -> dict[int, list[tuple[float, float]]]:
    """Each worker's calls, merged where one starts as the other ends."""
    by_worker: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for r in sorted(records, key=lambda r: r.start_s):
        spans = by_worker[r.worker]
        if spans and r.start_s <= spans[-1][1] + 1e-9:
            spans[-1] = (spans[-1][0], max(spans[-1][1], r.end_s))
        else:
            spans.append((r.start_s, r.end_s))
    return by_worker


def covered(spans: list[tuple[float, float]], start: float, end: float) -> bool:
    at = bisect.bisect_right([s for s, _ in spans], start + 1e-9) - 1
    return at >= 0 and spans[at][0] <= start + 1e-9 and spans[at][1] >= end - 1e-9


@pytest.mark.parametrize(("rate", "batchers"), [(50.0, 1), (900.0, 1), (1800.0, 1), (900.0, 2), (1800.0, 3)])
def test_work_conserving_leaves_no_worker_idle_while_requests_wait(rate: float, batchers: int) -> None:
    config = SimConfig(FLAT, 3, PURE_WC, spacing_margin_ms=-1, batchers=batchers, record=True)
    times, records = run(config, rate, 6000)
    spans = busy_intervals(records)
    waits = 0
    for r in records:
        for item in r.items:
            if r.start_s > times[item] + 1e-9:
                waits += 1
                idle = [w for w in range(3) if not covered(spans.get(w, []), times[item], r.start_s)]
                assert not idle, f"request {item} waited {times[item]:.4f}..{r.start_s:.4f} while {idle} idle"
    assert waits > 0 or rate < 100, "the check must see requests that waited"


@pytest.mark.parametrize("policy", [PURE_WC, FlushPolicy.work_conserving(), FlushPolicy.classic(32, 50.0)])
def test_one_batch_per_worker_at_a_time_and_no_request_lost_in_fifo_order(policy: FlushPolicy) -> None:
    config = SimConfig(FLAT, 2, policy, record=True)
    _, records = run(config, 1200.0, 8000)
    by_worker: dict[int, list[BatchRecord]] = defaultdict(list)
    for r in records:
        by_worker[r.worker].append(r)
    for worker, calls in by_worker.items():
        calls.sort(key=lambda r: r.start_s)
        for before, after in itertools.pairwise(calls):
            assert after.start_s >= before.end_s - 1e-9, f"worker {worker} ran two batches at once"
    sent = [item for r in records for item in r.items]
    assert sent == list(range(8000)), "every request is sent once, in arrival order"
    assert max(len(r.items) for r in records) <= policy.max_batch


def test_classic_flushes_only_full_or_aged_batches() -> None:
    policy = FlushPolicy.classic(32, 50.0)
    config = SimConfig(FLAT, 2, policy, record=True)
    times, records = run(config, 200.0, 3000)
    for r in records:
        oldest = times[r.items[0]]
        assert len(r.items) == 32 or r.sent_s >= oldest + 0.05 - 1e-9, "a classic batch goes full or at max wait"


def test_low_load_p50_is_one_call() -> None:
    result = simulate_rate(SimConfig(FLAT, 2, FlushPolicy.work_conserving()), 2.0, 2000, seed=3)
    assert result.p50_ms == pytest.approx(100.0, rel=0.01)
    assert result.mean_batch == pytest.approx(1.0, abs=0.02)


def test_saturated_throughput_is_workers_times_max_batch_over_call_latency() -> None:
    result = simulate_rate(SimConfig(FLAT, 2, FlushPolicy.work_conserving()), 3000.0, 60_000, seed=4)
    assert result.throughput == pytest.approx(2 * 100 / 0.1, rel=0.03)
    assert result.unstable and result.p99_ms is None, "over capacity: unstable, no p99"
    assert result.busy > 0.98


def test_single_item_batches_on_one_worker_match_m_d_1() -> None:
    """max batch 1, one worker, Poisson arrivals, a fixed call: M/D/1, mean time D + rho D / (2 (1 - rho))."""
    call_ms, rate = 10.0, 50.0
    curve = Curve((CurvePoint(1, call_ms, call_ms),))
    config = SimConfig(curve, 1, FlushPolicy.work_conserving(max_batch=1, reserve_ms=0.0), spacing_margin_ms=-1)
    times = arrivals.poisson(rate, 50_000, seed=5)
    out = Simulation(config).run(times)
    rho = rate * call_ms / 1000
    expected_ms = call_ms + rho * call_ms / (2 * (1 - rho))
    assert statistics.fmean(out.latencies_s) * 1000 == pytest.approx(expected_ms, rel=0.03)


def test_the_same_seed_gives_the_same_run() -> None:
    config = SimConfig(FLAT, 2, FlushPolicy.work_conserving())
    first = simulate_rate(config, 1000.0, 5000, seed=9)
    again = simulate_rate(config, 1000.0, 5000, seed=9)
    assert (first.p50_ms, first.p99_ms, first.mean_batch) == (again.p50_ms, again.p99_ms, again.mean_batch)


def test_a_backlog_past_its_limit_stops_the_run_as_unstable() -> None:
    config = SimConfig(FLAT, 1, FlushPolicy.work_conserving(), max_backlog=500)
    result = simulate_rate(config, 5000.0, 50_000)
    assert result.unstable and result.requests < 50_000 and result.p50_ms is None


def test_a_policy_max_batch_above_the_backend_is_cut_by_the_worker_limit() -> None:
    """As in the service: the policy seals at 100, the worker's credit takes at most the backend's 32."""
    config = SimConfig(Curve.flat(100.0, 32), 2, FlushPolicy.work_conserving(max_batch=100), record=True)
    _, records = run(config, 700.0, 5000)
    assert max(len(r.items) for r in records) == 32
    assert [item for r in records for item in r.items] == list(range(5000))


def test_an_unset_max_batch_is_the_policy_default_capped_at_the_backend() -> None:
    assert policy_for("work-conserving", backend_max=32).max_batch == 32
    assert policy_for("work-conserving", backend_max=256).max_batch == 100
    assert policy_for("classic", backend_max=256).max_batch == 32
    assert policy_for("classic", 64, 20.0, backend_max=256).max_wait_ms == 20.0
    assert policy_for("work-conserving", reserve_ms=0.0).reserve_ms == 0.0


def test_several_batchers_share_the_workers_lose_nothing_and_keep_each_stream_in_order() -> None:
    config = SimConfig(FLAT, 3, FlushPolicy.work_conserving(), batchers=3, record=True)
    _, records = run(config, 1500.0, 9000)
    sent = [item for r in records for item in r.items]
    assert sorted(sent) == list(range(9000)), "every request is sent exactly once"
    for batcher in range(3):
        stream = [item for item in sent if item % 3 == batcher]
        assert stream == sorted(stream), f"batcher {batcher} sent its requests out of order"
    by_worker: dict[int, list[BatchRecord]] = defaultdict(list)
    for r in records:
        by_worker[r.worker].append(r)
    for calls in by_worker.values():
        calls.sort(key=lambda r: r.start_s)
        assert all(after.start_s >= before.end_s - 1e-9 for before, after in itertools.pairwise(calls))


def test_two_batchers_fill_batches_about_as_one_does() -> None:
    """The measured figure: 3 workers, L = 1 s, 80 % load, mean batch within a few % for 1 and 2 batchers."""
    curve = Curve.flat(1000.0, 100)
    one = simulate_rate(SimConfig(curve, 3, FlushPolicy.work_conserving()), 240.0, 20_000, seed=2)
    two = simulate_rate(SimConfig(curve, 3, FlushPolicy.work_conserving(), batchers=2), 240.0, 20_000, seed=2)
    assert two.mean_batch == pytest.approx(one.mean_batch, rel=0.05)


def test_a_slow_worker_runs_its_calls_at_its_own_latency_and_caps_capacity() -> None:
    config = SimConfig(FLAT, 2, PURE_WC, worker_scale=(5.0,), record=True)
    _, records = run(config, 600.0, 6000)
    durations = {w: {round(r.end_s - r.start_s, 6) for r in records if r.worker == w} for w in (0, 1)}
    assert durations == {0: {0.5}, 1: {0.1}}, f"expected 500 ms calls on worker 0 and 100 ms on 1, got {durations}"
    assert capacity(config) == pytest.approx(1200.0), "200/s from the slow worker and 1,000/s from the other"
    assert simulate_rate(config, 1300.0, 20_000).unstable, "a rate over the two workers' capacity is unstable"


def test_a_worker_scale_per_worker_at_most_and_positive() -> None:
    with pytest.raises(ValueError, match="worker_scale"):
        SimConfig(FLAT, 1, PURE_WC, worker_scale=(1.0, 2.0))
    with pytest.raises(ValueError, match="worker_scale"):
        SimConfig(FLAT, 2, PURE_WC, worker_scale=(0.0,))


def test_a_call_extra_lengthens_every_call_by_the_same_ms_whatever_its_size() -> None:
    curve = Curve((CurvePoint(1, 10.0, 10.0), CurvePoint(4, 40.0, 40.0)))
    _, records = run(SimConfig(curve, 1, PURE_WC, call_extra_ms=5.0, record=True), 150.0, 3000)
    by_size = {len(r.items): round((r.end_s - r.start_s) * 1000, 6) for r in records}
    expected = {size: round(curve.latency_ms(size) + 5.0, 6) for size in by_size}
    assert by_size == expected, f"expected each size's curve latency plus 5 ms, got {by_size}"
    assert len(by_size) > 1, f"the load should mix batch sizes, got {by_size}"
    with pytest.raises(ValueError, match="call extra"):
        SimConfig(FLAT, 1, PURE_WC, call_extra_ms=-1.0)


def test_a_spread_call_extra_is_drawn_per_call_with_its_mean() -> None:
    config = SimConfig(FLAT, 2, PURE_WC, call_extra_ms=4.0, call_extra_spread=True, seed=7, record=True)
    _, records = run(config, 10.0, 4000)
    extra_ms = [(r.end_s - r.start_s) * 1000 - 100.0 for r in records]
    assert min(extra_ms) >= 0.0, "the draw only adds to the curve's latency"
    assert 3.5 < statistics.mean(extra_ms) < 4.5, f"mean extra {statistics.mean(extra_ms):.2f} ms, not ~4"
    assert max(extra_ms) > 12.0, "an exponential's tail passes three times its mean"


def test_the_calls_take_the_measured_calls_extras_one_by_one_in_the_order_they_ran() -> None:
    # one request every 200 ms, each finding the worker idle: simulated calls start when the run's did
    measured = tuple((0.2 * k, float(k % 7) * 3.0) for k in range(20))
    config = SimConfig(FLAT, 1, PURE_WC, call_extra_ms=50.0, call_extras_ms=measured, record=True)
    out = Simulation(config).run([0.2 * k for k in range(20)], counted_from=0.0)
    taken = [round((r.end_s - r.start_s) * 1000 - 100.0, 6) for r in sorted(out.records, key=lambda r: r.start_s)]
    assert taken == [extra for _, extra in measured], "each measured call once, in its order, in place of the mean"
    # calls at 0.2 and 0.25 s both start nearest the one at 0.3 s: the second takes the next one
    config = SimConfig(FLAT, 3, PURE_WC, call_extras_ms=((0.0, 1.0), (0.3, 2.0), (0.31, 3.0)), record=True)
    out = Simulation(config).run([0.0, 0.2, 0.25], counted_from=0.0)
    taken = [round((r.end_s - r.start_s) * 1000 - 100.0, 6) for r in sorted(out.records, key=lambda r: r.start_s)]
    assert taken == [1.0, 2.0, 3.0], "a long call's gap must not let it be taken twice"


def test_a_call_takes_no_measured_call_from_further_away_than_the_slack(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extras, "SLACK_S", 0.1)
    # the run made a call every 10 ms, the simulation one every 200 ms: it skips those it did not make
    early = [(0.005 + 0.01 * k, float(k)) for k in range(100)]
    late = [(2.005 + 0.01 * k, 100.0 + k) for k in range(100)]  # none from 1 s to 2 s: a gap in the record
    config = SimConfig(FLAT, 1, PURE_WC, call_extras_ms=(*early, *late), record=True)
    out = Simulation(config).run([0.2 * k for k in range(8)] + [3.6], counted_from=0.0)
    taken = [round((r.end_s - r.start_s) * 1000 - 100.0, 6) for r in sorted(out.records, key=lambda r: r.start_s)]
    assert taken[:6] == [0.0, 10.0, 30.0, 50.0, 70.0, 90.0], "the first measured call within 100 ms before it"
    assert taken[6:8] == [99.0, 99.0], "in a gap of the record, the nearest"
    assert taken[8] in {extra for _, extra in (*early, *late)}, "past the record, any of its calls"


def test_the_warm_ups_calls_draw_from_the_whole_record_not_from_its_first_call() -> None:
    measured = ((0.0, 500.0), *((0.01 * k, 1.0) for k in range(1, 200)))  # the window opened on a slow call
    config = SimConfig(FLAT, 2, PURE_WC, call_extras_ms=measured, seed=5, record=True)
    warmup = [-10.0 + 0.05 * k for k in range(190)]  # 9.5 s before the window
    out = Simulation(config).run(warmup, counted_from=0.0)
    slow = [r for r in out.records if (r.end_s - r.start_s) * 1000 > 400.0]
    assert len(slow) <= 3, f"{len(slow)} of {len(out.records)} warm-up calls took the window's first call's 500 ms"


def test_the_per_answer_step_delays_each_answer_by_its_place_in_the_batch() -> None:
    times = [0.0, 0.01, 0.01, 0.01]  # one batch of the first, then one of the three that waited for it
    plain = Simulation(SimConfig(FLAT, 1, PURE_WC, overhead_ms=2.0)).run(times).latencies_s
    stepped = Simulation(SimConfig(FLAT, 1, PURE_WC, overhead_ms=2.0, per_item_ms=1.0)).run(times).latencies_s
    extra_ms = [round((s - p) * 1000, 6) for s, p in zip(stepped, plain, strict=True)]
    assert extra_ms == [1.0, 1.0, 2.0, 3.0], f"expected 1 ms more for the lone answer, then 1, 2, 3, got {extra_ms}"


def test_contention_delays_whole_batches_by_an_exponential_draw_with_its_mean() -> None:
    times = arrivals.poisson(300.0, 6_000, 3)
    plain = Simulation(SimConfig(FLAT, 2, PURE_WC, overhead_ms=2.0)).run(times).latencies_s
    config = SimConfig(FLAT, 2, PURE_WC, overhead_ms=2.0, contention_ms=20.0, seed=5)
    spread = Simulation(config).run(times).latencies_s
    extra_ms = [(s - p) * 1000 for s, p in zip(spread, plain, strict=True)]
    assert min(extra_ms) >= 0.0, "the draw only adds; the batches themselves run as before"
    assert 17.0 < statistics.mean(extra_ms) < 23.0, f"mean extra {statistics.mean(extra_ms):.1f} ms, not ~20"
    assert max(extra_ms) > 60.0, "an exponential's tail passes three times its mean"
    again = Simulation(config).run(times).latencies_s
    assert again == spread, "the same seed draws the same delays"
    with pytest.raises(ValueError, match="contention"):
        SimConfig(FLAT, 1, PURE_WC, contention_ms=-1.0)


def test_a_late_send_counts_its_lag_from_when_it_was_due() -> None:
    due = [0.0, 0.5, 1.0]
    sent = [0.0, 0.58, 1.0]  # the second went 80 ms late
    out = Simulation(SimConfig(FLAT, 1, PURE_WC)).run(sent, due)
    assert [round(x * 1000, 6) for x in out.latencies_s] == [100.0, 180.0, 100.0]
    with pytest.raises(ValueError, match="one time per arrival"):
        Simulation(SimConfig(FLAT, 1, PURE_WC)).run(sent, due[:2])


def test_the_next_credit_waits_for_the_worker_to_see_its_call_start() -> None:
    """A lead longer than the call would offer the next credit as the call starts; the worker offers
    it once it has seen the call start, which it looks for every ``HAND_OVER_POLL_S``, so requests
    that come in between go in one batch, as in the service."""
    fast = Curve.flat(5.0, 8)
    half_poll = HAND_OVER_POLL_S / 2
    times = [0.0, 0.010, 0.010 + half_poll / 2, 0.010 + half_poll]  # two come while the call is handed over
    config = SimConfig(fast, 1, FlushPolicy.work_conserving(max_batch=8, reserve_ms=0.0), record=True)
    assert config.credit_lead_ms > 5.0, "a lead longer than the call"
    records = Simulation(config).run(times).records
    assert [r.items for r in records] == [(0,), (1,), (2, 3)], f"got {[r.items for r in records]}"
    assert records[2].sent_s == pytest.approx(0.010 + HAND_OVER_POLL_S), "sealed when the credit came"
