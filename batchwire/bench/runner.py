"""One run: every offered rate in turn against one target, over one connection pool.

The pool (at most one connection per outstanding request) is kept alive across rates, so
connection setup is paid once and does not show up as latency at a rate boundary.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from batchwire.bench.client import AiohttpClient, ClientKind, HttpClient
from batchwire.bench.kafka_log import KafkaLogs
from batchwire.bench.lengths import LengthInputs, Lengths
from batchwire.bench.loadgen import TIMEOUT, Expect, OpenLoopSender
from batchwire.bench.lone import DEFAULT_GAP_MS, lone_line, lone_probe
from batchwire.bench.measure import Probes, measure_rate
from batchwire.bench.procstats import CpuSampler
from batchwire.bench.prom import backend_ms_per_call, server_stats
from batchwire.bench.rawhttp import RawHttpClient
from batchwire.bench.results import RateReport, RunReport
from batchwire.bench.schedule import InputFactory
from batchwire.bench.zipf import Zipf, ZipfInputs


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """How load is offered; the same for every run of one bench invocation."""

    rates_rps: tuple[float, ...]
    duration_s: float = 10.0
    warmup_s: float = 2.0
    concurrency_limit: int = 1000
    timeout_s: float = 30.0
    input_size: int = 32
    seed: int = 1
    zipf: Zipf | None = None
    """Inputs repeat with Zipf popularity (``batchwire.bench.zipf``); None: every input unique."""
    lengths: Lengths | None = None
    """Inputs of log-normal lengths in words (``batchwire.bench.lengths``); None: ``input_size`` characters."""
    expect: Expect = "none"
    payload_field: str = "input"
    pause_s: float = 1.0
    client: ClientKind = "aiohttp"
    lone_count: int = 0
    """Requests of the lone-request probe, sent before the first rate (0: no probe)."""
    lone_gap_s: float = DEFAULT_GAP_MS / 1000.0
    warm_count: int = 0
    """Requests of the warm-path probe (``lone_probe`` with no gap), sent after the lone one (0: none)."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where the load goes and where to look while it runs."""

    urls: tuple[str, ...]
    metrics_urls: tuple[str, ...] = ()
    pid_groups: Mapping[str, Sequence[int]] = field(default_factory=dict)
    workers_hint: int | None = None
    batch_log: Path | None = None
    """The workers' batch journal, where the bench started them (None: the calls are not recorded)."""
    redis_url: str | None = None
    """The deployment's Redis (None: its commands are not counted)."""


def make_client(kind: ClientKind, limit: int, timeout_s: float) -> HttpClient:
    """The sender's HTTP client of the kind asked for (``limit``: most connections, aiohttp only)."""
    if kind == "raw":
        return RawHttpClient(timeout_s)
    return AiohttpClient(limit, timeout_s)


def event_loop_name() -> str:
    loop = asyncio.get_running_loop()
    return f"{type(loop).__module__}.{type(loop).__name__}"


async def bench_run(
    load: LoadConfig,
    target: Target,
    run: RunReport,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> RunReport:
    """Measures every rate, appending each to ``run["rates"]`` as it completes (so an interrupted run
    keeps what it measured), then runs the lone-request probe (into ``run["lone"]``, and the warm-path one into
    ``run["warm"]``) once the service is idle again."""
    rng = random.Random(load.seed)
    nonce = secrets.token_hex(2)
    inputs: InputFactory
    if load.zipf is not None:
        inputs = ZipfInputs(load.zipf, load.input_size, rng, field=load.payload_field, nonce=nonce)
    elif load.lengths is not None:
        inputs = LengthInputs(load.lengths, rng, field=load.payload_field, nonce=nonce)
    else:
        inputs = InputFactory(load.input_size, rng, field=load.payload_field, nonce=nonce)
    client = make_client(load.client, load.concurrency_limit, load.timeout_s)
    metrics_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=16)) if target.metrics_urls else None
    try:
        sender = OpenLoopSender(
            client,
            target.urls,
            inputs,
            concurrency_limit=load.concurrency_limit,
            expect=load.expect,
            drain_timeout_s=load.timeout_s + 1.0,
        )
        probes = Probes(
            cpu=CpuSampler(target.pid_groups),
            metrics_session=metrics_session,
            metrics_urls=list(target.metrics_urls),
            workers_hint=target.workers_hint,
            batch_log=target.batch_log,
            redis_url=target.redis_url,
            kafka_logs=KafkaLogs.of_brokers(target.pid_groups.get("kafka", ())),
        )
        loop_name = event_loop_name()
        for index, rate in enumerate(load.rates_rps):
            if index:
                await asyncio.sleep(load.pause_s)
            progress(f"  {rate:g} req/s for {load.warmup_s:g} s warm-up + {load.duration_s:g} s ...")
            report = await measure_rate(
                sender,
                probes,
                rate_rps=rate,
                duration_s=load.duration_s,
                warmup_s=load.warmup_s,
                rng=rng,
                event_loop=loop_name,
                client=load.client,
            )
            run["rates"].append(report)
            progress(summary_line(report))
        if load.lone_count or load.warm_count:
            await _probes_after_load(run, load, target, client, probes, progress)
    finally:
        await client.close()
        if metrics_session is not None:
            await metrics_session.close()
    return run


