"""validate-sim: reading bench run directories, the overhead fed in, and the table's flags."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from batcher.policy import FlushPolicy
from batchwire import cli
from batchwire.bench import calls, sends
from batchwire.capacity import measured, validate
from batchwire.capacity.curve import Curve, CurvePoint
from batchwire.capacity.engine import SimConfig
from batchwire.capacity.measured import MeasuredRate, MeasuredRun, Replay, RunError
from batchwire.capacity.simulate import RateResult, capacity
from batchwire.capacity.validate import Row

DATA = Path(__file__).parent / "data" / "bench"


def read(name: str) -> list[MeasuredRun]:
    return measured.read_runs(DATA / name / "results.json", name)


def test_a_directory_of_run_directories_is_read_run_by_run_named_from_the_given_one() -> None:
    found = measured.results_files([DATA / "slow-worker", DATA / "durability-rf1"])
    names = [name for _, name in found]
    assert names == ["slow-worker", "durability-rf1/run1"], f"expected the nested run named by both, got {names}"


def test_a_directory_without_results_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(measured.RunError, match=str(tmp_path)):
        measured.results_files([tmp_path])


def test_the_slow_worker_run_reads_its_deployment_and_measured_figures() -> None:
    (run,) = read("slow-worker")
    assert (run.mode, run.policy, run.workers, run.batchers) == ("kafka", "work-conserving", 2, 1)
    assert (run.sim_latency_ms, run.slow_worker_latency_ms, run.max_batch) == (100.0, 500.0, None)
    assert run.lone_p50_ms is None, "this run recorded no lone-request probe"
    (rate,) = run.rates
    assert rate.offered == 1200.0
    assert rate.sent_rate == pytest.approx(24138 / 20.0), "the rate actually sent: sent over the window"
    assert (rate.throughput, rate.p50_ms, rate.p99_ms, rate.mean_batch) == (1195.0, 565.247, 1196.031, 100.0)
    # batchwire (its roles already summed in it) + kafka + redis + the generator, over 2 cores
    assert rate.cpu_busy == pytest.approx((0.73 + 0.238 + 0.038 + 0.1693) / 2, abs=1e-4)


def test_the_lone_probe_gives_the_overhead_over_the_backend() -> None:
    (run,) = read("durability-rf1/run1")
    assert run.lone_overhead_ms() == pytest.approx(106.962 - 100.0)
    assert [r.offered for r in run.rates] == [1000.0, 1600.0]


def test_a_run_of_several_policies_gives_one_deployment_each() -> None:
    runs = read("policies")
    assert [(r.name, r.policy) for r in runs] == [
        ("policies work-conserving", "work-conserving"),
        ("policies classic", "classic"),
    ]
    assert all(r.mode == "embedded" and r.light() for r in runs), "its lowest rate (20/s) is light"


def test_the_overhead_comes_from_the_flag_then_the_run_then_its_mode_then_the_fastest_answer() -> None:
    (slow,) = read("slow-worker")
    (probed,) = read("durability-rf1/run1")
    policies = read("policies")
    assert validate.overhead_for(slow, {"kafka": 4.0}, [slow, probed]) == (4.0, "flag")
    assert validate.overhead_for(probed, {}, [slow, probed]) == (round(106.962 - 100.0, 2), "lone")
    assert validate.overhead_for(slow, {}, [slow, probed]) == (round(106.962 - 100.0, 2), "lone, kafka runs")
    fastest = min(r.offered for r in policies[0].rates)
    assert fastest == 20.0
    overhead, source = validate.overhead_for(policies[0], {}, policies)
    assert source == "fastest, embedded runs" and 0 < overhead < 5


def test_a_classic_runs_lone_probe_less_its_max_wait_gives_the_overhead() -> None:
    """Classic holds a lone request for its max wait, which the simulation adds itself: counting it
    in the overhead too would count it twice."""
    conserving, classic = (dataclasses.replace(run, lone_p50_ms=153.0) for run in read("policies"))
    assert classic.max_wait_ms is None, "the run used classic's default max wait"
    assert validate.lone_wait_ms(classic) == 50.0 and validate.lone_wait_ms(conserving) == 0.0
    assert validate.overhead_for(classic, {}, [classic]) == (3.0, "lone")
    assert validate.overhead_for(conserving, {}, [conserving]) == (53.0, "lone")
    waited = dataclasses.replace(classic, max_wait_ms=20.0)
    assert validate.overhead_for(waited, {}, [waited]) == (33.0, "lone"), "the run's own max wait"


def test_requests_closer_together_than_the_idle_path_take_the_warm_probes_cost() -> None:
    """Under load each request finds the processes on its path awake from the last one: the warm
    probe's cost applies once requests come closer together than the idle path takes."""
    (probed,) = read("durability-rf1/run1")
    run = dataclasses.replace(probed, lone_p50_ms=105.0, warm_p50_ms=102.0)
    assert run.lone_overhead_ms(warm=True) == pytest.approx(2.0)
    busy = MeasuredRate(1000.0, 1000.0, 1000.0, 150.0, 200.0, 101.0, 50.0, None)  # 1 ms apart: within the 5 ms path
    light = dataclasses.replace(busy, offered=100.0, sent_rate=100.0)  # 10 ms apart: the path goes idle
    assert validate.awake_overhead(run, busy, 5.0, "lone") == (2.0, "warm")
    assert validate.awake_overhead(run, light, 5.0, "lone") == (5.0, "lone")
    assert validate.awake_overhead(run, busy, 5.0, "flag") == (5.0, "flag"), "a given overhead stands"
    unprobed = dataclasses.replace(run, warm_p50_ms=None)
    assert validate.awake_overhead(unprobed, busy, 5.0, "lone") == (5.0, "lone"), "no warm probe, no change"
    (row,) = validate.compare([dataclasses.replace(run, rates=(busy,))], {}, requests=300, seeds=1, cpu_scaling=False)
    assert (row.overhead_ms, row.overhead_from) == (2.0, "warm") and "2 (warm)" in validate.format_table([row])


