"""Reads the service's Prometheus ``/metrics`` and turns two scrapes into per-window numbers.

Counters only ever grow, so the difference between a scrape at the window start and one at its
end is exactly what the service did while the load was measured, whatever ran before.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.parser import text_string_to_metric_families

BATCH_SIZE = "batchwire_batch_size"
BACKEND_ITEMS = "batchwire_backend_items_total"
FLUSHES = "batchwire_flushes_total"
WORKER_BUSY = "batchwire_worker_busy_seconds_total"
BACKEND_CPU = "batchwire_backend_cpu_seconds_total"
REDELIVERED = "batchwire_batches_redelivered_total"
BACKEND_TOKENS = "batchwire_backend_tokens_total"
#: Where a request's time goes inside the service: histograms whose sum over count is a mean per
#: request, and the worker's stages, summed over inputs (``batchwire_request_stage_seconds``).
STAGE_HISTOGRAMS = {
    "request_ms_mean": "batchwire_request_latency_seconds",
    "queue_wait_ms_mean": "batchwire_queue_wait_seconds",
}
REQUEST_STAGE = "batchwire_request_stage_seconds_total"
REQUEST_STAGE_INPUTS = "batchwire_request_stage_inputs_total"
WORKER_STAGES = {"sealed_to_started_ms_mean": "sealed_to_started", "call_ms_mean": "call"}

if TYPE_CHECKING:
    import aiohttp

LabelSet = frozenset[tuple[str, str]]
SampleKey = tuple[str, LabelSet]


def default_metrics_url(url: str) -> str:
    """The ``/metrics`` page at the same origin as an inference URL."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/metrics", "", ""))


