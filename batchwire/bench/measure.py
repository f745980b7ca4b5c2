"""One offered rate, measured: load from the sender, plus CPU and ``/metrics`` at the window bounds.

Sampling the server and the CPU counters exactly when the measurement window opens and closes
(while load keeps flowing) makes every per-window ratio (batch size, busy fraction, CPU per
request) refer to the same interval as the throughput figure.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from batchwire.bench import calls as call_record
from batchwire.bench import sends
from batchwire.bench.kafka_log import KafkaLogs, writes
from batchwire.bench.late import COMPLETED, UNENDED, read_back
from batchwire.bench.loadgen import TIMEOUT, OpenLoopSender, Tally, Window
from batchwire.bench.procstats import CpuSampler, CpuSnapshot, GroupStats, group_stats
from batchwire.bench.prom import Scrape, ServerStats, scrape, server_stats
from batchwire.bench.redis_info import bytes_per_request, counts, per_request
from batchwire.bench.results import After504, GeneratorStats, RateReport
from batchwire.bench.schedule import poisson_offsets
from batchwire.bench.settle import means_by_second, opening_backlog
from transport.redis.pools import redacted

#: Time between computing the schedule and its first send, so the first sends are not late.
START_LEAD_S = 0.05
#: Above this p99 lag the generator, not the server, may be what the latencies show.
LAG_WARN_MS = 5.0
#: A generator using more than this share of one core is close to falling behind.
CORES_WARN = 0.8


@dataclass(slots=True)
class Probes:
    """Where to look during a window: the ``/metrics`` pages and the processes whose CPU counts."""

    cpu: CpuSampler
    metrics_session: aiohttp.ClientSession | None = None
    metrics_urls: list[str] = field(default_factory=list)
    workers_hint: int | None = None
    batch_log: Path | None = None
    """The workers' batch journal (``--batch-log``): each rate's calls are read from it."""
    redis_url: str | None = None
    """The deployment's Redis, whose command counts are read at the window bounds (None: not read)."""
    kafka_logs: KafkaLogs | None = None
    """The brokers' logs, whose appends are read at the window bounds (None: not read)."""

    async def redis_counts(self) -> tuple[dict[str, int], int] | None:
        """The Redis's command counts and ``used_memory`` now (None: not read, or unreadable)."""
        return None if self.redis_url is None else await counts(self.redis_url)

    async def scrape(self) -> Scrape | None:
        """The ``/metrics`` pages now (None: the service exports none)."""
        if self.metrics_session is None or not self.metrics_urls:
            return None
        return await scrape(self.metrics_session, self.metrics_urls)

    async def snapshot(self) -> tuple[float, CpuSnapshot, Scrape | None]:
        at = asyncio.get_running_loop().time()
        cpu = self.cpu.sample()
        return at, cpu, await self.scrape()


async def _sleep_until(when: float) -> None:
    delay = when - asyncio.get_running_loop().time()
    if delay > 0:
        await asyncio.sleep(delay)


async def measure_rate(
    sender: OpenLoopSender,
    probes: Probes,
    *,
    rate_rps: float,
    duration_s: float,
    warmup_s: float,
    rng: random.Random,
    event_loop: str,
    client: str,
) -> RateReport:
    """Offers ``rate_rps`` for ``warmup_s + duration_s`` and reports the last ``duration_s``."""
    loop = asyncio.get_running_loop()
    offsets = poisson_offsets(rate_rps, warmup_s + duration_s, rng)
    t0 = loop.time() + START_LEAD_S
    window = Window(t0 + warmup_s, t0 + warmup_s + duration_s)
    send = asyncio.create_task(sender.run(t0, offsets, window))
    try:
        await _sleep_until(window.start)
        clock_start = time.monotonic()  # the batch journal's clock
        at_start, cpu_start, scrape_start = await probes.snapshot()
        redis_start = await probes.redis_counts()
        if probes.kafka_logs is not None:
            await asyncio.to_thread(probes.kafka_logs.advance)  # off the sender's loop: it reads files
        await _sleep_until(window.end)
        clock_end = time.monotonic()
        at_end, cpu_end, scrape_end = await probes.snapshot()
        redis_end = await probes.redis_counts()
        kafka_grown = None if probes.kafka_logs is None else await asyncio.to_thread(probes.kafka_logs.advance)
        tally = await send
    finally:
        if not send.done():
            send.cancel()
            await asyncio.gather(send, return_exceptions=True)
    # After the drain: every answer is in, so a task answered 504 has had its chance to be computed.
    statuses = await read_back(tally.answered_504)
    cpu_window_s = at_end - at_start
    server = None
    if scrape_start is not None and scrape_end is not None:
        server = server_stats(scrape_start, scrape_end, probes.metrics_urls, probes.workers_hint)
    generator_cpu_s = cpu_end.generator_s - cpu_start.generator_s
    generator = GeneratorStats(
        cpu_s=round(generator_cpu_s, 4),
        cores=round(generator_cpu_s / cpu_window_s, 4) if cpu_window_s > 0 else 0.0,
        us_per_request=round(generator_cpu_s * 1e6 / tally.scheduled, 1) if tally.scheduled else None,
        max_outstanding=tally.max_outstanding,
        event_loop=event_loop,
        client=client,
    )
    report = _report(
        tally,
        rate_rps=rate_rps,
        duration_s=duration_s,
        warmup_s=warmup_s,
        generator=generator,
        server=server,
        processes=group_stats(cpu_start, cpu_end, cpu_window_s, tally.answers_in_window),
        after_504=_after_504(tally, statuses),
        calls=call_record.read(probes.batch_log, clock_start, clock_end) if probes.batch_log else [],
    )
    if redis_start is not None and redis_end is not None:
        (calls_start, memory_start), (calls_end, memory_end) = redis_start, redis_end
        report["redis_commands"] = per_request(calls_start, calls_end, tally.answers_in_window)
        report["redis_bytes_per_request"] = bytes_per_request(memory_start, memory_end, tally.answers_in_window)
    elif probes.redis_url is not None:
        report["notes"].append(
            f"Redis at {redacted(probes.redis_url)} did not answer INFO at the window's bounds: its commands and "
            "memory per request are not counted (check --redis-url)"
        )
    if kafka_grown is not None:
        report["kafka_writes"] = writes(kafka_grown, tally.answers_in_window)
    return report