def test_the_overhead_stretches_with_the_measured_cpu_busy_share_up_to_its_cap() -> None:
    rate = MeasuredRate(1000.0, 1000.0, 1000.0, 150.0, 200.0, 101.0, 50.0, cpu_busy=0.5)
    assert validate.loaded_overhead_ms(7.0, rate) == 14.0
    assert validate.loaded_overhead_ms(7.0, dataclasses.replace(rate, cpu_busy=0.99)) == 70.0, "capped at 0.9"
    assert validate.loaded_overhead_ms(7.0, dataclasses.replace(rate, cpu_busy=None)) == 7.0


def test_the_hops_share_only_the_cores_that_the_backends_own_thread_leaves() -> None:
    """Half the machine busy, half of that a CPU model's thread: the rest, a third of what it leaves."""
    rate = MeasuredRate(300.0, 300.0, 300.0, 12.0, 25.0, 5.0, 2.0, cpu_busy=0.5, backend_share=0.25)
    assert validate.loaded_overhead_ms(6.0, rate) == 9.0, "6 ms / (1 - 1/3)"
    assert validate.loaded_overhead_ms(6.0, dataclasses.replace(rate, backend_share=0.0)) == 12.0, "a GPU's or sim's"
    assert validate.loaded_overhead_ms(6.0, dataclasses.replace(rate, backend_share=0.7)) == 6.0, "never above busy"


def test_the_stretch_is_drawn_per_batch_unless_the_spread_is_off() -> None:
    (run,) = read("durability-rf1/run1")
    spread = validate.compare([run], {}, requests=2_000, seeds=1)
    fixed = validate.compare([run], {}, requests=2_000, seeds=1, spread=False)
    for drawn, flat in zip(spread, fixed, strict=True):
        assert drawn.contention_ms > 0 and flat.contention_ms == 0.0
        assert drawn.overhead_ms + drawn.contention_ms == pytest.approx(flat.overhead_ms, abs=0.02), "the same mean"
        assert "+ exp" in validate.format_table([drawn]) and "+ exp" not in validate.format_table([flat])


