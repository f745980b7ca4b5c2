"""A ``batchwire bench`` run directory as the simulation needs it: the deployment and its figures.

``results.json`` gives the deployment (mode, workers, sim latency, a slow worker, policy, max
batch), the lone-request probe when the run made one, and per rate what was sent and measured:
throughput, latencies, mean batch, and the CPU the machine spent (service, Kafka, Redis, load).
A run of a real model (the hf backend) is read with its profiled curve (``with_curve``): the
backend's latency is then the curve's, not the flat sim latency the file records.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchwire.bench import calls as call_record
from batchwire.bench import sends as sent
from batchwire.bench.prom import backend_seconds
from batchwire.bench.settle import opening_backlog
from batchwire.capacity.curve import Curve

LIGHT_SHARE = 0.05
"""A rate under this share of the workers' capacity is light: some requests find a worker idle."""
BACKEND_MAX_BATCH = 100
"""The sim backend's max batch when the run sets none (``gpu_worker.backends.sim``)."""


class RunError(ValueError):
    """A run directory cannot be read; the message names the file."""


@dataclass(frozen=True, slots=True)
class Replay:
    """A run's sends on the simulation's clock: the warm-up's (if kept) from 0, then the window's."""

    arrivals: list[float]
    """When each request was sent (due plus lag), ascending."""
    due: list[float]
    """When each was due, from which its latency counts."""
    window_start_s: float
    """Where the window began (0: no warm-up replayed); only requests due from here are measured."""


@dataclass(frozen=True, slots=True)
class MeasuredRate:
    offered: float
    sent_rate: float
    """Requests/s the generator actually sent in the window (its Poisson draw)."""
    throughput: float
    p50_ms: float
    p99_ms: float
    min_ms: float
    mean_batch: float | None
    cpu_busy: float | None
    """The machine's CPU busy share: service, Kafka, Redis and the load generator (None: not recorded)."""
    batches: float | None = None
    """Batches the workers ran in the window (None: not scraped)."""
    backend_s: float | None = None
    """Seconds the workers spent inside the backend in the window, summed over workers."""
    backend_share: float | None = None
    """The CPU the backends' calling threads used in the window, as a share of the machine's cores
    (None: not recorded; a model that computes on the CPU, not one that waits for a GPU or sleeps)."""
    sends: str | None = None
    """The generator's record of its sends (``batchwire.bench.sends``; None: an older run without one)."""
    warmup_sends: str | None = None
    """The same record of the warm-up's sends (None: a run that kept none)."""
    mean_ms: float | None = None
    """The requests' mean latency (None: not recorded)."""
    stages_ms: dict[str, float] | None = None
    """The service's mean time per request in each stage (``ServerStats.stages_ms``; None: an older run)."""
    unsettled: bool = False
    """The window opened on the warm-up's backlog (``batchwire.bench.settle``): its latencies are the
    start-up's, not the rate's steady state."""
    calls: str | None = None
    """The backend calls that started in the window (``batchwire.bench.calls``; None: not recorded)."""

    def replay(self) -> Replay | None:
        """The sends as the simulation replays them, the warm-up's first where the run kept them
        (None: no record of the window's)."""
        try:
            window = sent.decode(self.sends) if self.sends else []
            warmup = sent.decode(self.warmup_sends) if self.warmup_sends and window else []
        except sent.SendsError as err:
            raise RunError(str(err)) from err
        if not window:
            return None
        start_s = -min((due for due, _ in warmup), default=0.0)
        pairs = sorted((start_s + due + lag, start_s + due) for due, lag in warmup + window)
        return Replay([arrival for arrival, _ in pairs], [due for _, due in pairs], start_s)

    def outside_ms(self) -> float | None:
        """The requests' mean latency less the means per request of the stages that the simulation runs
        itself (accept to sealed, sealed to its call's start, the call): the path's own cost at this
        rate, measured."""
        stages = self.stages_ms or {}
        parts = [stages.get(key) for key in ("queue_wait_ms_mean", "sealed_to_started_ms_mean", "call_ms_mean")]
        if self.mean_ms is None or any(part is None for part in parts):
            return None
        return max(0.0, self.mean_ms - sum(part for part in parts if part is not None))

    def call_extra_ms(self, curve: Curve) -> float | None:
        """Measured backend time per call less what ``curve`` predicts for the batches run (their mean
        size): how much longer each call ran under this load than when profiled, never below 0 (None:
        not measured)."""
        if not self.batches or self.backend_s is None or self.mean_batch is None:
            return None
        low = max(1, min(math.floor(self.mean_batch), curve.max_batch))
        high = min(low + 1, curve.max_batch)
        frac = min(max(self.mean_batch - low, 0.0), 1.0)
        call_ms = curve.latency_ms(low) * (1 - frac) + curve.latency_ms(high) * frac
        return max(0.0, self.backend_s * 1000.0 / self.batches - call_ms)

    def call_extras_ms(self, curve: Curve) -> tuple[tuple[float, float], ...]:
        """Each recorded call's start (seconds from the window's) and its duration less what ``curve``
        predicts for its size, which may be below 0: the calls under this load (empty: none recorded)."""
        try:
            recorded = call_record.decode(self.calls) if self.calls else []
        except sent.SendsError as err:
            raise RunError(str(err)) from err
        top = curve.max_batch
        return tuple((c.at_s, c.seconds * 1000.0 - curve.latency_ms(min(max(c.size, 1), top))) for c in recorded)