def _after_504(tally: Tally, statuses: dict[str, int]) -> After504:
    computed = statuses.get(COMPLETED, 0)
    everything = tally.ok + computed
    return After504(
        answered=len(tally.answered_504) + tally.answered_504_without_id,
        without_task_id=tally.answered_504_without_id,
        statuses=dict(sorted(statuses.items())),
        computed=computed,
        share_of_computed=round(computed / everything, 5) if everything else None,
    )


def _report(
    tally: Tally,
    *,
    rate_rps: float,
    duration_s: float,
    warmup_s: float,
    generator: GeneratorStats,
    server: ServerStats | None,
    processes: dict[str, GroupStats],
    after_504: After504,
    calls: Sequence[call_record.Call],
) -> RateReport:
    lag = tally.lag.summary_ms()
    by_second = means_by_second(tally.second_sums_s, tally.second_counts)
    notes = _notes(tally, lag, generator, server, after_504, by_second, warmup_s)
    errors = dict(sorted(tally.errors.items()))
    return RateReport(
        offered_rps=rate_rps,
        window_s=duration_s,
        warmup_s=warmup_s,
        scheduled=tally.scheduled,
        sent=tally.sent,
        ok=tally.ok,
        errors=errors,
        error_total=sum(errors.values()),
        unfinished=tally.unfinished,
        warmup_sent=tally.warmup_sent,
        answers_in_window=tally.answers_in_window,
        throughput_rps=round(tally.answers_in_window / duration_s, 3) if duration_s > 0 else 0.0,
        drained_answers=tally.drained_answers,
        drain_s=round(tally.last_answer_after_window_s, 4),
        latency_ms=tally.latency.summary_ms(),
        latency_all_ms=tally.latency_all.summary_ms(),
        latency_hdr=tally.latency.encode(),
        latency_by_second_ms=by_second,
        lag_ms=lag,
        sends=sends.encode(tally.sends),
        warmup_sends=sends.encode(tally.warmup_sends),
        calls=call_record.encode(calls),
        refused_ms=tally.refused.summary_ms(),
        refused_from_send_ms=tally.refused_from_send.summary_ms(),
        after_504=after_504,
        generator=generator,
        server=server,
        processes=processes,
        notes=notes,
    )


def _notes(
    tally: Tally,
    lag: dict[str, float],
    generator: GeneratorStats,
    server: ServerStats | None,
    after_504: After504,
    by_second_ms: list[float | None],
    warmup_s: float,
) -> list[str]:
    """What a reader of the rate's figures should know before trusting them."""
    notes: list[str] = []
    backlog = opening_backlog(by_second_ms)
    if backlog is not None:
        notes.append(
            f"the window opened on a backlog: latency averaged {backlog.opening_ms:.0f} ms in its first seconds "
            f"against {backlog.settled_ms:.0f} ms in its second half; the service had not settled after the "
            f"{warmup_s:g} s warm-up (near capacity a start-up backlog drains slowly): lengthen --warmup"
        )
    if lag.get("p99", 0.0) > LAG_WARN_MS:
        notes.append(
            f"generator lag p99 {lag['p99']:.1f} ms > {LAG_WARN_MS} ms: the client fell behind its schedule; "
            "latencies include that lag (lower the rate, or run the generator on another machine)"
        )
    if generator["cores"] > CORES_WARN:
        notes.append(f"generator used {generator['cores']:.2f} cores: it is near saturation")
    if tally.unfinished:
        notes.append(f"{tally.unfinished} requests were still open after the drain timeout and were cancelled")
    if tally.first_exception is not None:
        notes.append(f"unexpected client exception (counted as client_exception): {tally.first_exception}")
    if tally.errors[TIMEOUT]:
        notes.append(
            f"{tally.errors[TIMEOUT]} requests timed out in the client with no answer; where the server has a "
            "deadline, a --timeout above it lets its 504 arrive and be counted"
        )
    if after_504["without_task_id"]:
        notes.append(f"{after_504['without_task_id']} 504 answers carried no error.task_id and were not read back")
    unended = {k: v for k, v in after_504["statuses"].items() if k in UNENDED}
    if unended:
        pending = " ".join(f"{k}={v}" for k, v in unended.items())
        notes.append(f"tasks answered 504 had not ended when read back ({pending}); they may still be computed")
    if tally.latency.clamped:
        notes.append(f"{tally.latency.clamped} latencies above 120 s were recorded as 120 s")
    if server is not None and server["scrape_errors"]:
        failed = "; ".join(f"{url}: {error}" for url, error in server["scrape_errors"].items())
        notes.append(f"metrics scrape failed ({failed}); give --metrics-url, or --no-metrics for a server without them")
    return notes