def test_a_run_that_recorded_its_sends_is_replayed_with_its_stalls() -> None:
    (run,) = read("durability-rf1/run1")
    rate = run.rates[0]
    smooth = [(i / 1000.0, 0.0) for i in range(4_000)]  # 1,000 req/s, every send on time
    stalled = [(due, 1.2 - due if 1.0 <= due < 1.2 else 0.0) for due, _ in smooth]  # a 200 ms stall
    rows = {}
    for name, pairs in (("smooth", smooth), ("stalled", stalled)):
        replayed = dataclasses.replace(rate, sends=sends.encode(pairs))
        replay = replayed.replay()
        assert replay is not None and replay.window_start_s == 0.0, "no warm-up kept: the window starts at 0"
        arrivals, due = replay.arrivals, replay.due
        assert len(arrivals) == 4_000 and arrivals == sorted(arrivals) and max(due) == pytest.approx(3.999)
        (rows[name],) = validate.compare(
            [dataclasses.replace(run, rates=(replayed,))], {"kafka": 5.0}, seeds=1, cpu_scaling=False
        )
    assert rows["smooth"].replayed and "sends replayed" in validate.format_table([rows["smooth"]])
    smooth_max, stalled_max = (rows[k].simulated.p999_ms or 0.0 for k in ("smooth", "stalled"))
    assert stalled_max > smooth_max + 80, f"the stall's lag shows in the tail: {smooth_max} -> {stalled_max} ms"
    (poisson,) = validate.compare([dataclasses.replace(run, rates=(replayed,))], {"kafka": 5.0}, seeds=1, replay=False)
    assert not poisson.replayed
    with pytest.raises(RunError, match="send record"):
        dataclasses.replace(rate, sends="aGVsbG8=").replay()


def test_the_warm_up_is_replayed_first_and_its_queue_meets_the_window_uncounted() -> None:
    (run,) = read("durability-rf1/run1")
    window = [(i / 1000.0, 0.0) for i in range(3_000)]  # 1,000 req/s for 3 s, half the workers' 2,000/s
    burst = [(-0.5 + i / 30_000.0, 0.0) for i in range(3_000)]  # 3,000 sent in the warm-up's last 0.1 s
    quiet = dataclasses.replace(run.rates[0], sends=sends.encode(window), warmup_sends=None)
    queued = dataclasses.replace(quiet, warmup_sends=sends.encode(burst))
    replay = queued.replay()
    assert replay is not None and replay.window_start_s == pytest.approx(0.5) and replay.arrivals[0] == 0.0
    assert len(replay.arrivals) == 6_000 and min(d for d in replay.due if d >= 0.5) == pytest.approx(0.5)
    rows = {
        name: validate.compare([dataclasses.replace(run, rates=(rate,))], {"kafka": 5.0}, seeds=1, cpu_scaling=False)[0]
        for name, rate in (("quiet", quiet), ("queued", queued))
    }
    quiet_p50, queued_p50 = (rows[k].simulated.p50_ms or 0.0 for k in ("quiet", "queued"))
    assert quiet_p50 < 200 and queued_p50 > 300, f"the window meets the burst's queue: {quiet_p50} -> {queued_p50} ms"
    throughput = rows["queued"].simulated.throughput
    assert 1_100 < throughput <= 2_020, (
        f"over the window's 1,000/s, working off the queue, at most at capacity: {throughput}"
    )


def test_the_slow_worker_is_simulated_as_worker_0_at_its_own_latency() -> None:
    (run,) = read("slow-worker")
    config = validate.sim_config(run, 5.0)
    assert config.worker_scale == (5.0,) and config.overhead_ms == 5.0
    assert capacity(config) == pytest.approx(1200.0)


def row(measured: tuple[float, float, float], simulated: tuple[float, float | None, float | None]) -> Row:
    (run,) = read("durability-rf1/run1")
    thru, p50, p99 = measured
    m = MeasuredRate(1000.0, 1000.0, thru, p50, p99, 101.0, 50.0, None)
    s_thru, s_p50, s_p99 = simulated
    unstable = s_p50 is None
    s = RateResult(1000.0, 1000, s_thru, s_p50, s_p99, s_p99, 50.0, 1.0, 0, 0.0, unstable, 0, 0.1)
    return Row(run, m, s, 7.0, "lone")


def test_flags_name_each_figure_over_its_bound() -> None:
    assert row((1000, 150, 200), (1020, 160, 210)).flags() == [], "2%, 6.7% and 5% are within the bounds"
    assert row((1000, 150, 200), (1040, 150, 200)).flags() == ["throughput"], "4% over the 3% bound"
    assert row((1000, 150, 200), (1000, 170, 200)).flags() == ["p50"], "13% over the 10% bound"
    assert row((1000, 150, 200), (1000, 150, 170)).flags() == ["p99"], "-15% is over the bound too"


