"""``batchwire validate-sim``: measured bench runs beside the simulation of the same deployment.

Each run directory (``batchwire.capacity.measured``) gives the deployment and, per rate, the
measured throughput and latencies. The simulation runs the same deployment at the rate the
generator actually sent, over a few seeds (their median), and the table flags a throughput more
than 3% off, and a p50 or p99 more than 10% off below saturation.

The simulation has no network: the per-hop overhead (gateway, bus, result store) is an input, per
mode. Unless given, it is the run's lone-request probe (lone p50 less the backend's own time per call
while the probe ran, where the bench recorded it, else the curve's latency for a batch of one), else
another given run's probe in the same mode, else the fastest answer of the light runs in that mode
less the backend latency (a lower bound: the path's cost varies from request to request), else 0.
That probe waits before each request, so every process on the path has gone idle and wakes slowly.
Under load a request comes before the last one's hops are done and finds them awake: at a rate whose
gap between requests is shorter than the idle path, the run's warm-path probe (lone requests sent
back to back) gives the cost instead.
Under load the hops share the machine's cores with everything else, so by default the overhead at
each rate is stretched by the CPU busy share measured then: processor sharing of the cores that the
backend's own thread leaves (``loaded_overhead_ms``). The stretch is a wait for the CPU, and such a
wait varies: by default the idle overhead stays fixed and the stretch is drawn per batch from an
exponential distribution with that mean (an M/M/1 queue's wait), so a loaded machine's tail shows too.
Where the bench recorded the service's stages (``ServerStats.stages_ms``), the path's cost at a rate
is measured instead (``--no-stages``: the above): mean latency less accept-to-sealed, sealed-to-start
and the call, plus the way to the batcher; the batch's way to the worker is the transit (both from
the probes' stages: ``MeasuredRun.probe_hops_ms``). The probe's cost stays fixed, the rest is drawn
per batch.
Calls take longer too: each simulated call takes a recorded call's time beyond the curve, one by one in
the run's order (``batchwire.bench.calls``, ``batchwire.capacity.extras``); runs without the record add
the mean, an exponential draw. It is a delay per call, not a factor: what slows a call is its Python
steps waiting for the GIL while the event loop runs, and the whole process when the machine stalls (a
factor overstated large batches and sent a loaded model's queue up). A slow worker is worker 0 at its
own latency. Runs of a real model (the hf backend) take its profiled curve (``--curve``).

Arrivals are the generator's own where the run recorded its sends (``batchwire.bench.sends``): each
request arrives when it was sent and its latency counts from when it was due, as the bench counts
it, so the generator's stalls and the bursts after them reach the simulation too. Older runs, and
``--no-replay``, get Poisson arrivals at the rate sent.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchwire.capacity import curve as curve_file
from batchwire.capacity.curve import CurveError
from batchwire.capacity.engine import SimConfig
from batchwire.capacity.measured import MeasuredRate, MeasuredRun, Replay, RunError, read_runs, results_files
from batchwire.capacity.profile import check_out
from batchwire.capacity.simulate import MAX_REQUESTS, RateResult, policy_for, simulate, simulate_rate
from batchwire.settings import number
from telemetry.logs import LEVEL_NAMES

THROUGHPUT_BOUND = 0.03
LATENCY_BOUND = 0.10
HELD_OUT_BOUNDS = (0.05, 0.10, 0.25)
"""A held-out rate's prediction: throughput, p50 and p99 within these shares of the measured ones."""
SATURATED_SHARE = 0.97
"""A rate is saturated when the measured throughput is below this share of what was sent."""
BUSY_CAP = 0.9
"""The CPU busy share at most used to stretch the overhead (a share near 1 would stretch it without bound)."""