async def _probes_after_load(
    run: RunReport,
    load: LoadConfig,
    target: Target,
    client: HttpClient,
    probes: Probes,
    progress: Callable[[str], None],
) -> None:
    """The lone-request probe, then the warm-path one, once the service is idle again; each records the
    backend's own time per call while it ran, and the service's stages, where the service exports them."""
    # After the load: every answer is in, and the consumer groups have long settled (a probe
    # right after start-up can meet the workers' first rebalance, which hands its batch back).
    await asyncio.sleep(load.pause_s)
    # Inputs of their own, so the rates' seeded schedule is the same with or without the probe.
    inputs = InputFactory(
        load.input_size, random.Random(load.seed), field=load.payload_field, nonce=secrets.token_hex(2) + "L"
    )
    for key, count, gap_s in (("lone", load.lone_count, load.lone_gap_s), ("warm", load.warm_count, 0.0)):
        if not count:
            continue
        progress(f"  {key} requests: {count}, one at a time, {1000 * gap_s:g} ms idle before each ...")
        before = await probes.scrape()
        probe = await lone_probe(client, target.urls, inputs, count=count, gap_s=gap_s, expect=load.expect)
        if before is not None and (after := await probes.scrape()) is not None:
            stats = server_stats(before, after, probes.metrics_urls, probes.workers_hint)
            if (call_ms := backend_ms_per_call(stats)) is not None:
                probe["call_ms"] = round(call_ms, 3)
            if stats["stages_ms"]:
                probe["stages_ms"] = stats["stages_ms"]
        progress("    " + lone_line(probe, key))
        if key == "lone":
            run["lone"] = probe
        else:
            run["warm"] = probe


def summary_line(rate: RateReport) -> str:
    latency = rate["latency_ms"]
    server = rate["server"]
    items = f", backend items/request {server['items'] / rate['scheduled']:.3f}" if server and rate["scheduled"] else ""
    line = (
        f"    ok {rate['ok']}/{rate['scheduled']}, errors {rate['error_total']}{items}, "
        f"{rate['throughput_rps']:.1f} answers/s, p50 {latency.get('p50', 0):.1f} ms, "
        f"p99 {latency.get('p99', 0):.1f} ms, lag p99 {rate['lag_ms'].get('p99', 0):.2f} ms"
    )
    refused = rate["refused_ms"]
    if refused.get("count"):
        line += f", refused {refused['count']:.0f} (refused p99 {refused['p99']:.2f} ms)"
    after = rate["after_504"]
    if after["answered"]:
        line += f", 504 {after['answered']} (computed after: {after['computed']})"
    timeouts = rate["errors"].get(TIMEOUT, 0)
    if timeouts:
        line += f", client timeouts {timeouts}"
    commands = rate.get("redis_commands")
    if commands is not None and commands["per_request"] is not None:
        line += f", Redis commands/request {commands['per_request']:.2f}"
    memory = rate.get("redis_bytes_per_request")
    if memory is not None:
        line += f", Redis bytes/request {memory:,.0f}"
    kafka = rate.get("kafka_writes")
    if kafka is not None and kafka["bytes_per_request"] is not None:
        line += f", Kafka bytes/request {kafka['bytes_per_request']:,.0f} ({kafka['records_per_request']:.2f} records)"
    return line
