"""Overload, end to end: ``batchwire up`` as a real process offered three times its capacity.

Capacity is made small enough for a Python load generator on a small machine to exceed it three
times over: 2 workers x 10 items per batch / 0.1 s per batch = 200 requests/s; the test offers
600/s for 20 s, open loop (sends follow the clock, not the answers). What must hold:

* every accepted request ends: 200, or 504 at its deadline, never later than deadline + slack;
* the excess is refused with 503 ``overloaded`` (queue depth) at once, and nothing else fails;
* the gateway's memory stays flat.

The figures are printed (``pytest -s``) so that they can be quoted.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil
import pytest
import uvloop

from tests.support.processes import embedded

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WORKERS = 2
MAX_BATCH = 5  # a small capacity, so that 3x of it leaves the in-test generator CPU to spare on 2 cores
SIM_LATENCY_MS = 100.0
CAPACITY_RPS = WORKERS * MAX_BATCH / (SIM_LATENCY_MS / 1000)  # 100/s
OFFERED_RPS = 3 * CAPACITY_RPS
DURATION_S = 20.0
MAX_QUEUE_DEPTH = 50  # at 100/s, about 0.5 s of waiting at most
TIMEOUT_MS = 5000
END_SLACK_S = 2.0  # an accepted request must end by its deadline plus this


@dataclass
class Outcome:
    status: int  # 0: no HTTP answer
    code: str | None
    latency_s: float
    lag_s: float  # how late the send was against its schedule


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MB)
    wall_s: float = 0.0


async def _one(session: aiohttp.ClientSession, url: str, index: int, scheduled: float, run: Run) -> None:
    started = time.monotonic()
    code: str | None = None
    try:
        async with session.post(url, json={"input": f"load {index}", "timeout_ms": TIMEOUT_MS}) as response:
            status = response.status
            doc = await response.json(content_type=None)
            if status != 200:
                code = doc["error"]["code"]
            elif doc["output"] != f"load {index}"[::-1]:
                code = "wrong_output"
    except (aiohttp.ClientError, TimeoutError) as err:
        status, code = 0, type(err).__name__
    run.outcomes.append(Outcome(status, code, time.monotonic() - started, started - scheduled))


async def _sample_rss(pid: int, run: Run, started: float, stop: asyncio.Event) -> None:
    process = psutil.Process(pid)
    while not stop.is_set():
        run.rss_mb.append((time.monotonic() - started, process.memory_info().rss / 2**20))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def _load(url: str, pid: int) -> Run:
    run = Run()
    total = int(OFFERED_RPS * DURATION_S)
    connector = aiohttp.TCPConnector(limit=2000, limit_per_host=2000)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_MS / 1000 + 30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        stop = asyncio.Event()
        started = time.monotonic()
        sampler = asyncio.create_task(_sample_rss(pid, run, started, stop))
        sends: list[asyncio.Task[None]] = []
        for index in range(total):
            scheduled = started + index / OFFERED_RPS
            delay = scheduled - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # the open-loop schedule itself, not a synchronisation
            sends.append(asyncio.create_task(_one(session, f"{url}/v1/inference", index, scheduled, run)))
        await asyncio.gather(*sends)
        run.wall_s = time.monotonic() - started
        stop.set()
        await sampler
    return run


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def test_three_times_capacity_is_refused_fast_and_accepted_work_ends(tmp_path: Path) -> None:
    proc, url = embedded(
        tmp_path,
        WORKERS,
        SIM_LATENCY_MS,
        "--max-batch",
        str(MAX_BATCH),
        "--max-queue-depth",
        str(MAX_QUEUE_DEPTH),
        "--log-level",
        "warning",
    )
    try:
        run = uvloop.run(_load(url, proc.pid))
        alive = proc.alive()
    finally:
        proc.stop()
    assert alive, f"the service died under load:\n{proc.tail()}"

    outcomes = run.outcomes
    by_status = Counter((o.status, o.code) for o in outcomes)
    accepted = [o for o in outcomes if o.status in (200, 504)]
    refused = [o for o in outcomes if o.status == 503]
    ok = [o for o in outcomes if o.status == 200]
    sent_rps = len(outcomes) / DURATION_S
    late_sends = _pct([o.lag_s for o in outcomes], 0.99)
    first = [mb for t, mb in run.rss_mb if t <= 5]
    last = [mb for t, mb in run.rss_mb if t >= run.rss_mb[-1][0] - 5]
    print(_report(run, by_status, accepted, ok, refused, late_sends, first, last))

    assert sent_rps >= 2.5 * CAPACITY_RPS, f"the generator offered only {sent_rps:.0f}/s"
    assert late_sends < 1.0, f"the generator fell behind its schedule (p99 {late_sends:.3f} s late)"
    unexpected = {
        key: n
        for key, n in by_status.items()
        if key not in {(200, None), (504, "deadline_exceeded"), (503, "overloaded")}
    }
    assert not unexpected, f"only 200, 504 at the deadline and 503 overloaded may happen, got {unexpected}"
    assert len(refused) >= 0.4 * len(outcomes), f"three times capacity must refuse most, refused {len(refused)}"
    assert len(ok) >= 0.8 * CAPACITY_RPS * DURATION_S * 0.5, f"too few answered: {len(ok)}"
    too_late = [o.latency_s for o in accepted if o.latency_s > TIMEOUT_MS / 1000 + END_SLACK_S]
    assert not too_late, f"{len(too_late)} accepted requests ended after deadline + {END_SLACK_S} s: {too_late[:5]}"
    assert statistics.median(o.latency_s for o in refused) < 0.05, "a refusal is answered within 50 ms"
    assert _pct([o.latency_s for o in refused], 0.99) < 0.25, "p99 of refusals (generous for a loaded 2-core box)"
    assert max(last) < max(first) * 1.5 + 20, f"RSS grew: first 5 s max {max(first):.1f} MB, last {max(last):.1f} MB"


def _ms(values: list[float], q: float) -> str:
    return f"{_pct(values, q) * 1000:.1f} ms"


def _report(
    run: Run,
    by_status: Counter[tuple[int, str | None]],
    accepted: list[Outcome],
    ok: list[Outcome],
    refused: list[Outcome],
    late_sends: float,
    first: list[float],
    last: list[float],
) -> str:
    ok_latency = [o.latency_s for o in ok]
    refused_latency = [o.latency_s for o in refused]
    statuses = ", ".join(
        f"{status} {code or ''}: {n}".replace(" :", ":") for (status, code), n in sorted(by_status.items(), key=str)
    )
    rss = " ".join(f"{t:.0f}s:{mb:.0f}" for t, mb in run.rss_mb[:: max(1, len(run.rss_mb) // 25)])
    return "\n".join(
        [
            f"\noverload: offered {OFFERED_RPS:.0f}/s for {DURATION_S:.0f} s, capacity {CAPACITY_RPS:.0f}/s, "
            f"{len(run.outcomes)} requests, sends late by p99 {late_sends * 1000:.1f} ms, run {run.wall_s:.1f} s",
            f"  by status: {statuses}",
            f"  accepted {len(accepted)} ({len(accepted) / DURATION_S:.0f}/s); 200 latency p50 {_ms(ok_latency, 0.5)} "
            f"p99 {_ms(ok_latency, 0.99)} max {_ms(ok_latency, 1.0)}",
            f"  refused {len(refused)}: latency p50 {_ms(refused_latency, 0.5)} p99 {_ms(refused_latency, 0.99)} "
            f"max {_ms(refused_latency, 1.0)}",
            f"  gateway RSS MB (s:MB): {rss}",
            f"  RSS max first 5 s {max(first):.1f} MB, last 5 s {max(last):.1f} MB",
        ]
    )