@dataclass(frozen=True, slots=True)
class Row:
    run: MeasuredRun
    measured: MeasuredRate
    simulated: RateResult
    overhead_ms: float
    overhead_from: str
    per_item_ms: float = 0.0
    call_extra_ms: float | None = None
    contention_ms: float = 0.0
    """The mean of the exponential delay per batch on top of ``overhead_ms``."""
    replayed: bool = False
    """The simulation replayed the generator's recorded sends (else: Poisson arrivals)."""
    transit_ms: float = 0.0
    """A batch's way to an idle worker, fed to the simulation (``MeasuredRun.probe_hops_ms``)."""
    calls_taken: int = 0
    """The measured calls the simulated ones took their extras from, one by one (0: an exponential draw)."""
    held_out: bool = False
    """Predicted from the run's other rates alone (``--held-out``): nothing measured at this rate went in."""

    @property
    def saturated(self) -> bool:
        return self.measured.throughput < SATURATED_SHARE * self.measured.sent_rate or self.simulated.unstable

    def diffs(self) -> tuple[float, float | None, float | None]:
        """Simulated against measured, as shares: throughput, p50, p99 (None: no simulated latency)."""
        m, s = self.measured, self.simulated
        return (
            _diff(s.throughput, m.throughput),
            None if s.p50_ms is None else _diff(s.p50_ms, m.p50_ms),
            None if s.p99_ms is None else _diff(s.p99_ms, m.p99_ms),
        )

    def flags(self) -> list[str]:
        """The figures over their bounds: throughput always, latencies below saturation and in a settled
        window only (``unsettled``: the measured window opened on the warm-up's backlog)."""
        thru, p50, p99 = self.diffs()
        thru_bound, p50_bound, p99_bound = (
            HELD_OUT_BOUNDS if self.held_out else (THROUGHPUT_BOUND, LATENCY_BOUND, LATENCY_BOUND)
        )
        flags = ["throughput"] if abs(thru) > thru_bound else []
        if self.measured.unsettled:
            flags.append("unsettled")
        elif not self.saturated:
            bounded = (("p50", p50, p50_bound), ("p99", p99, p99_bound))
            flags += [name for name, d, bound in bounded if d is not None and abs(d) > bound]
        return flags


def _diff(simulated: float, measured: float) -> float:
    return (simulated - measured) / measured if measured else 0.0


# the simulation of a run ----------------------------------------------------------------------------
def sim_config(run: MeasuredRun, overhead_ms: float) -> SimConfig:
    """The run's deployment: its backend's curve (flat for the sim backend), the slow worker (if any)
    as worker 0."""
    curve = run.backend_curve()
    policy = policy_for(run.policy, run.max_batch, run.max_wait_ms, None, curve.max_batch)
    slow = run.slow_worker_latency_ms
    scale = (slow / run.sim_latency_ms,) if slow else ()
    return SimConfig(curve, run.workers, policy, batchers=run.batchers, overhead_ms=overhead_ms, worker_scale=scale)


def lone_wait_ms(run: MeasuredRun) -> float:
    """How long the run's policy holds a lone request before sealing it: nothing when it flushes on
    an idle worker, its max wait otherwise (classic)."""
    curve = run.backend_curve()
    policy = policy_for(run.policy, run.max_batch, run.max_wait_ms, None, curve.max_batch)
    return 0.0 if policy.flush_on_idle_worker else policy.max_wait_ms


def simulate_median(
    config: SimConfig, rate: float, requests: int, seeds: int, replay: Replay | None = None
) -> RateResult:
    """The simulation over ``seeds`` seeds, each figure their median (None when any seed is unstable):
    Poisson arrivals at ``rate``, or the run's own sends (``replay``), the window alone measured."""
    results = [
        simulate_replay(dataclasses.replace(config, seed=seed), replay, rate)
        if replay
        else simulate_rate(dataclasses.replace(config, seed=seed), rate, requests, seed)
        for seed in range(seeds)
    ]

    def median(name: str) -> Any:
        values = [getattr(r, name) for r in results]
        return None if any(v is None for v in values) else round(statistics.median(values), 3)

    first = results[0]
    return dataclasses.replace(
        first,
        throughput=median("throughput"),
        p50_ms=median("p50_ms"),
        p99_ms=median("p99_ms"),
        p999_ms=median("p999_ms"),
        mean_batch=median("mean_batch"),
        busy=median("busy"),
        unstable=any(r.unstable for r in results),
    )