def test_a_window_that_opened_on_the_warm_ups_backlog_is_flagged_unsettled_not_judged(tmp_path: Path) -> None:
    data = json.loads((DATA / "durability-rf1/run1/results.json").read_text())
    draining = [620.0, 590.0, 540.0, 480.0, 400.0, 320.0, 250.0, 210.0] + [200.0] * 12
    data["runs"][0]["rates"][0]["latency_by_second_ms"] = draining
    data["runs"][0]["rates"][1]["latency_by_second_ms"] = [200.0] * 20
    (tmp_path / "results.json").write_text(json.dumps(data))
    (run,) = measured.read_runs(tmp_path / "results.json", "opened-on-a-backlog")
    assert [rate.unsettled for rate in run.rates] == [True, False]
    assert not read("durability-rf1/run1")[0].rates[0].unsettled, "a run recorded before the series: settled"
    far_off = row((1000, 150, 200), (1000, 150, 100))
    unsettled = dataclasses.replace(far_off, measured=dataclasses.replace(far_off.measured, unsettled=True))
    assert far_off.flags() == ["p99"] and unsettled.flags() == ["unsettled"]


def test_latencies_are_not_held_to_their_bound_at_saturation() -> None:
    saturated = row((900, 150, 200), (900, 300, 600))  # 900 of the 1,000/s sent came back
    assert saturated.saturated and saturated.flags() == []
    unstable = row((1000, 150, 200), (1000, None, None))
    assert unstable.saturated and unstable.flags() == []
    table = validate.format_table([saturated, unstable, row((1000, 150, 200), (1040, 150, 200))])
    lines = table.splitlines()
    assert lines[0].startswith("| run |") and len(lines) == 5, f"a header, a rule and three rows; got {table}"
    assert lines[2].endswith("| saturated |") and "unstable" in lines[3]
    assert lines[4].endswith("| throughput |") and "+4.0%" in lines[4]


