"""``batchwire plan``: how many GPUs, partitions, processes, brokers and Redis for a rate and a p99.

The GPU count comes from the simulation, not from a closed form: the smallest worker count whose
simulated p99 meets the target (the target sets how full the batches may get and how busy the
GPUs may be). Headroom then divides it: ``ceil(gpus / headroom)``. Everything else follows from the
rate in closed form (``batchwire.capacity.sizing``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from batchwire.capacity.costs import read_costs, sources_for
from batchwire.capacity.curve import Curve, CurveError
from batchwire.capacity.engine import SimConfig
from batchwire.capacity.simulate import (
    MAX_WORKERS,
    RateResult,
    add_arguments,
    config_from,
    curve_from,
    simulate_rate,
)
from batchwire.capacity.sizing import (
    DEFAULT_HEADROOM,
    Figure,
    SizingError,
    SizingInputs,
    as_dict,
    load_cpu_file,
    processes,
    size,
    with_values,
)
from batchwire.settings import number

MAX_GROWTH = 64
"""The search gives up past this many times the closed-form lower bound."""


class PlanError(ValueError):
    """No deployment meets the target; the message says why."""


@dataclass(frozen=True, slots=True)
class ModelPlan:
    model: str
    rate: float
    gpus: int
    gpus_with_headroom: int
    batchers: int
    """Batchers sharing the model's requests in the simulation."""
    simulated: RateResult

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "rate": self.rate,
            "gpus": self.gpus,
            "gpus_with_headroom": self.gpus_with_headroom,
            "batch_partitions": self.gpus_with_headroom,
            "simulated_batchers": self.batchers,
            "simulated": self.simulated.to_json(),
        }


def default_requests(rate: float) -> int:
    """Enough simulated requests for a steady p99: about 3 s of arrivals, 50,000 to 300,000."""
    return max(50_000, min(300_000, math.ceil(rate * 3)))


def gpus_for(
    configure: Callable[[int], SimConfig], rate: float, p99_ms: float, requests: int, seed: int = 0
) -> tuple[int, RateResult]:
    """The smallest worker count whose simulated p99 at ``rate`` is at most ``p99_ms``, and its figures.

    Starts at the closed-form bound (rate / one worker's best rate), grows by a quarter until the
    target is met, then bisects between the last miss and the first hit.
    """
    probe = configure(1)
    per_worker, _ = probe.curve.best_rate_per_worker(probe.batch_limit)
    fastest_ms = probe.curve.latency_ms(1) + probe.transit_ms + probe.overhead_ms
    if p99_ms < fastest_ms:
        raise PlanError(
            f"p99 target {p99_ms:g} ms is below one call of a single item with its transit and overhead "
            f"({fastest_ms:.1f} ms): no worker count meets it"
        )
    lower = max(1, math.ceil(rate / per_worker))
    if lower > MAX_WORKERS:
        raise PlanError(
            f"{rate:g} req/s needs at least {lower} GPUs (one serves {per_worker:.0f} req/s at best), more than the "
            f"{MAX_WORKERS} this planner simulates: plan a share of the traffic (--rate R/k) and multiply its GPUs by k"
        )

    def meets(workers: int) -> RateResult | None:
        result = simulate_rate(configure(workers), rate, requests, seed)
        return result if result.p99_ms is not None and result.p99_ms <= p99_ms else None

    miss, hit = lower - 1, lower
    found = meets(hit)
    while found is None:
        if hit > MAX_GROWTH * lower:
            raise PlanError(f"no worker count up to {hit} keeps p99 within {p99_ms} ms at {rate} req/s")
        miss, hit = hit, max(hit + 1, math.ceil(hit * 1.25))
        found = meets(hit)
    while hit - miss > 1:
        middle = (miss + hit) // 2
        result = meets(middle)
        if result is None:
            miss = middle
        else:
            hit, found = middle, result
    return hit, found


def plan_model(
    configure: Callable[[int], SimConfig],
    model: str,
    rate: float,
    p99_ms: float,
    headroom: float,
    requests: int,
    seed: int = 0,
) -> ModelPlan:
    gpus, simulated = gpus_for(configure, rate, p99_ms, requests, seed)
    return ModelPlan(model, rate, gpus, math.ceil(gpus / headroom - 1e-9), configure(1).batchers, simulated)


def summary(plans: list[ModelPlan], figures: list[Figure], inputs: SizingInputs, p99_ms: float) -> dict[str, Any]:
    gpus = sum(p.gpus for p in plans)
    with_headroom = sum(p.gpus_with_headroom for p in plans)
    fewest = f"the fewest workers whose simulated p99 is within {p99_ms:g} ms"
    spare = f"ceil(gpus / headroom {inputs.headroom:g})"
    if len(plans) > 1:
        # A worker serves one model: the figures add up each model's count, not one count for the summed rate.
        each = f"summed over the {len(plans)} models: for each,"
        fewest, spare = f"{each} {fewest}", f"{each} {spare}"
    else:
        fewest, spare = f"per model, {fewest}", f"per model, {spare}"
    gpu_figures = [
        Figure("gpus", gpus, fewest),
        Figure("gpus_with_headroom", with_headroom, spare),
        Figure("batch_partitions", with_headroom, "one per worker: a worker owns its batch partition"),
    ]
    every = gpu_figures + figures
    return {
        **as_dict(every),
        "models": [p.to_json() for p in plans],
        "formulas": {f.name: f.formula for f in every},
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'figure':<22} {'value':>16}  formula"]
    for name, formula in result["formulas"].items():
        lines.append(f"{name:<22} {result[name]:>16,}  {formula}")
    for model in result["models"]:
        sim = model["simulated"]
        lines.append(
            f"model {model['model']}: {model['rate']:g} req/s on {model['gpus']} GPUs "
            f"and {model['simulated_batchers']} batchers: "
            f"simulated p50 {sim['p50_ms']} ms, "
            f"p99 {sim['p99_ms']} ms, mean batch {sim['mean_batch']}, busy {sim['busy']}"
        )
    inputs = result.get("inputs", {})
    if inputs:
        lines.append(f"{'input':<27} {'value':>12}  from")
        lines += [f"{name:<27} {entry['value']:>12,.6g}  {entry['from']}" for name, entry in inputs.items()]
    return "\n".join(lines)