@dataclass(frozen=True, slots=True)
class MeasuredRun:
    """One deployment of a bench run and its measured figures per rate."""

    name: str
    mode: str
    policy: str
    workers: int
    batchers: int
    sim_latency_ms: float
    slow_worker_latency_ms: float | None
    max_batch: int | None
    max_wait_ms: float | None
    lone_p50_ms: float | None
    rates: tuple[MeasuredRate, ...]
    curve: Curve | None = None
    """The backend's profiled curve; None: the flat sim backend at ``sim_latency_ms``."""
    warm_p50_ms: float | None = None
    """The warm-path probe's p50: lone requests sent back to back (None: not probed)."""
    lone_probe_call_ms: float | None = None
    """The backend's measured time per call during the lone probe (None: not recorded)."""
    warm_probe_call_ms: float | None = None
    """The same during the warm-path probe."""
    lone_probe_stages_ms: dict[str, float] | None = None
    """The service's stages during the lone probe (``ServerStats.stages_ms``; None: not recorded)."""
    warm_probe_stages_ms: dict[str, float] | None = None
    """The same during the warm-path probe."""

    def probe_hops_ms(self, policy_wait_ms: float = 0.0, *, warm: bool = False) -> tuple[float, float]:
        """The lone (``warm``: warm-path) probe's mean accept-to-sealed, less the policy's own wait for a
        lone request (``policy_wait_ms``, which the simulation adds itself), and sealed-to-call-start:
        with the worker idle, a request's way to the batcher and its batch's way to the worker, the
        worker's steps before the call included ((0, 0): not recorded)."""
        stages = (self.warm_probe_stages_ms if warm else self.lone_probe_stages_ms) or {}
        inbound = max(0.0, stages.get("queue_wait_ms_mean", 0.0) - policy_wait_ms) if stages else 0.0
        return inbound, stages.get("sealed_to_started_ms_mean", 0.0)

    def backend_curve(self) -> Curve:
        """The backend's latency by batch size: the curve given, else the sim backend's flat one."""
        if self.curve is not None:
            return self.curve
        return Curve.flat(self.sim_latency_ms, self.max_batch or BACKEND_MAX_BATCH)

    def with_curve(self, curve: Curve) -> MeasuredRun:
        """The same run with the backend's latency taken from ``curve`` (a run of the hf backend)."""
        if self.max_batch is not None and self.max_batch > curve.max_batch:
            raise RunError(
                f"{self.name} ran batches of up to {self.max_batch}; the curve stops at {curve.max_batch} "
                f"(profile with --max-batch {self.max_batch})"
            )
        return dataclasses.replace(self, curve=curve)

    def call_extra_ms(self, rate: MeasuredRate) -> float | None:
        """The backend's measured extra time per call at ``rate``, fed to every worker (None: not
        measured, or a slow worker, whose workers' shares of the batches are not recorded apart)."""
        if self.slow_worker_latency_ms:
            return None
        extra = rate.call_extra_ms(self.backend_curve())
        return None if extra is None else round(extra, 2)

    def lone_call_ms(self) -> float:
        """The backend's latency for a batch of one."""
        return self.backend_curve().latency_ms(1)

    def lone_overhead_ms(self, policy_wait_ms: float = 0.0, *, warm: bool = False) -> float | None:
        """The lone-request probe's p50 (``warm``: the warm-path probe's) less the backend's time per call
        during the probe and the policy's wait for a lone request (``policy_wait_ms``, which the simulation
        adds itself): the path's own cost. Where the probe did not record its calls, the curve's latency
        for a batch of one stands in for them."""
        p50, call_ms = (
            (self.warm_p50_ms, self.warm_probe_call_ms) if warm else (self.lone_p50_ms, self.lone_probe_call_ms)
        )
        if p50 is None:
            return None
        return max(0.0, p50 - (self.lone_call_ms() if call_ms is None else call_ms) - policy_wait_ms)

    def light(self) -> bool:
        """Whether its lowest rate is light enough that its fastest answer met an idle worker."""
        curve = self.backend_curve()
        top = min(self.max_batch or curve.max_batch, curve.max_batch)
        capacity = self.workers * max(size * 1000.0 / curve.latency_ms(size) for size in range(1, top + 1))
        return min(r.offered for r in self.rates) <= LIGHT_SHARE * capacity

    def fastest_overhead_ms(self) -> float:
        """The fastest answer at the lowest rate less the backend latency (a lower bound of the hops)."""
        lowest = min(self.rates, key=lambda r: r.offered)
        return max(0.0, lowest.min_ms - self.lone_call_ms())


