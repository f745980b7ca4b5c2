"""``batchwire simulate``: a deployment's latency, throughput and batches at given arrival rates.

Each rate runs the discrete-event simulation of ``batchwire.capacity.engine`` over the curve and
sums it up: throughput, p50/p99/p99.9 latency, mean batch, GPU busy fraction, queue depth. A rate
the deployment cannot keep up with is reported unstable, without latencies.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batcher.policy import FlushPolicy, PolicyName
from batchwire.capacity import arrivals as arrival_processes
from batchwire.capacity.curve import Curve, CurveError, load, percentile
from batchwire.capacity.engine import SimConfig, Simulation
from batchwire.capacity.outcome import SimOutcome
from batchwire.settings import number
from telemetry.logs import LEVEL_NAMES

MAX_WORKERS = 10_000
"""The most GPUs of one model simulated (each gets its own latency table and events): past it a run
would take hours, and the same deployment for a share of the traffic, multiplied, answers as well."""
MAX_REQUESTS = 10_000_000
"""The most simulated requests per rate: every arrival, latency and batch is held in memory, and more
than this fills a machine's memory before the first result."""
UNSTABLE_BACKLOG_SHARE = 0.02
"""Unstable when more than this share of the requests is still waiting as the arrivals end."""
WARM_UP_SHARE = 0.1
"""Throughput counts the requests served after this share of the run (the queues have filled)."""


@dataclass(frozen=True, slots=True)
class RateResult:
    """One rate's summary. Latencies are None when the rate is unstable (the queue only grows)."""

    rate: float
    requests: int
    throughput: float
    p50_ms: float | None
    p99_ms: float | None
    p999_ms: float | None
    mean_batch: float
    busy: float
    max_queue: int
    mean_queue: float
    unstable: bool
    expired: int
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def capacity(config: SimConfig) -> float:
    """Requests/s the workers serve at most: each runs full batches back to back."""
    rate, _ = config.curve.best_rate_per_worker(config.batch_limit)
    return sum(rate / config.scale(worker) for worker in range(config.workers))


def summarize(
    rate: float, config: SimConfig, out: SimOutcome, wall_s: float, warm_up_share: float = WARM_UP_SHARE
) -> RateResult:
    """The figures of one run. Throughput counts requests served by the last arrival (or the stop),
    after ``warm_up_share`` of the run."""
    horizon_s = out.stopped_s if out.stopped_s is not None else out.horizon_s
    served = sum(size for end, size in zip(out.ends_s, out.sizes, strict=True) if end <= horizon_s)
    window_s = horizon_s * (1 - warm_up_share)
    in_window = sum(
        size for end, size in zip(out.ends_s, out.sizes, strict=True) if horizon_s - window_s < end <= horizon_s
    )
    throughput = in_window / window_s if window_s > 0 else float(len(out.latencies_s))
    waiting_at_end = out.arrivals - served - out.expired
    backlog_limit = max(4 * config.workers * config.batch_limit, UNSTABLE_BACKLOG_SHARE * out.arrivals)
    unstable = out.stopped_s is not None or rate >= capacity(config) or waiting_at_end > backlog_limit
    latencies = [] if unstable else sorted(out.latencies_s)

    def ms(q: float) -> float | None:
        return round(percentile(latencies, q) * 1000, 3) if latencies else None

    span_s = max(out.last_end_s, horizon_s)
    return RateResult(
        rate=rate,
        requests=out.arrivals,
        throughput=round(throughput, 3),
        p50_ms=ms(0.50),
        p99_ms=ms(0.99),
        p999_ms=ms(0.999),
        mean_batch=round(sum(out.sizes) / out.batches, 3) if out.batches else 0.0,
        busy=round(out.busy_s / (config.workers * span_s), 4) if span_s > 0 else 0.0,
        max_queue=out.queue_max,
        mean_queue=round(out.queue_sum / out.arrivals, 3) if out.arrivals else 0.0,
        unstable=unstable,
        expired=out.expired,
        wall_s=round(wall_s, 3),
    )


