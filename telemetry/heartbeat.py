"""The figures a heartbeat carries, read from this process's own Prometheus registry.

A heartbeat shows what ``/metrics`` shows, over the last beat: the same counters and histograms, read
in process (no scrape, no text parsing), and each figure the difference between two reads. So the
fleet view and a Prometheus graph of the same process agree, and a role records nothing twice.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry

from telemetry import metrics

Labels = frozenset[tuple[str, str]]
Samples = dict[tuple[str, Labels], float]

REFUSED = ("429", "503", "504")
"""The statuses a heartbeat counts as refusals: rate-limited, overloaded or unavailable, deadline."""
RAN_OUTCOMES = ("ok", "partial")
"""The outcomes of ``batchwire_worker_batches_total`` that ran a call (``dead_lettered`` ran none)."""
_OPERATIONAL = ("/metrics", "/healthz", "/readyz", "/v1/fleet", "/dashboard", "/dashboard/events")


def _read(registry: CollectorRegistry) -> Samples:
    samples: Samples = {}
    for family in registry.collect():
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


class Window:
    """Two reads of the registry, ``interval_s`` apart: counters as rates, gauges as they are now."""

    def __init__(self, now: Samples, before: Samples, interval_s: float) -> None:
        self.now = now
        self.before = before
        self.interval_s = max(interval_s, 1e-9)

    def _matching(self, name: str, labels: Mapping[str, str]) -> Iterable[tuple[Labels, float]]:
        wanted = set(labels.items())
        for (sample, sample_labels), value in self.now.items():
            if sample == name and wanted <= sample_labels:
                yield sample_labels, value

    def increase(self, name: str, **labels: str) -> float:
        """How much the counters (or histogram sums) named ``name`` and matching ``labels`` grew."""
        return sum(value - self.before.get((name, found), 0.0) for found, value in self._matching(name, labels))

    def rate(self, name: str, **labels: str) -> float:
        return self.increase(name, **labels) / self.interval_s

    def level(self, name: str, **labels: str) -> float:
        """The gauges named ``name`` and matching ``labels``, summed."""
        return sum(value for _, value in self._matching(name, labels))

    def change(self, name: str, **labels: str) -> float:
        """How much the gauges named ``name`` and matching ``labels`` moved over the window, summed."""
        return sum(value - self.before.get((name, found), 0.0) for found, value in self._matching(name, labels))

    def by(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """The growth of ``name`` per value of ``label``, per second; values that did not grow left out."""
        rates: dict[str, float] = {}
        for found, value in self._matching(name, labels):
            key = dict(found).get(label)
            grew = value - self.before.get((name, found), 0.0)
            if key is not None and grew > 0:
                rates[key] = rates.get(key, 0.0) + grew / self.interval_s
        return rates

    def quantile(self, histogram: str, q: float, **labels: str) -> float | None:
        """The ``q`` quantile of what ``histogram`` observed in the window, interpolated within its bucket
        as Prometheus's ``histogram_quantile`` does; None when it observed nothing."""
        grown: dict[float, float] = {}
        for found, value in self._matching(f"{histogram}_bucket", labels):
            bound = float(dict(found)["le"])
            grown[bound] = grown.get(bound, 0.0) + value - self.before.get((f"{histogram}_bucket", found), 0.0)
        bounds = sorted(grown)
        if not bounds or grown[bounds[-1]] <= 0:
            return None
        rank = q * grown[bounds[-1]]
        lower, below = 0.0, 0.0
        for bound in bounds:
            if grown[bound] >= rank:
                if math.isinf(bound):
                    return lower  # past the last finite bucket: its bound, as histogram_quantile answers
                share = (rank - below) / (grown[bound] - below) if grown[bound] > below else 1.0
                return lower + (bound - lower) * share
            lower, below = bound, grown[bound]
        return lower