def parse_samples(text: str) -> dict[SampleKey, float]:
    """Every sample of a text exposition, keyed by sample name and labels (``*_created`` dropped)."""
    samples: dict[SampleKey, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            samples[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
    return samples


@dataclass(slots=True)
class Scrape:
    """All endpoints' samples at one moment (``at`` on the loop clock, mid-request)."""

    at: float
    by_endpoint: dict[str, dict[SampleKey, float]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


async def scrape(session: aiohttp.ClientSession, urls: Sequence[str], timeout_s: float = 5.0) -> Scrape:
    """Scrapes every URL at once; a failing endpoint is recorded, not raised, so load keeps going."""
    # Here, not at the top: `validate-sim` reads saved runs through this module on a core install.
    import aiohttp

    loop = asyncio.get_running_loop()
    started = loop.time()

    async def one(url: str) -> tuple[str, dict[SampleKey, float] | None, str | None]:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                body = await response.text()
                if response.status != 200:
                    return url, None, f"HTTP {response.status}"
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            return url, None, f"{type(err).__name__}: {err}"
        try:
            return url, parse_samples(body), None
        except ValueError as err:
            return url, None, f"not Prometheus text: {err}"

    results = await asyncio.gather(*(one(url) for url in urls))
    snapshot = Scrape(at=(started + loop.time()) / 2)
    for url, samples, error in results:
        if samples is not None:
            snapshot.by_endpoint[url] = samples
        if error is not None:
            snapshot.errors[url] = error
    return snapshot


class BucketCount(TypedDict):
    le: str
    count: float


class ServerStats(TypedDict):
    """What the service reported about one measurement window (absent metrics are None)."""

    metrics_urls: list[str]
    window_s: float
    scrape_errors: dict[str, str]
    batches: float
    items: float
    """Inputs the workers' backends ran in the window: with collapsing and the cache, fewer than the
    requests."""
    batch_size_mean: float | None
    batch_size_buckets: list[BucketCount]
    flushes: dict[str, float]
    workers: int
    busy_fraction: float | None
    backend_cpu_s: float | None
    """CPU seconds of the backends' calling threads in the window (None: not exported)."""
    redelivered: float
    """Batches the workers took again and ran with care (each a sign of a crash or a hand-back)."""
    padding_share: NotRequired[float | None]
    """Of the tokens the hf backends ran, the share that was padding (None: no token counts exported)."""
    stages_ms: dict[str, float]
    """Mean time per request in each stage over the window (the gateway's accept to answer, accept to
    sealed, sealed to its call's start, the call), those the service exports and saw."""


def _delta(before: Scrape, after: Scrape) -> dict[tuple[str, SampleKey], float]:
    """Per-endpoint counter growth; a sample missing before counts from 0 (labels appear lazily)."""
    out: dict[tuple[str, SampleKey], float] = {}
    for url, samples in after.by_endpoint.items():
        if url not in before.by_endpoint:
            continue
        earlier = before.by_endpoint[url]
        for key, value in samples.items():
            out[(url, key)] = value - earlier.get(key, 0.0)
    return out


def _sum(delta: Mapping[tuple[str, SampleKey], float], name: str) -> float:
    return sum(value for (_, (sample, _labels)), value in delta.items() if sample == name)


def _has(delta: Mapping[tuple[str, SampleKey], float], name: str) -> bool:
    """Whether any endpoint exports ``name`` (an older service may not)."""
    return any(sample == name for (_, (sample, _labels)) in delta)


def _by_label(delta: Mapping[tuple[str, SampleKey], float], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (_, (sample, labels)), value in delta.items():
        if sample != name:
            continue
        key = dict(labels).get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


def _buckets(cumulative: Mapping[str, float]) -> list[BucketCount]:
    """Cumulative ``le`` buckets to the count in each (lower, le] range, in order."""
    ordered = sorted(cumulative.items(), key=lambda item: math.inf if item[0] == "+Inf" else float(item[0]))
    out: list[BucketCount] = []
    previous = 0.0
    for le, total in ordered:
        out.append(BucketCount(le=le, count=round(total - previous, 6)))
        previous = total
    return out


def _items(delta: Mapping[tuple[str, SampleKey], float]) -> float:
    """Inputs the backends ran: their own count where the workers export it, else the batches' sizes."""
    if _has(delta, BACKEND_ITEMS):
        return _sum(delta, BACKEND_ITEMS)
    return _sum(delta, f"{BATCH_SIZE}_sum")


def _workers(scrape_: Scrape) -> int:
    seen: set[tuple[str, str]] = set()
    for url, samples in scrape_.by_endpoint.items():
        for sample, labels in samples:
            if sample == WORKER_BUSY:
                seen.add((url, dict(labels).get("worker", "")))
    return len(seen)


def server_stats(before: Scrape, after: Scrape, urls: Iterable[str], workers_hint: int | None = None) -> ServerStats:
    """Batch sizes, flush reasons and GPU busy fraction over the window between two scrapes."""
    delta = _delta(before, after)
    window_s = max(after.at - before.at, 1e-9)
    batches = _sum(delta, f"{BATCH_SIZE}_count")
    workers = workers_hint if workers_hint else _workers(after)
    busy = _sum(delta, WORKER_BUSY)
    errors = dict(before.errors)
    errors.update(after.errors)
    return ServerStats(
        metrics_urls=list(urls),
        window_s=round(window_s, 6),
        scrape_errors=errors,
        batches=batches,
        items=_items(delta),
        batch_size_mean=_sum(delta, f"{BATCH_SIZE}_sum") / batches if batches else None,
        batch_size_buckets=_buckets(_by_label(delta, f"{BATCH_SIZE}_bucket", "le")),
        flushes={reason: count for reason, count in _by_label(delta, FLUSHES, "reason").items() if count},
        workers=workers,
        busy_fraction=busy / window_s / workers if workers else None,
        backend_cpu_s=_sum(delta, BACKEND_CPU) if _has(delta, BACKEND_CPU) else None,
        redelivered=_sum(delta, REDELIVERED),
        padding_share=_padding_share(delta),
        stages_ms=_stage_means(delta),
    )


def _padding_share(delta: Mapping[tuple[str, SampleKey], float]) -> float | None:
    tokens = _by_label(delta, BACKEND_TOKENS, "kind")
    total = tokens.get("input", 0.0) + tokens.get("padding", 0.0)
    return tokens.get("padding", 0.0) / total if total else None


def _stage_means(delta: Mapping[tuple[str, SampleKey], float]) -> dict[str, float]:
    """Each stage's mean per request in ms over the window, where it counted something: the
    histograms' sum over count, the worker's stages over the inputs they counted."""
    out: dict[str, float] = {}
    for key, name in STAGE_HISTOGRAMS.items():
        count = _sum(delta, f"{name}_count")
        if count:
            out[key] = round(_sum(delta, f"{name}_sum") * 1000.0 / count, 4)
    counted = REQUEST_STAGE_INPUTS if _has(delta, REQUEST_STAGE_INPUTS) else BACKEND_ITEMS  # else: an older service
    inputs = _sum(delta, counted)
    by_stage = _by_label(delta, REQUEST_STAGE, "stage")
    for key, stage in WORKER_STAGES.items():
        if inputs and stage in by_stage:
            out[key] = round(by_stage[stage] * 1000.0 / inputs, 4)
    return out


def backend_seconds(stats: Mapping[str, Any]) -> float | None:
    """The workers' seconds inside the backend over the window, from its busy share (None: not exported).
    Takes a ``ServerStats`` as read back from results.json too."""
    busy, workers, window_s = stats.get("busy_fraction"), stats.get("workers"), stats.get("window_s")
    if busy is None or not workers or not window_s:
        return None
    return float(busy) * float(window_s) * int(workers)


def backend_ms_per_call(stats: ServerStats) -> float | None:
    """The workers' mean time inside the backend per call over the window (None: no call, or not exported)."""
    busy_s, batches = backend_seconds(stats), stats["batches"]
    if busy_s is None or not batches:
        return None
    return busy_s * 1000.0 / batches