# the command ------------------------------------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("plan")
    add_arguments(parser)
    parser.add_argument("--rate", type=float, default=None, help="requests per second in all (one model)")
    parser.add_argument("--models", default=None, help="several models: NAME=RATE,NAME=RATE (instead of --rate)")
    parser.add_argument("--p99-ms", type=number, required=True, help="p99 latency target in milliseconds")
    parser.add_argument(
        "--headroom", type=float, default=None, help=f"share of each resource to fill (default {DEFAULT_HEADROOM})"
    )
    parser.add_argument("--cpu-file", default=None, help="JSON of CPU per request and other sizing inputs")
    parser.add_argument(
        "--costs",
        default=None,
        metavar="RUN",
        help="a batchwire bench run over Kafka (its directory): CPU per role, Redis commands and memory, and "
        "Kafka bytes and records per request, measured at its busiest rate that kept up, replace the defaults "
        "(after --cpu-file)",
    )
    parser.add_argument("--result-ttl-s", type=number, default=None, help="how long results stay in Redis")
    parser.add_argument("--replication-factor", type=int, default=None, help="Kafka replication factor")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(requests=None, batchers=None)


def _models(args: argparse.Namespace) -> list[tuple[str, float]]:
    if args.models and args.rate is not None:
        raise PlanError("give --rate R (one model) or --models NAME=RATE,... (several), not both")
    if args.models:
        try:
            pairs = [part.split("=", 1) for part in args.models.split(",") if part.strip()]
            models = [(name.strip(), float(rate)) for name, rate in pairs]
        except ValueError as err:
            raise PlanError(f"--models takes NAME=RATE,NAME=RATE, got {args.models!r}") from err
        names = [name for name, _ in models]
        if "" in names or len(set(names)) < len(names):
            # one model's rates planned apart would batch apart too: more GPUs than the model needs
            raise PlanError(f"--models takes each model once, by name, with its whole rate; got {args.models!r}")
    elif args.rate is not None:
        models = [("model", args.rate)]
    else:
        raise PlanError("give --rate R or --models NAME=RATE,...")
    if not all(0 < rate < math.inf for _, rate in models):  # NaN too
        raise PlanError(f"rates must be positive finite numbers, got {', '.join(f'{rate:g}' for _, rate in models)}")
    return models


def _inputs(args: argparse.Namespace) -> tuple[SizingInputs, dict[str, str]]:
    """The sizing inputs, and where each came from."""
    inputs = SizingInputs()
    given: dict[str, str] = {}
    if args.cpu_file:
        before = inputs
        inputs = load_cpu_file(args.cpu_file, inputs)
        given.update({name: f"--cpu-file {args.cpu_file}" for name in changed(before, inputs)})
    costs = read_costs(args.costs) if args.costs else None
    if costs is not None:
        inputs = with_values(inputs, costs.values)
    if args.headroom is not None:
        inputs = replace(inputs, headroom=args.headroom)
        given["headroom"] = "--headroom"
    if args.result_ttl_s is not None:
        inputs = replace(inputs, result_ttl_s=args.result_ttl_s)
        given["result_ttl_s"] = "--result-ttl-s"
    if args.replication_factor is not None:
        inputs = replace(inputs, replication_factor=args.replication_factor)
        given["replication_factor"] = "--replication-factor"
    return inputs, sources_for(costs, given)


def changed(before: SizingInputs, after: SizingInputs) -> list[str]:
    """The inputs whose values differ."""
    return [field.name for field in fields(SizingInputs) if getattr(before, field.name) != getattr(after, field.name)]


def batchers_for(args: argparse.Namespace, rate: float, inputs: SizingInputs) -> int:
    """The batchers that share one model's requests in the simulation: ``--batchers``, else as sized for its rate."""
    if args.batchers is not None:
        return int(args.batchers)
    return processes(rate, inputs.batcher_us_per_request, inputs.headroom)


def make_plan(args: argparse.Namespace, curve: Curve) -> dict[str, Any]:
    inputs, sources = _inputs(args)
    models = _models(args)
    figures = size(sum(rate for _, rate in models), inputs, len(models))  # before the simulations: its errors at once
    plans = [
        plan_model(
            functools.partial(config_from, args, curve, batchers=batchers_for(args, rate, inputs)),
            model,
            rate,
            args.p99_ms,
            inputs.headroom,
            args.requests or default_requests(rate),
            args.seed,
        )
        for model, rate in models
    ]
    result = summary(plans, figures, inputs, args.p99_ms)
    result["inputs"] = {name: {"value": getattr(inputs, name), "from": source} for name, source in sources.items()}
    return result


def run(args: argparse.Namespace) -> int:
    """``batchwire plan``."""
    try:
        result = make_plan(args, curve_from(args))
    except (CurveError, SizingError, PlanError, ValueError) as err:
        print(f"batchwire plan: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0
