"""``batchwire bench --mix``: several open-loop streams at once, each its own model, tier and rate.

A stream is ``[model/]tier:rate`` (``high:200``, ``b/normal:1000``); a mix is streams separated by
commas, all sent together over one window, each on its own Poisson schedule, and reported apart:
offered and answered rates, latency percentiles of its answers, its refusals (503/429) and how fast
they came. ``--mix`` given more than once runs each mix in turn against the same system: a stream
alone first, then the same stream beside a flood, is the comparison priority tiers are judged by.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from batchwire.bench.loadgen import REFUSED_STATUSES, OpenLoopSender, Tally, Window
from batchwire.bench.runner import LoadConfig, Target, make_client
from batchwire.bench.schedule import InputFactory, poisson_offsets
from batchwire.bench.streams import Stream

_START_DELAY_S = 0.2
"""Lead before the first send, so that every stream's schedule is ready when the clock starts."""


async def mix_run(
    load: LoadConfig,
    target: Target,
    mixes: Sequence[Sequence[Stream]],
    progress: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Runs each mix in turn (``load``'s warm-up, duration and pause); returns one report per mix."""
    client = make_client(load.client, load.concurrency_limit, load.timeout_s)
    rng = random.Random(load.seed)
    reports: list[dict[str, Any]] = []
    try:
        for index, mix in enumerate(mixes):
            if index:
                await asyncio.sleep(load.pause_s)
            label = ",".join(f"{s.name}:{s.rate_rps:g}" for s in mix)
            progress(f"  mix {label} for {load.warmup_s:g} s warm-up + {load.duration_s:g} s ...")
            senders = [
                OpenLoopSender(
                    client,
                    target.urls,
                    _inputs(load, rng, stream),
                    concurrency_limit=load.concurrency_limit,
                    expect=load.expect,
                    drain_timeout_s=load.timeout_s + 1.0,
                )
                for stream in mix
            ]
            span_s = load.warmup_s + load.duration_s
            schedules = [poisson_offsets(s.rate_rps, span_s, rng) for s in mix]
            t0 = asyncio.get_running_loop().time() + _START_DELAY_S
            window = Window(t0 + load.warmup_s, t0 + span_s)
            tallies = await asyncio.gather(*(s.run(t0, o, window) for s, o in zip(senders, schedules, strict=True)))
            streams = [stream_report(s, t, load.duration_s) for s, t in zip(mix, tallies, strict=True)]
            reports.append({"mix": label, "streams": streams})
            for line in mix_table(streams):
                progress("    " + line)
    finally:
        await client.close()
    return reports


def _inputs(load: LoadConfig, rng: random.Random, stream: Stream) -> InputFactory:
    extra = {"priority": stream.tier}
    if stream.model is not None:
        extra["model"] = stream.model
    nonce = secrets.token_hex(2) + stream.name.replace("/", "")
    return InputFactory(load.input_size, random.Random(rng.random()), load.payload_field, nonce, extra)


def stream_report(stream: Stream, tally: Tally, duration_s: float) -> dict[str, Any]:
    """One stream's figures over the window."""
    refused = sum(n for kind, n in tally.errors.items() if _status_of(kind) in REFUSED_STATUSES)
    latency = tally.latency.summary_ms()
    return {
        "stream": stream.name,
        "offered_rps": round(stream.rate_rps, 1),
        "scheduled_rps": round(tally.scheduled / duration_s, 1),
        "sent_rps": round(tally.sent / duration_s, 1),
        "sent": tally.sent,
        "ok": tally.ok,
        "answered_rps": round(tally.answers_in_window / duration_s, 1),
        "p50_ms": latency.get("p50", 0.0),
        "p99_ms": latency.get("p99", 0.0),
        "refused": refused,
        "refused_p99_ms": tally.refused_from_send.summary_ms().get("p99", 0.0),
        "other_errors": {k: n for k, n in tally.errors.items() if _status_of(k) not in REFUSED_STATUSES},
        "lag_p99_ms": tally.lag.summary_ms().get("p99", 0.0),
    }


def _status_of(kind: str) -> int | None:
    return int(kind[5:]) if kind.startswith("http_") and kind[5:].isdigit() else None


def mix_table(streams: Sequence[dict[str, Any]]) -> list[str]:
    """The streams of one mix as aligned text lines."""
    header = (
        f"{'stream':<14}{'offered/s':>10}{'sent/s':>9}{'answers/s':>10}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'refused':>9}{'ref p99 ms':>11}{'lag p99':>9}  other errors"
    )
    lines = [header]
    for s in streams:
        lines.append(
            f"{s['stream']:<14}{s['offered_rps']:>10g}{s['sent_rps']:>9g}{s['answered_rps']:>10g}"
            f"{s['p50_ms']:>9.1f}{s['p99_ms']:>9.1f}{s['refused']:>9}{s['refused_p99_ms']:>11.2f}"
            f"{s['lag_p99_ms']:>9.1f}  {s['other_errors'] or '-'}"
        )
    return lines


def write_mix(out: Path, reports: Sequence[dict[str, Any]]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "mix.json"
    path.write_text(json.dumps({"mixes": list(reports)}, indent=2) + "\n")
    return path