def simulate_replay(config: SimConfig, replay: Replay, rate: float) -> RateResult:
    """A run's sends through the simulation, its warm-up's first: the window starts with the queue the warm-up
    left, only the window's requests and answers count, and a growing queue does not end it early."""
    share = replay.window_start_s / replay.arrivals[-1] if replay.arrivals[-1] > 0 else 0.0
    config = dataclasses.replace(config, max_backlog=len(replay.due) + 1)
    return simulate(config, replay.arrivals, rate, replay.due, warm_up_share=share, counted_from=replay.window_start_s)


def overhead_for(run: MeasuredRun, given: dict[str, float], runs: Sequence[MeasuredRun]) -> tuple[float, str]:
    """The per-request overhead to add, and where it came from."""
    if run.mode in given:
        return given[run.mode], "flag"
    own = run.lone_overhead_ms(lone_wait_ms(run))
    if own is not None:
        return round(own, 2), "lone"
    probes = [o for r in runs if r.mode == run.mode and (o := r.lone_overhead_ms(lone_wait_ms(r))) is not None]
    if probes:
        return round(statistics.median(probes), 2), f"lone, {run.mode} runs"
    light = [r.fastest_overhead_ms() for r in runs if r.mode == run.mode and r.light()]
    if light:
        return round(statistics.median(light), 2), f"fastest, {run.mode} runs"
    return 0.0, "none: give --overhead-ms"  # a loaded run's fastest answer has queued: no estimate


def awake_overhead(run: MeasuredRun, measured: MeasuredRate, overhead: float, source: str) -> tuple[float, str]:
    """The path's cost at this rate before the CPU's queueing, and where it came from: the warm-path
    probe's where requests come closer together than the idle path takes (each finds the processes
    on its path still awake from the last), else ``overhead`` (the idle path's, or the flag's)."""
    warm = run.lone_overhead_ms(lone_wait_ms(run), warm=True)
    if source == "flag" or warm is None or warm >= overhead or 1000.0 / measured.sent_rate >= overhead:
        return overhead, source
    return round(warm, 2), "warm"


def loaded_overhead_ms(overhead_ms: float, measured: MeasuredRate) -> float:
    """The idle path's overhead stretched by the CPU's queueing at this rate: processor sharing of the
    cores that the backend's own thread leaves, ``overhead * (1 - backend) / (1 - busy)``.

    ``busy`` is the machine's busy share measured during the rate (capped at ``BUSY_CAP``), ``backend``
    the share of it that the backend's calling thread used (a model computing on the CPU). That one
    thread runs on one core and releases the GIL inside its kernels, so the hops run beside it on the
    other cores: they share with the rest of the load what it leaves, ``(busy - backend) / (1 - backend)``
    of it busy. A backend that sleeps or waits for a GPU uses next to none: ``overhead / (1 - busy)``."""
    busy = min(measured.cpu_busy or 0.0, BUSY_CAP)
    backend = min(measured.backend_share or 0.0, busy)
    return round(overhead_ms * (1.0 - backend) / (1.0 - busy), 2)