def results_files(paths: Iterable[str | Path]) -> list[tuple[Path, str]]:
    """Each directory's ``results.json``, or those of its sub-directories (``durability-rf1/run1``),
    with the run's name: its directory, from the one given."""
    found: list[tuple[Path, str]] = []
    for path in map(Path, paths):
        if (path / "results.json").is_file():
            found.append((path / "results.json", path.name))
        else:
            nested = sorted(path.glob("*/results.json"))
            if not nested:
                raise RunError(f"{path} holds no results.json (run batchwire bench --out {path})")
            found.extend((file, f"{path.name}/{file.parent.name}") for file in nested)
    return found


def read_runs(results: Path, name: str | None = None) -> list[MeasuredRun]:
    """The deployments of one ``results.json`` (one per policy), named ``name`` (default: its directory)."""
    try:
        data = json.loads(results.read_text())
    except (OSError, ValueError) as err:
        raise RunError(f"cannot read {results}: {err}") from err
    name = name or results.parent.name
    try:
        config = data["config"]
        meta = data.get("metadata") or {}
        cpu_count = meta.get("cpu_affinity") or meta.get("cpu_count")
        return [_run(name, config, run, cpu_count) for run in data["runs"]]
    except (KeyError, TypeError) as err:
        raise RunError(f"{results} lacks {err} (is it a batchwire-bench/1 file?)") from err


def _run(name: str, config: dict[str, Any], run: dict[str, Any], cpu_count: int | None) -> MeasuredRun:
    sut = run["sut"]
    lone, warm = run.get("lone") or {}, run.get("warm") or {}
    several = len(config.get("policies") or []) > 1
    return MeasuredRun(
        name=f"{name} {run['policy']}" if several else name,
        mode=sut["mode"],
        policy=run["policy"],
        workers=int(sut["workers"]),
        batchers=int(sut.get("batchers") or config.get("batchers") or 1),
        sim_latency_ms=float(sut.get("sim_latency_ms") or config["sim_latency_ms"]),
        slow_worker_latency_ms=sut.get("slow_worker_latency_ms"),
        max_batch=sut.get("max_batch"),
        max_wait_ms=sut.get("max_wait_ms"),
        lone_p50_ms=(lone.get("latency_ms") or {}).get("p50"),
        rates=tuple(_rate(rate, cpu_count) for rate in run["rates"]),
        warm_p50_ms=(warm.get("latency_ms") or {}).get("p50"),
        lone_probe_call_ms=lone.get("call_ms"),
        warm_probe_call_ms=warm.get("call_ms"),
        lone_probe_stages_ms=lone.get("stages_ms"),
        warm_probe_stages_ms=warm.get("stages_ms"),
    )


def _rate(rate: dict[str, Any], cpu_count: int | None) -> MeasuredRate:
    latency = rate["latency_ms"]
    window_s = float(rate["window_s"])
    server = rate.get("server") or {}
    scraped_s = float(server.get("window_s") or window_s)  # the scrapes' own window, where recorded
    return MeasuredRate(
        offered=float(rate["offered_rps"]),
        sent_rate=float(rate["sent"]) / window_s if window_s > 0 else float(rate["offered_rps"]),
        throughput=float(rate["throughput_rps"]),
        p50_ms=float(latency["p50"]),
        p99_ms=float(latency["p99"]),
        min_ms=float(latency["min"]),
        mean_batch=server.get("batch_size_mean"),
        cpu_busy=_cpu_busy(rate, cpu_count),
        batches=server.get("batches"),
        backend_s=backend_seconds({**server, "window_s": scraped_s}),
        backend_share=_backend_share(server.get("backend_cpu_s"), scraped_s, cpu_count),
        sends=rate.get("sends") or None,
        warmup_sends=rate.get("warmup_sends") or None,
        mean_ms=latency.get("mean"),
        stages_ms=server.get("stages_ms") or None,
        unsettled=opening_backlog(rate.get("latency_by_second_ms") or []) is not None,
        calls=rate.get("calls") or None,
    )


def _backend_share(cpu_s: float | None, window_s: float, cpu_count: int | None) -> float | None:
    if cpu_s is None or not cpu_count or not window_s:
        return None
    return round(float(cpu_s) / window_s / cpu_count, 4)


def _cpu_busy(rate: dict[str, Any], cpu_count: int | None) -> float | None:
    """Cores busy over the machine's: the process groups (``batchwire``, ``kafka``, ``redis``; their
    ``batchwire.<role>`` parts are already in ``batchwire``) and the load generator."""
    processes = rate.get("processes") or {}
    if not cpu_count or not processes:
        return None
    cores = sum(float(p.get("cores") or 0.0) for name, p in processes.items() if "." not in name)
    cores += float((rate.get("generator") or {}).get("cores") or 0.0)
    return round(cores / cpu_count, 4)