def test_the_command_prints_and_writes_the_table(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "validate.md"
    argv = ["validate-sim", str(DATA / "durability-rf1"), "--requests", "2000", "--seeds", "1", "--out", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| durability-rf1/run1 | kafka | 1000 |" in printed and "| durability-rf1/run1 | kafka | 1600 |" in printed
    assert out.read_text() == printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--overhead-ms", "kafka"], "--overhead-ms takes MODE=MS"),
        (["--per-item-ms", "kafka=x"], "--per-item-ms takes MODE=MS"),
        (["--seeds", "0"], "--seeds and --requests must be at least 1"),
        # a negative overhead was refused in a dump of the whole simulated configuration, a NaN simulated NaN
        # latencies, a negative per-answer step answered before the call ended
        (["--overhead-ms", "kafka=-5"], "--overhead-ms takes 0 or more ms (a finite duration) per mode"),
        (["--overhead-ms", "kafka=nan"], "--overhead-ms takes 0 or more ms (a finite duration) per mode"),
        (["--per-item-ms", "kafka=-50"], "--per-item-ms takes 0 or more ms (a finite duration) per mode"),
        # a mode no run has was taken and never applied: the overhead came from the probe, without a word
        (["--overhead-ms", "kafak=5"], "--overhead-ms names 'kafak', no run's mode: the runs' are ['kafka']"),
        (["--per-item-ms", "embedded=0.1"], "--per-item-ms names 'embedded', no run's mode: the runs' are ['kafka']"),
    ],
)
def test_bad_input_is_refused_with_what_to_change(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert cli.main(["validate-sim", str(DATA / "slow-worker"), "--requests", "500", "--seeds", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "SimConfig" not in err, err


def test_an_out_with_nowhere_to_go_is_refused_before_the_simulations(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(validate, "compare", lambda *args, **kwargs: pytest.fail("simulated for nothing"))
    out = tmp_path / "no-such-folder" / "validate.md"
    assert cli.main(["validate-sim", str(DATA / "durability-rf1"), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert f"batchwire validate-sim: --out {out}: {out.parent} is not a folder" in captured.err, captured.err
    assert captured.out == "", f"nothing should be printed before the refusal:\n{captured.out}"
    assert cli.main(["validate-sim", str(DATA / "durability-rf1"), "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a folder; name a file" in capsys.readouterr().err


def test_a_missing_directory_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["validate-sim", str(tmp_path / "nope")]) == 2
    assert "holds no results.json" in capsys.readouterr().err


def test_a_loaded_run_alone_gets_no_overhead_estimate_and_says_so() -> None:
    (probed,) = read("durability-rf1/run1")
    unprobed = dataclasses.replace(probed, lone_p50_ms=None)
    assert not unprobed.light(), "its lowest rate (1,000/s) is half the workers' capacity"
    assert validate.overhead_for(unprobed, {}, [unprobed]) == (0.0, "none: give --overhead-ms")


def hf_curve() -> Curve:
    """A real model's shape: a call grows with its batch (20 ms for one, 80 ms for 8)."""
    return Curve((CurvePoint(1, 20.0, 22.0), CurvePoint(4, 40.0, 44.0), CurvePoint(8, 80.0, 88.0)), "hf")


def test_a_run_with_its_curve_takes_the_backend_latency_from_the_curve_not_the_flat_sim_latency() -> None:
    (probed,) = read("durability-rf1/run1")
    run = dataclasses.replace(probed, max_batch=8, lone_p50_ms=27.0).with_curve(hf_curve())
    assert run.lone_call_ms() == 20.0 and run.lone_overhead_ms() == 7.0, "the lone probe less a call of one"
    config = validate.sim_config(run, 7.0)
    assert config.curve == hf_curve() and config.policy.max_batch == 8
    assert capacity(config) == pytest.approx(2 * 100.0), "2 workers, 4 or 8 items per 40 or 80 ms: 100/s each"
    assert not run.light(), "1,000/s is far above 5% of 200/s"


def test_the_path_cost_is_the_probe_less_its_own_calls_where_the_probe_timed_them() -> None:
    """A model whose calls run longer from idle than profiled (a cold thread pool) would otherwise put
    that time in the path, which every simulated request then pays beside the calls' own measured extra."""
    (probed,) = read("durability-rf1/run1")
    run = dataclasses.replace(probed, max_batch=8, lone_p50_ms=27.0, warm_p50_ms=25.0).with_curve(hf_curve())
    timed = dataclasses.replace(run, lone_probe_call_ms=24.0, warm_probe_call_ms=21.5)
    assert run.lone_overhead_ms() == 7.0 and run.lone_overhead_ms(warm=True) == 5.0, "untimed: a call of one"
    assert timed.lone_overhead_ms() == 3.0 and timed.lone_overhead_ms(warm=True) == 3.5, "the probes' own calls"


def test_a_curve_shorter_than_the_runs_batches_is_refused_with_the_profile_flag_to_use() -> None:
    (probed,) = read("durability-rf1/run1")
    with pytest.raises(measured.RunError, match="--max-batch 32"):
        dataclasses.replace(probed, max_batch=32).with_curve(hf_curve())


def test_the_command_simulates_with_the_curve_given(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    hf_curve().save(tmp_path / "curve.json")
    argv = ["validate-sim", str(DATA / "policies"), "--curve", str(tmp_path / "curve.json"), "--requests", "500"]
    assert cli.main([*argv, "--seeds", "1"]) == 0
    printed = capsys.readouterr().out
    assert "| policies classic | embedded | 20 |" in printed, f"expected the 20/s row, got {printed}"
    assert cli.main(["validate-sim", str(DATA / "policies"), "--curve", str(tmp_path / "none.json")]) == 2
    assert "cannot read the curve file" in capsys.readouterr().err


def test_calls_take_the_workers_measured_extra_time_per_call_beyond_the_curves() -> None:
    """A model on CPU shares the cores: its calls run longer under load than when profiled, and the
    simulation adds the workers' measured extra time per call to every call."""
    (probed,) = read("durability-rf1/run1")
    run = dataclasses.replace(probed, max_batch=8).with_curve(hf_curve())
    # 100 batches of 6 items: 60 ms each by the curve (interpolated between 4 and 8); 90 ms measured
    rate = MeasuredRate(100.0, 100.0, 100.0, 80.0, 150.0, 30.0, 6.0, None, batches=100.0, backend_s=9.0)
    assert rate.call_extra_ms(run.backend_curve()) == pytest.approx(30.0)
    assert run.call_extra_ms(rate) == 30.0
    faster = dataclasses.replace(rate, backend_s=5.0)
    assert run.call_extra_ms(faster) == 0.0, "calls faster than profiled add nothing"
    assert run.call_extra_ms(dataclasses.replace(rate, backend_s=None)) is None, "not scraped"
    (slow,) = read("slow-worker")
    assert slow.call_extra_ms(rate) is None, "the workers' shares of the batches are not recorded apart"
    (row,) = validate.compare([dataclasses.replace(run, rates=(rate,))], {"kafka": 5.0}, requests=300, seeds=1)
    assert row.call_extra_ms == 30.0 and "calls +30 ms" in validate.format_table([row])
    (plain,) = validate.compare(
        [dataclasses.replace(run, rates=(rate,))], {"kafka": 5.0}, requests=300, seeds=1, call_extra=False
    )
    assert plain.call_extra_ms is None and plain.simulated.p50_ms is not None
    assert "calls +" not in validate.format_table([plain])
    assert row.simulated.p50_ms is not None and row.simulated.p50_ms > plain.simulated.p50_ms, "longer calls"


def test_a_run_that_recorded_its_calls_gives_the_simulated_calls_their_extras() -> None:
    (probed,) = read("durability-rf1/run1")
    run = dataclasses.replace(probed, max_batch=8).with_curve(hf_curve())
    recorded = [calls.Call(0.01 * k, 6, 0.090 if k % 2 else 0.070) for k in range(500)]  # 60 ms by the curve
    rate = MeasuredRate(100.0, 100.0, 100.0, 80.0, 150.0, 30.0, 6.0, None, batches=500.0, backend_s=40.0)
    rate = dataclasses.replace(rate, calls=calls.encode(recorded))
    assert [round(extra, 6) for _, extra in rate.call_extras_ms(run.backend_curve())[:2]] == [10.0, 30.0]
    one = [dataclasses.replace(run, rates=(rate,))]
    (row,) = validate.compare(one, {"kafka": 5.0}, requests=300, seeds=1)
    assert row.calls_taken == 500 and "calls +20 ms as 500 measured" in validate.format_table([row])
    (exponential,) = validate.compare(one, {"kafka": 5.0}, requests=300, seeds=1, call_record=False)
    assert exponential.calls_taken == 0 and "measured" not in validate.format_table([exponential]).split("calls +")[1]
    broken = dataclasses.replace(rate, calls="not a record")
    with pytest.raises(RunError, match="call record"):
        broken.call_extras_ms(run.backend_curve())


def test_a_replayed_run_that_cannot_keep_up_is_simulated_to_the_end_of_its_window() -> None:
    # one item per 100 ms call, 100 sends a second for 20 s, the calls twice as long in the second half;
    # the queue passes the backlog that stops a simulation (500) at 6 s
    recorded = (*((0.1 * k, 0.0) for k in range(100)), *((10.0 + 0.2 * k, 100.0) for k in range(50)))
    policy = FlushPolicy.work_conserving(max_batch=1)
    config = SimConfig(Curve.flat(100.0, 1), 1, policy, call_extras_ms=recorded, max_backlog=500)
    sends = [k / 100.0 for k in range(2_000)]
    result = validate.simulate_replay(config, Replay(sends, sends, 0.0), 100.0)
    assert result.unstable and result.p99_ms is None, "the queue only grows: no latencies"
    assert result.throughput == pytest.approx(7.5, rel=0.05), "10 answers/s, then 5: over the whole window"


def test_a_bench_file_gives_the_workers_batches_and_backend_seconds() -> None:
    (run,) = read("slow-worker")
    (rate,) = run.rates
    assert rate.batches is not None and rate.batches > 0
    assert rate.backend_s is not None and rate.backend_s > 0, "busy share x window x workers"
    assert rate.backend_share is None, "a run from before the backends' CPU was scraped"


def test_the_backends_cpu_seconds_give_their_share_of_the_machine(tmp_path: Path) -> None:
    data = json.loads((DATA / "slow-worker" / "results.json").read_text())
    rate = data["runs"][0]["rates"][0]
    cpus = data["metadata"].get("cpu_affinity") or data["metadata"]["cpu_count"]
    rate["server"]["backend_cpu_s"] = rate["window_s"] * cpus / 4  # a quarter of the machine
    (tmp_path / "results.json").write_text(json.dumps(data))
    ((run,),) = [measured.read_runs(tmp_path / "results.json", "cpu")]
    assert run.rates[0].backend_share == pytest.approx(0.25)


def test_the_paths_cost_at_a_rate_is_its_mean_latency_less_the_stages_the_simulation_runs() -> None:
    """Where the bench recorded the service's stages, the path costs what the requests' mean latency
    holds beyond accept-to-sealed, sealed-to-started and the call: measured, so not stretched."""
    stages = {"queue_wait_ms_mean": 1.0, "sealed_to_started_ms_mean": 0.5, "call_ms_mean": 2.5, "request_ms_mean": 5.0}
    rate = MeasuredRate(300.0, 300.0, 300.0, 5.5, 12.0, 1.5, 1.3, 0.6, mean_ms=6.0, stages_ms=stages)
    assert rate.outside_ms() == pytest.approx(2.0)
    assert dataclasses.replace(rate, stages_ms=None).outside_ms() is None, "an older run"
    assert dataclasses.replace(rate, stages_ms={"call_ms_mean": 2.5}).outside_ms() is None, "a stage missing"
    assert dataclasses.replace(rate, mean_ms=3.0).outside_ms() == 0.0, "never below 0"
    assert validate.in_service_overhead(1.5, 2.0, spread=True) == (1.5, 0.5), "the probe's cost fixed, the rest drawn"
    assert validate.in_service_overhead(3.0, 2.0, spread=True) == (2.0, 0.0), "a probe above the measured mean"
    assert validate.in_service_overhead(1.5, 2.0, spread=False) == (2.0, 0.0)

    (probed,) = read("durability-rf1/run1")
    run = dataclasses.replace(probed, lone_p50_ms=101.5, rates=(rate,))  # a 1.5 ms path when idle
    (row,) = validate.compare([run], {}, requests=300, seeds=1)
    assert (row.overhead_ms, row.contention_ms) == (1.5, 0.5), "0.6 busy would have stretched it to 3.75 ms"
    assert "1.5 (lone; in-service 2.00) + exp 0.5" in validate.format_table([row]), "no probe stages: no inbound"
    (old,) = validate.compare([run], {}, requests=300, seeds=1, stages=False)
    assert old.contention_ms == pytest.approx(2.25), "without them, the probe stretched by the busy share"
    (given,) = validate.compare([run], {"kafka": 4.0}, requests=300, seeds=1)
    assert given.overhead_ms == 4.0 and "in-service" not in given.overhead_from, "a given overhead stands"


def test_the_probes_measure_the_hops_to_an_idle_worker_which_the_path_and_the_transit_take(tmp_path: Path) -> None:
    """The stages subtracted from the path's cost hold a request's way to the batcher and its batch's
    way to the worker; the probes' stages measure both with the worker idle: the first is added to
    the path's cost, the second is the simulation's transit."""
    data = json.loads((DATA / "durability-rf1" / "run1" / "results.json").read_text())
    run_doc = data["runs"][0]
    run_doc["lone"]["stages_ms"] = {"queue_wait_ms_mean": 0.5, "sealed_to_started_ms_mean": 1.25}
    run_doc["warm"] = {"latency_ms": {"p50": 101.0}, "stages_ms": {"sealed_to_started_ms_mean": 0.75}}
    (tmp_path / "results.json").write_text(json.dumps(data))
    (run,) = measured.read_runs(tmp_path / "results.json", "probed")
    assert run.probe_hops_ms() == (0.5, 1.25) and run.probe_hops_ms(warm=True) == (0.0, 0.75)
    assert run.probe_hops_ms(0.3) == (pytest.approx(0.2), 1.25), "classic's own wait for a lone request is not a hop"
    assert run.probe_hops_ms(2.0) == (0.0, 1.25)
    assert dataclasses.replace(run, lone_probe_stages_ms=None).probe_hops_ms() == (0.0, 0.0), "not recorded"

    stages = {"queue_wait_ms_mean": 0.7, "sealed_to_started_ms_mean": 1.2, "call_ms_mean": 100.0}
    light = MeasuredRate(20.0, 20.0, 20.0, 104.0, 110.0, 101.0, 1.0, 0.1, mean_ms=103.4, stages_ms=stages)
    (row,) = validate.compare([dataclasses.replace(run, rates=(light,))], {}, requests=400, seeds=1)
    assert row.transit_ms == 1.25 and "transit 1.25" in validate.format_table([row]), "the lone probe's at 20 req/s"
    assert row.overhead_ms == pytest.approx(1.5 + 0.5), "the path outside the stages, and the way to the batcher"
    assert "in-service 1.50 + inbound 0.50" in row.overhead_from
    (plain,) = validate.compare([dataclasses.replace(run, rates=(light,))], {}, requests=400, seeds=1, stages=False)
    assert plain.transit_ms == 0.0, "the probe's whole cost stands in for the path, both hops included"
    assert row.simulated.p50_ms is not None and plain.simulated.p50_ms is not None
    assert row.simulated.p50_ms < plain.simulated.p50_ms, "the path measured at the rate, not stretched"


# a rate held out --------------------------------------------------------------------------------------
def test_a_figure_is_read_off_the_least_squares_line_through_the_other_rates() -> None:
    assert validate._fit([(100.0, 0.1), (300.0, 0.3)], 200.0) == pytest.approx(0.2), "between two rates"
    assert validate._fit([(100.0, 0.1), (300.0, 0.3)], 500.0) == pytest.approx(0.5), "beyond them"
    assert validate._fit([(100.0, 1.0), (200.0, 3.0), (300.0, 2.0)], 200.0) == pytest.approx(2.0)
    assert validate._fit([(100.0, 0.1), (300.0, None)], 200.0) is None, "one figure is no line"


def three_rates() -> MeasuredRun:
    """The RF 1 run with a third rate: 500, 1,000 and 1,600 req/s, the machine 20 %, 40 % and 64 % busy."""
    (run,) = read("durability-rf1/run1")
    low = dataclasses.replace(run.rates[0], offered=500.0, sent_rate=498.0, throughput=498.0)
    busy = {500.0: 0.2, 1000.0: 0.4, 1600.0: 0.64}
    rates = tuple(dataclasses.replace(r, cpu_busy=busy[r.offered]) for r in (low, *run.rates))
    return dataclasses.replace(run, rates=rates)


def test_a_held_out_rate_takes_nothing_measured_at_it() -> None:
    run = three_rates()
    recorded = dataclasses.replace(
        run.rates[1],
        cpu_busy=0.99,
        sends=sends.encode([(i / 1000.0, 0.0) for i in range(1000)]),
        calls=calls.encode([calls.Call(0.0, 50, 0.2)]),
        stages_ms={"accept_to_sealed": 5.0},
        mean_ms=170.0,
    )
    run = dataclasses.replace(run, rates=(run.rates[0], recorded, run.rates[2]))
    target = run.rates[1]
    assert target.offered == 1000.0 and target.replay() is not None, "the run recorded this rate's sends"
    predicted = validate.predicted_inputs(run, target)
    inputs, extra = predicted.rate, predicted.call_extra_ms
    assert inputs.cpu_busy == pytest.approx(0.4, abs=1e-6), "the line through 20 % and 64 %, not the 99 % measured"
    assert inputs.sent_rate == 1000.0, "the rate offered, not what the generator managed"
    assert (inputs.sends, inputs.warmup_sends, inputs.calls, inputs.stages_ms) == (None, None, None, None)
    assert inputs.replay() is None and inputs.outside_ms() is None and inputs.mean_ms is None
    low, high = (run.call_extra_ms(r) for r in (run.rates[0], run.rates[2]))
    assert low is not None and high is not None, "the run measured the calls' extra time at the other rates"
    assert extra == pytest.approx(max(0.0, low + (high - low) * 500 / 1100), abs=0.01), "on the line at 1,000/s"
    with pytest.raises(RunError, match="at least two other rates"):
        validate.predicted_inputs(dataclasses.replace(run, rates=run.rates[:2]), target)


def test_the_command_predicts_the_rate_nearest_the_one_held_out_and_holds_it_to_wider_bounds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    (predicted,) = validate.compare([three_rates()], {}, requests=2_000, seeds=1, held_out=1100.0)
    assert predicted.held_out and predicted.measured.offered == 1000.0 and not predicted.replayed
    assert predicted.calls_taken == 0, "no call of the held-out rate's record is taken"
    assert "predicted from the other rates" in validate.format_table([predicted])
    within = dataclasses.replace(row((1000, 150, 200), (1040, 160, 240)), held_out=True)
    assert within.flags() == [], "4 %, 6.7 % and 20 % are within 5 %, 10 % and 25 %"
    over = dataclasses.replace(row((1000, 150, 200), (1060, 170, 260)), held_out=True)
    assert over.flags() == ["throughput", "p50", "p99"]
    assert cli.main(["validate-sim", str(DATA / "durability-rf1"), "--held-out", "1000"]) == 2
    assert "at least two other rates" in capsys.readouterr().err