def compare(
    runs: Sequence[MeasuredRun],
    given: dict[str, float],
    requests: int = 20_000,
    seeds: int = 3,
    per_item: dict[str, float] | None = None,
    *,
    cpu_scaling: bool = True,
    call_extra: bool = True,
    spread: bool = True,
    replay: bool = True,
    stages: bool = True,
    call_record: bool = True,
    held_out: float | None = None,
) -> list[Row]:
    """Every run's rates, measured and simulated; with ``held_out``, only each run's rate nearest it,
    simulated from what the run's other rates predict for it (``predicted_inputs``)."""
    rows = []
    for run in runs:
        overhead, source = overhead_for(run, given, runs)
        config = sim_config(run, overhead)
        for measured in run.rates if held_out is None else [_nearest(run, held_out)]:
            inputs, extra, outside = measured, run.call_extra_ms(measured), measured.outside_ms()
            if held_out is not None:
                predicted = predicted_inputs(run, measured)
                inputs, extra, outside = predicted.rate, predicted.call_extra_ms, predicted.outside_ms
            extra = extra if call_extra else None
            base, base_from = awake_overhead(run, inputs, overhead, source)
            at_rate = loaded_overhead_ms(base, inputs) if cpu_scaling else base
            fixed_ms, contention_ms = (base, round(at_rate - base, 2)) if spread else (at_rate, 0.0)
            outside = outside if stages and source != "flag" else None
            transit_ms = 0.0
            if outside is not None:  # measured at this rate (or fitted from the others): no stretch to estimate
                inbound_ms, transit = run.probe_hops_ms(lone_wait_ms(run), warm=base_from == "warm")
                transit_ms = round(transit, 2)
                fixed_ms, contention_ms = in_service_overhead(base, outside + inbound_ms, spread)
                inbound = f" + inbound {inbound_ms:.2f}" if inbound_ms else ""
                base_from = f"{base_from}; in-service {outside:.2f}{inbound}"
            step_ms = (per_item or {}).get(run.mode, 0.0)
            taken = inputs.call_extras_ms(run.backend_curve()) if extra is not None and spread and call_record else ()
            rate_config = dataclasses.replace(
                config,
                overhead_ms=fixed_ms,
                contention_ms=contention_ms,
                per_item_ms=step_ms,
                call_extra_ms=extra or 0.0,
                call_extra_spread=spread,
                call_extras_ms=taken,
                transit_ms=transit_ms,
            )
            sends = inputs.replay() if replay else None
            simulated = simulate_median(rate_config, inputs.sent_rate, requests, seeds, sends)
            row = Row(run, measured, simulated, fixed_ms, base_from, step_ms, extra, contention_ms, bool(sends))
            rows.append(
                dataclasses.replace(row, transit_ms=transit_ms, calls_taken=len(taken), held_out=held_out is not None)
            )
    return rows


# a rate held out ------------------------------------------------------------------------------------
def _nearest(run: MeasuredRun, rate: float) -> MeasuredRate:
    """The run's rate offered nearest ``rate``: the one to predict."""
    return min(run.rates, key=lambda measured: abs(measured.offered - rate))


@dataclass(frozen=True, slots=True)
class Predicted:
    """What the run's other rates predict for a rate held out."""

    rate: MeasuredRate
    """The rate as the simulation reads it: offered, with the CPU figures fitted and nothing of its own."""
    call_extra_ms: float | None
    outside_ms: float | None
    """The path's own cost at the rate (``MeasuredRate.outside_ms``), fitted."""


def predicted_inputs(run: MeasuredRun, target: MeasuredRate) -> Predicted:
    """What the simulation of ``target`` may take, from the run's other rates alone: the machine's CPU busy
    share, the backend thread's share of it, each call's extra time and the path's cost in the service,
    each on the straight line through the other rates (least squares by rate offered), at the rate
    offered; Poisson arrivals at that rate. Nothing measured at ``target`` goes in: not its sends, its
    calls, its stages or its CPU. (A figure the other rates did not measure is None.)"""
    others = [measured for measured in run.rates if measured is not target]
    if len(others) < 2:
        raise RunError(
            f"run {run.name}: --held-out needs at least two other rates to predict {target.offered:g}/s from"
        )
    at = target.offered
    busy = _fit([(m.offered, m.cpu_busy) for m in others], at)
    backend = _fit([(m.offered, m.backend_share) for m in others], at)
    extra = _fit([(m.offered, run.call_extra_ms(m)) for m in others], at)
    outside = _fit([(m.offered, m.outside_ms()) for m in others], at)
    rate = dataclasses.replace(
        target,
        sent_rate=at,
        cpu_busy=None if busy is None else min(max(busy, 0.0), 1.0),
        backend_share=None if backend is None else max(backend, 0.0),
        stages_ms=None,
        mean_ms=None,
        sends=None,
        warmup_sends=None,
        calls=None,
    )
    return Predicted(
        rate,
        None if extra is None else round(max(extra, 0.0), 2),
        None if outside is None else round(max(outside, 0.0), 2),
    )