def simulate(
    config: SimConfig,
    times: Sequence[float],
    rate: float,
    due: Sequence[float] | None = None,
    warm_up_share: float = WARM_UP_SHARE,
    counted_from: float = -math.inf,
) -> RateResult:
    """Runs ``times`` (arrival seconds, ascending) through a fresh simulation and sums it up; ``due``
    and ``counted_from`` as for ``Simulation.run``. A measured run's sends are replayed with its
    warm-up's before them: ``warm_up_share`` is then the warm-up's share of the run and
    ``counted_from`` the window's start, so only the window counts, as the bench counts it."""
    started = time.perf_counter()
    out = Simulation(config).run(times, due, counted_from)
    return summarize(rate, config, out, time.perf_counter() - started, warm_up_share)


def simulate_rate(config: SimConfig, rate: float, requests: int, seed: int = 0) -> RateResult:
    """``requests`` Poisson arrivals at ``rate`` per second (seeded: the same seed, the same run)."""
    return simulate(config, arrival_processes.poisson(rate, requests, seed), rate)


def policy_for(
    name: str,
    max_batch: int | None = None,
    max_wait_ms: float | None = None,
    reserve_ms: float | None = None,
    backend_max: int | None = None,
) -> FlushPolicy:
    """The service's policy of that name, with its defaults where a setting is not given.

    An unset max batch is the policy's default capped at the backend's (``backend_max``), as an
    operator sets ``--max-batch``: a policy that seals larger batches than a worker takes has them
    cut (32, 32, 32, 4 of 100), as the service would.
    """
    if max_batch is None and backend_max is not None:
        max_batch = min(FlushPolicy.named(name).max_batch, backend_max)
    policy = FlushPolicy.named(name, max_batch, max_wait_ms)
    if reserve_ms is not None and policy.name is PolicyName.WORK_CONSERVING:
        policy = dataclasses.replace(policy, reserve_ms=reserve_ms)
    return policy


