"""The lone-request probe: requests sent one at a time, each to an idle service.

A lone request shows the path's own latency (every hop, every process wake-up) with no queueing
and no batching partner, which load at any rate mixes in. Each request is sent only after the
previous answer plus an idle gap, so no worker is still busy and every process on the path has
gone back to waiting, as it has for a user's first request after a quiet spell.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Sequence
from typing import NotRequired, TypedDict

from yarl import URL

from batchwire.bench.client import HttpClient, HttpProtocolError
from batchwire.bench.loadgen import CONNECTION, PROTOCOL, TIMEOUT, Expect, check_reverse
from batchwire.bench.schedule import InputFactory

DEFAULT_COUNT = 20
DEFAULT_GAP_MS = 300.0

#: Percentiles of a lone probe: few samples, so nearest rank (p99 of 20 is the slowest).
LONE_PERCENTILES: tuple[tuple[str, float], ...] = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0))


class LoneReport(TypedDict):
    """What the probe saw; latencies in ms from the send to the whole answer."""

    count: int
    gap_ms: float
    ok: int
    errors: dict[str, int]
    latency_ms: dict[str, float]
    samples_ms: list[float]
    """Each answered request's latency, in the order sent."""
    call_ms: NotRequired[float]
    """The workers' mean time inside the backend per call while the probe ran (where it is exported):
    a backend whose calls run longer from idle than profiled shows here, not in the path's cost."""
    stages_ms: NotRequired[dict[str, float]]
    """The service's mean time per request in each stage while the probe ran (``ServerStats.stages_ms``)."""


def nearest_rank_ms(samples_ms: Sequence[float]) -> dict[str, float]:
    """count, min, mean, p50, p90, p99 and max by nearest rank (the value at rank ceil(p/100 * n))."""
    ordered = sorted(samples_ms)
    count = len(ordered)
    out: dict[str, float] = {"count": float(count)}
    if not count:
        return out
    out["min"] = ordered[0]
    out["mean"] = round(sum(ordered) / count, 3)
    for key, percentile in LONE_PERCENTILES:
        rank = max(1, math.ceil(percentile / 100.0 * count))
        out[key] = ordered[rank - 1]
    out["max"] = ordered[-1]
    return out


async def lone_probe(
    client: HttpClient,
    urls: Sequence[str],
    inputs: InputFactory,
    *,
    count: int = DEFAULT_COUNT,
    gap_s: float = DEFAULT_GAP_MS / 1000.0,
    expect: Expect = "none",
) -> LoneReport:
    """Sends ``count`` requests in turn (round robin over ``urls``), each ``gap_s`` after the last answer.

    One unmeasured request goes first, so the measured ones find a connection already open, as a
    keep-alive client's requests do.
    """
    if not urls:
        raise ValueError("at least one target URL is needed")
    if count < 1 or gap_s < 0:
        raise ValueError(f"the probe needs count >= 1 and gap >= 0, got {count} and {gap_s}")
    targets = [URL(url) for url in urls]
    clock = time.perf_counter  # uvloop's loop clock reads whole milliseconds: too coarse for one request
    errors: Counter[str] = Counter()
    samples_ms: list[float] = []
    for url in targets:
        await _outcome(client, url, inputs, expect)
    for index in range(count):
        await asyncio.sleep(gap_s)  # the idle spell is what the probe measures after, not a synchronisation
        started = clock()
        kind = await _outcome(client, targets[index % len(targets)], inputs, expect)
        elapsed_ms = round((clock() - started) * 1000.0, 3)
        if kind is None:
            samples_ms.append(elapsed_ms)
        else:
            errors[kind] += 1
    return LoneReport(
        count=count,
        gap_ms=round(gap_s * 1000.0, 3),
        ok=len(samples_ms),
        errors=dict(sorted(errors.items())),
        latency_ms=nearest_rank_ms(samples_ms),
        samples_ms=samples_ms,
    )


async def _outcome(client: HttpClient, url: URL, inputs: InputFactory, expect: Expect) -> str | None:
    """One request: None for a good answer, else the error kind the load's tally would count."""
    text, body = inputs.next()
    try:
        status, payload = await client.post(url, body)
    except TimeoutError:  # before OSError, of which it is a subclass
        return TIMEOUT
    except OSError:
        return CONNECTION
    except HttpProtocolError:
        return PROTOCOL
    if status != 200:
        return f"http_{status}"
    return None if expect == "none" else check_reverse(payload, text)


def lone_line(lone: LoneReport, name: str = "lone") -> str:
    """The probe in one line of the run's table (``name``: lone, or warm for the probe with no gap)."""
    latency = lone["latency_ms"]

    def ms(key: str) -> str:
        value = latency.get(key)
        return "-" if value is None else f"{value:.1f}"

    line = (
        f"{name} requests ({lone['count']} one at a time, {lone['gap_ms']:g} ms idle before each): "
        f"p50 {ms('p50')}, p99 {ms('p99')}, min {ms('min')}, max {ms('max')} ms"
    )
    if lone["errors"]:
        line += ", errors " + " ".join(f"{kind}={n}" for kind, n in lone["errors"].items())
    return line