def _fit(points: Sequence[tuple[float, float | None]], at: float) -> float | None:
    """The least-squares line through ``points`` (rate, figure), read at ``at``; None when fewer than two
    figures were measured. (Two points: the line through them.)"""
    known = [(x, y) for x, y in points if y is not None]
    if len(known) < 2:
        return None
    mean_x = statistics.fmean(x for x, _ in known)
    mean_y = statistics.fmean(y for _, y in known)
    spread = sum((x - mean_x) ** 2 for x, _ in known)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in known) / spread if spread else 0.0
    return mean_y + slope * (at - mean_x)


def in_service_overhead(base_ms: float, outside_ms: float, spread: bool) -> tuple[float, float]:
    """The fixed part and the mean of the per-batch exponential part of a path that costs
    ``outside_ms`` on average at this rate (measured in the service): the probe's cost (``base_ms``)
    fixed, the rest the CPU's queueing, which varies; all fixed without ``spread``."""
    if not spread:
        return round(outside_ms, 2), 0.0
    fixed = min(base_ms, outside_ms)
    return round(fixed, 2), round(outside_ms - fixed, 2)


# the table ------------------------------------------------------------------------------------------
def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.1f}%"


def _ms(value: float | None) -> str:
    return "unstable" if value is None else f"{value:.1f}"