# the command ------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags ``simulate`` and ``plan`` share: the deployment being simulated."""
    parser.add_argument("--curve", required=True, help="curve file written by batchwire profile")
    parser.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="the traffic's input length in tokens: the curve at that length (profiled with --lengths)",
    )
    parser.add_argument(
        "--policy", default="work-conserving", choices=[p.value for p in PolicyName], help="flush policy"
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="items per batch at most (default: the policy's, at most the curve's largest size)",
    )
    parser.add_argument(
        "--max-wait-ms", type=number, default=None, help="age that seals a batch (default: the policy's)"
    )
    parser.add_argument(
        "--reserve-ms",
        type=number,
        default=None,
        help="work-conserving low-load reserve (default: the policy's; 0: off)",
    )
    parser.add_argument(
        "--credit-lead-ms",
        type=number,
        default=None,
        help="workers offer their next credit this long before a call ends",
    )
    parser.add_argument(
        "--credit-lead-full-ms",
        type=number,
        default=None,
        help="the lead while the running batch is at least half full",
    )
    parser.add_argument(
        "--spacing-margin-ms", type=number, default=None, help="spacing of busy workers' starts (-1: off)"
    )
    parser.add_argument("--transit-ms", type=float, default=0.0, help="a batch's way from the batcher to its worker")
    parser.add_argument(
        "--overhead-ms", type=float, default=0.0, help="added to every request: the gateway's and the result's hops"
    )
    parser.add_argument(
        "--batchers",
        type=int,
        default=1,
        help="batchers sharing the model's requests and workers (more than 1: no spacing)",
    )
    parser.add_argument("--requests", type=int, default=100_000, help="simulated requests per rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    parser.add_argument("--log-level", default="warning", help=LEVEL_NAMES)


def curve_from(args: argparse.Namespace) -> Curve:
    """The curve file of ``--curve``, at the input length of ``--tokens`` when given."""
    curve = load(args.curve)
    if args.tokens is not None and args.tokens < 1:
        raise ValueError(f"--tokens takes a positive length in tokens, got {args.tokens}")
    return curve if args.tokens is None else curve.at_tokens(args.tokens)


def config_from(args: argparse.Namespace, curve: Curve, workers: int, batchers: int | None = None) -> SimConfig:
    """The simulated deployment from the shared flags; unset service settings keep the services' defaults."""
    if args.batchers is not None and args.batchers < 1:
        # plan reads no --batchers as "size it": 0 has no meaning of its own in either command
        raise ValueError(f"--batchers is {args.batchers}; it must be at least 1")
    counts = (
        ("--requests", args.requests, 1),
        ("--max-batch", args.max_batch, 1),
        ("--max-wait-ms", args.max_wait_ms, 0),
        ("--reserve-ms", args.reserve_ms, 0),
    )
    leads = (("--credit-lead-ms", args.credit_lead_ms, 0), ("--credit-lead-full-ms", args.credit_lead_full_ms, 0))
    for flag, value, least in (*counts, *leads):
        if value is not None and value < least:
            raise ValueError(f"{flag} is {value:g}; it must be at least {least}")
    if args.requests is not None and args.requests > MAX_REQUESTS:
        raise ValueError(
            f"--requests is {args.requests:,}; it must be at most {MAX_REQUESTS:,}: each is held in memory "
            "(a steady p99 needs far fewer; plan's default is 50,000 to 300,000)"
        )
    for flag, hop_ms in (("--transit-ms", args.transit_ms), ("--overhead-ms", args.overhead_ms)):
        if not hop_ms >= 0 or math.isinf(hop_ms):  # NaN fails the first test
            raise ValueError(f"{flag} is {hop_ms:g}; it must be 0 or more ms (a finite duration)")
    if args.reserve_ms and args.policy == PolicyName.CLASSIC:
        raise ValueError(
            f"--reserve-ms is {args.reserve_ms:g}, and --policy is classic, which holds no worker in reserve: "
            "use work-conserving, or leave the reserve unset"
        )
    policy = policy_for(args.policy, args.max_batch, args.max_wait_ms, args.reserve_ms, curve.max_batch)
    base = SimConfig(
        curve,
        workers,
        policy,
        transit_ms=args.transit_ms,
        overhead_ms=args.overhead_ms,
        batchers=batchers or args.batchers,
    )

    def given(value: float | None, default: float) -> float:
        return default if value is None else float(value)

    return dataclasses.replace(
        base,
        credit_lead_ms=given(args.credit_lead_ms, base.credit_lead_ms),
        credit_lead_full_ms=given(args.credit_lead_full_ms, base.credit_lead_full_ms),
        spacing_margin_ms=given(args.spacing_margin_ms, base.spacing_margin_ms),
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("simulate")
    add_arguments(parser)
    parser.add_argument("--workers", type=int, required=True, help="workers (GPUs) serving the model")
    parser.add_argument("--rate", default=None, help="comma-separated request rates per second (Poisson arrivals)")
    parser.add_argument("--trace", default=None, help="arrival timestamps (JSON list or one a line) instead of --rate")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per rate")


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise ValueError(f"--rate takes comma-separated numbers, got {text!r}") from err
    if not rates or not all(0 < r < math.inf for r in rates):  # NaN too
        raise ValueError(f"--rate takes positive finite rates, got {text!r}")
    return rates


def format_table(results: Sequence[RateResult]) -> str:
    def show(value: float | None) -> str:
        return "unstable" if value is None else f"{value:.1f}"

    lines = [
        f"{'rate/s':>10} {'thru/s':>10} {'p50 ms':>9} {'p99 ms':>9} {'p99.9 ms':>9} {'batch':>7} {'busy':>6} "
        f"{'queue max/mean':>16}"
    ]
    for r in results:
        lines.append(
            f"{r.rate:>10.1f} {r.throughput:>10.1f} {show(r.p50_ms):>9} {show(r.p99_ms):>9} {show(r.p999_ms):>9} "
            f"{r.mean_batch:>7.1f} {r.busy:>6.2f} {f'{r.max_queue}/{r.mean_queue:.1f}':>16}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``batchwire simulate``."""
    try:
        if args.workers < 1:
            raise ValueError(f"--workers is {args.workers}; it must be at least 1")
        if args.workers > MAX_WORKERS:
            raise ValueError(
                f"--workers is {args.workers}; it must be at most {MAX_WORKERS:,}: simulate a share of the traffic "
                "(--rate R/k with --workers W/k) and multiply"
            )
        config = config_from(args, curve_from(args), args.workers)
        if args.trace is not None:
            times = arrival_processes.load_trace(args.trace)
            span_s = times[-1] or 1.0
            results = [simulate(config, times, len(times) / span_s)]
        elif args.rate is not None:
            results = [simulate_rate(config, rate, args.requests, args.seed) for rate in _rates(args.rate)]
        else:
            raise ValueError("give --rate R1,R2,... or --trace FILE")
    except (CurveError, ValueError) as err:
        print(f"batchwire simulate: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=2))
    else:
        print(format_table(results))
    return 0