class Reader:
    """Reads the registry once per beat and hands out the window since the last read."""

    def __init__(
        self, registry: CollectorRegistry = metrics.REGISTRY, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._registry = registry
        self._clock = clock
        self._last = _read(registry)
        self._last_at = clock()

    def levels(self) -> Window:
        """The registry now as a window of no length: its gauges, no counter grown. The window that
        ``advance`` hands out next still starts at the last ``advance``."""
        now = _read(self._registry)
        return Window(now, now, 0.0)

    def advance(self) -> Window:
        now, at = _read(self._registry), self._clock()
        window = Window(now, self._last, at - self._last_at)
        self._last, self._last_at = now, at
        return window


Figures = dict[str, float]


def gateway_figures(window: Window, models: Iterable[str]) -> tuple[Figures, dict[str, Figures], dict[str, Figures]]:
    """A gateway's figures, its refusals by status, and its figures per model."""
    served = sum(rate for route, rate in window.by("batchwire_requests_total", "route").items() if _api(route))
    figures: Figures = {
        "requests_per_s": served,
        "answered_per_s": window.rate("batchwire_request_latency_seconds_count"),
        "inflight": window.level("batchwire_inflight_requests"),
    }
    _put_latency(figures, window)
    refusals: Figures = {}
    for status in REFUSED:  # an unready gateway's 503s to its probes refuse no request
        rates = window.by("batchwire_requests_total", "route", status=status)
        if rate := sum(value for route, value in rates.items() if _api(route)):
            refusals[status] = rate
    figures["refused_per_s"] = sum(refusals.values())
    per_model: dict[str, Figures] = {}
    for model in models:
        row: Figures = {"answered_per_s": window.rate("batchwire_request_latency_seconds_count", model=model)}
        row["refused_per_s"] = window.rate("batchwire_tier_submits_total", model=model, outcome="refused")
        _put_latency(row, window, model=model)
        per_model[model] = row
    return figures, {"refusals_per_s": refusals}, per_model


def _api(route: str) -> bool:
    """A route of the API: not a probe, a scrape or a fleet view, nor an unknown path (a scanner's 404s)."""
    return route != "unmatched" and not route.startswith(_OPERATIONAL)


def _put_latency(figures: Figures, window: Window, **labels: str) -> None:
    for name, q in (("p50_ms", 0.5), ("p99_ms", 0.99)):
        seconds = window.quantile("batchwire_request_latency_seconds", q, **labels)
        if seconds is not None:
            figures[name] = seconds * 1000


def batcher_figures(window: Window, models: Iterable[str]) -> tuple[Figures, dict[str, Figures], dict[str, Figures]]:
    """A batcher's figures, its flushes by reason, and its figures per model."""
    figures = _batches(window)
    figures["queue_depth"] = window.level("batchwire_batcher_pending")
    per_model: dict[str, Figures] = {}
    for model in models:
        row = _batches(window, model=model)
        row["queue_depth"] = window.level("batchwire_batcher_pending", model=model)
        per_model[model] = row
    return figures, {"flushes_per_s": window.by("batchwire_flushes_total", "reason")}, per_model


def _batches(window: Window, **labels: str) -> Figures:
    count = window.increase("batchwire_batch_size_count", **labels)
    figures: Figures = {"batches_per_s": count / window.interval_s}
    if count > 0:
        figures["mean_batch_size"] = window.increase("batchwire_batch_size_sum", **labels) / count
    return figures


def worker_figures(window: Window, worker_id: str) -> Figures:
    """A worker's batches, their mean size, and the share of the window it spent inside the backend."""
    # A dead letter is counted there too, but runs nothing: it is no batch of the worker's rate or mean size.
    batches = sum(
        window.increase("batchwire_worker_batches_total", worker=worker_id, outcome=outcome) for outcome in RAN_OUTCOMES
    )
    # A call counts in the busy seconds when it ends; the time of the one running counts as it runs.
    busy_s = window.increase("batchwire_worker_busy_seconds_total", worker=worker_id) + window.change(
        "batchwire_worker_call_running_seconds", worker=worker_id
    )
    figures: Figures = {
        "batches_per_s": batches / window.interval_s,
        "busy_fraction": min(1.0, max(0.0, busy_s / window.interval_s)),
    }
    if batches > 0:
        figures["mean_batch_size"] = window.increase("batchwire_worker_items_total", worker=worker_id) / batches
    return figures