def _batch(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _overhead(row: Row) -> str:
    text = f"{row.overhead_ms:g} ({row.overhead_from})"
    text = f"{text} + exp {row.contention_ms:g}" if row.contention_ms else text
    text = f"{text}; transit {row.transit_ms:g}" if row.transit_ms else text
    text = f"{text}; sends replayed" if row.replayed else text
    text = f"{text} + {row.per_item_ms:.2f}/answer" if row.per_item_ms else text
    text = f"{text}; calls +{row.call_extra_ms:g} ms" if row.call_extra_ms is not None else text
    text = f"{text} as {row.calls_taken} measured" if row.calls_taken else text
    return f"{text}; predicted from the other rates" if row.held_out else text


def format_table(rows: Sequence[Row]) -> str:
    """A markdown table: measured / simulated per figure, the difference, and the bounds broken."""
    lines = [
        "| run | mode | rate/s | thru/s meas / sim | Δ | p50 ms meas / sim | Δ | p99 ms meas / sim | Δ "
        "| batch meas / sim | overhead ms | flags |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        m, s = row.measured, row.simulated
        thru, p50, p99 = row.diffs()
        flags = ", ".join(row.flags()) or ("saturated" if row.saturated else "ok")
        if row.flags() and row.saturated:
            flags += " (saturated)"
        lines.append(
            f"| {row.run.name} | {row.run.mode} | {m.offered:g} | {m.throughput:.1f} / {s.throughput:.1f} "
            f"| {_pct(thru)} | {m.p50_ms:.1f} / {_ms(s.p50_ms)} | {_pct(p50)} | {m.p99_ms:.1f} / {_ms(s.p99_ms)} "
            f"| {_pct(p99)} | {_batch(m.mean_batch)} / {s.mean_batch:.1f} | {_overhead(row)} | {flags} |"
        )
    return "\n".join(lines)


# the command ----------------------------------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("validate-sim")
    parser.add_argument("results", nargs="+", help="bench result directories (bench/runs/<figure>)")
    parser.add_argument(
        "--overhead-ms",
        action="append",
        default=[],
        metavar="MODE=MS",
        help="per-request overhead for a mode (embedded=1.5, kafka=6); default: the lone-request probe",
    )
    parser.add_argument(
        "--per-item-ms",
        action="append",
        default=[],
        metavar="MODE=MS",
        help="added per answer ahead in its batch, for a mode (results stored and answered one by one)",
    )
    switches = {
        "--cpu-scaling": "stretch the overhead by the machine's measured CPU busy share, less the backend "
        "thread's own: overhead * (1 - backend) / (1 - busy)",
        "--contention-spread": "draw that stretch per batch, and each call's extra, exponential with that mean "
        "(off: the means, fixed)",
        "--call-record": "where a run recorded its calls, give each call the extra of the run's, one by one",
        "--replay": "replay a run's recorded sends (its bursts and lag) where it has them, not Poisson arrivals",
        "--call-extra": "add to each call the time per call the workers spent in the backend beyond the curve's",
        "--stages": "where the run recorded the service's stages, take the path's cost at each rate from "
        "them (mean latency less accept-to-sealed, sealed-to-call-start and the call) instead of stretching "
        "the probe's",
    }
    for flag, text in switches.items():
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=True, help=text)
    parser.add_argument(
        "--curve",
        default=None,
        help="the curve file (batchwire profile) of the runs' backend, for a real model; default: the flat sim latency",
    )
    parser.add_argument(
        "--held-out",
        type=number,
        default=None,
        metavar="RATE",
        help="predict each run's rate nearest RATE from its other rates alone (CPU busy share, backend share "
        "and call extra fitted by rate; Poisson arrivals), and hold the prediction to 5%% throughput, 10%% p50, "
        "25%% p99",
    )
    parser.add_argument("--requests", type=int, default=20_000, help="simulated requests per rate and seed")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per rate (the median is shown)")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    parser.add_argument("--log-level", default="warning", help=LEVEL_NAMES)


def _overheads(pairs: Sequence[str], flag: str = "--overhead-ms") -> dict[str, float]:
    given: dict[str, float] = {}
    for pair in pairs:
        mode, _, value = pair.partition("=")
        try:
            ms = float(value)
        except ValueError as err:
            raise ValueError(f"{flag} takes MODE=MS (embedded=1.5), got {pair!r}") from err
        if not (math.isfinite(ms) and ms >= 0):
            raise ValueError(f"{flag} takes 0 or more ms (a finite duration) per mode, got {pair!r}")
        given[mode.strip()] = ms
    return given


def run(args: argparse.Namespace) -> int:
    """``batchwire validate-sim``."""
    try:
        if args.out is not None:
            check_out(Path(args.out))
        given = _overheads(args.overhead_ms)
        per_item = _overheads(args.per_item_ms, "--per-item-ms")
        if args.seeds < 1 or args.requests < 1:
            raise ValueError(f"--seeds and --requests must be at least 1, got {args.seeds} and {args.requests}")
        if args.requests > MAX_REQUESTS:
            raise ValueError(
                f"--requests is {args.requests:,}; it must be at most {MAX_REQUESTS:,}: each is held in memory"
            )
        runs = [r for path, name in results_files(args.results) for r in read_runs(path, name)]
        modes = sorted({r.mode for r in runs})
        for flag, by_mode in (("--overhead-ms", given), ("--per-item-ms", per_item)):
            if unknown := sorted(set(by_mode) - set(modes)):
                raise ValueError(f"{flag} names {', '.join(map(repr, unknown))}, no run's mode: the runs' are {modes}")
        if args.curve is not None:
            backend_curve = curve_file.load(args.curve)
            runs = [r.with_curve(backend_curve) for r in runs]
        rows = compare(
            runs,
            given,
            args.requests,
            args.seeds,
            per_item,
            cpu_scaling=args.cpu_scaling,
            call_extra=args.call_extra,
            spread=args.contention_spread,
            replay=args.replay,
            stages=args.stages,
            call_record=args.call_record,
            held_out=args.held_out,
        )
        table = format_table(rows)
    except (RunError, CurveError, ValueError) as err:
        print(f"batchwire validate-sim: {err}", file=sys.stderr)
        return 2
    print(table)
    if args.out is not None:
        Path(args.out).write_text(table + "\n")
    return 0
