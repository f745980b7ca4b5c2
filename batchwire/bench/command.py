"""What ``batchwire bench`` does once its flags are parsed: one run per policy, then the table,
results.json and the plots. Kept apart from ``cli`` so that parsing flags loads nothing heavy.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import random
import resource
import shlex
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import uvloop
from yarl import URL

from batchwire.bench import results
from batchwire.bench.cli import DEFAULT_URL
from batchwire.bench.lengths import Lengths
from batchwire.bench.loadgen import BAD_BODY, WRONG_ANSWER, Expect
from batchwire.bench.mix import mix_run, mix_table, write_mix
from batchwire.bench.own_stack import OwnStack
from batchwire.bench.procstats import discover_infra_pids, read_env_file
from batchwire.bench.prom import default_metrics_url
from batchwire.bench.report import compare_table, run_table
from batchwire.bench.results import Results, RunReport
from batchwire.bench.runner import LoadConfig, Target, bench_run
from batchwire.bench.schedule import InputFactory
from batchwire.bench.stack import Stack
from batchwire.bench.streams import mix_models
from batchwire.bench.sut import SutError, SutSpec, SystemUnderTest, wait_first_answer
from batchwire.bench.zipf import Zipf
from batchwire.settings import REDIS_SCHEMES
from transport.redis.pools import redacted

#: Where ``batchwire stack up`` keeps stack.env and the pid files (its default ``--state-dir``).
STACK_DIR = Path(".batchwire")


MAX_SENDS_PER_RATE = 10_000_000
"""The most sends one rate (or one mix) may schedule over its warm-up and window. Each send's time is
drawn before the first send and each answer is kept, so a longer schedule fills the generator's memory
before anything is sent, where neither Ctrl-C nor SIGTERM reaches it (no await in the drawing)."""


class UsageError(Exception):
    """A flag combination that cannot work; the message says which flag to change."""


def execute(args: argparse.Namespace) -> int:
    """Runs a parsed ``batchwire bench`` command line; returns the exit status."""
    try:
        if args.compare:
            return _compare(args.compare[0], args.compare[1])
        load = _load_config(args)
        arms = [(policy, budget) for policy in _policies(args) for budget in _budgets(args)]
        loop_factory = _loop_factory(args.loop)
        _make_out(args.out)
    except (UsageError, results.ResultsError) as err:
        print(f"batchwire bench: {err}", file=sys.stderr)
        return 2
    _raise_open_files_limit(load.concurrency_limit + 256)
    started = dt.datetime.now(dt.UTC)
    runs: list[RunReport] = []
    outcomes: list[Outcome] = []
    status = 0
    restore_sigterm = _sigterm_as_sigint()
    own = _own_stack(args)
    stack = Stack(own=own) if args.start == "kafka" else None
    try:
        if stack is not None:
            stack.note_state()
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            for policy, budget in arms:
                label = _label(args) if budget is None else f"{_label(args)} {_budget_name(budget)}"
                report = RunReport(label=label, policy=policy, sut=None, rates=[])
                runs.append(report)
                if args.start:
                    outcomes += _run_started(runner, args, load, policy, budget, report, stack)
                else:
                    outcomes += runner.run(_measure(args, load, _given_target(args), report))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("batchwire bench: interrupted; writing what was measured", file=sys.stderr)
        status = 130
    except SutError as err:
        print(f"batchwire bench: {err}", file=sys.stderr)
        status = 1
    finally:
        try:
            if stack is not None and stack.restore(keep=args.keep_stack):
                print("stopped the Kafka + Redis stack this run started (--keep-stack keeps it)", file=sys.stderr)
            elif own is not None and args.keep_stack:
                print(f"left this run's stack running: {own.down}", file=sys.stderr)
        except SutError as err:
            print(f"batchwire bench: {err}", file=sys.stderr)
            status = status or 1
        restore_sigterm()
    for run in runs:
        if run["rates"]:
            print(run_table(run) + "\n", flush=True)
    if len(runs) == 2 and all(run["rates"] for run in runs):
        print("\n" + compare_table(runs[0], runs[1]))
    if args.out is not None and runs:
        _write(args, started, runs)
    failure = _failure(outcomes)
    if failure is not None and status == 0:
        print(f"batchwire bench: {failure}", file=sys.stderr)
        status = 1
    return status


Outcome = tuple[int, Mapping[str, int]]
"""One rate's (or one mix stream's) requests answered 200 and its errors by kind."""


def _failure(outcomes: Sequence[Outcome]) -> str | None:
    """Why the run is a failure for a script that reads the exit status (a wrong --url, a refused
    connection, a wrong answer under --check), or None: the tables alone do not stop a CI job."""
    if not outcomes:
        return None
    if sum(ok for ok, _ in outcomes) == 0:
        errors: dict[str, int] = {}
        for _, kinds in outcomes:
            for kind, count in kinds.items():
                errors[kind] = errors.get(kind, 0) + count
        said = " ".join(f"{kind}={count}" for kind, count in sorted(errors.items()) if count) or "none sent"
        return f"no request was answered ({said})"
    wrong = sum(kinds.get(WRONG_ANSWER, 0) + kinds.get(BAD_BODY, 0) for _, kinds in outcomes)
    if wrong:
        return f"{wrong} answers were wrong (--check / --expect reverse)"
    return None


def _make_out(out: Path | None) -> None:
    """Makes ``--out`` before the run: one that cannot be made would lose every measurement at the end."""
    if out is None:
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--out {out}: {err.strerror}") from err


def _own_stack(args: argparse.Namespace) -> OwnStack | None:
    """With --brokers, a stack in a fresh state dir (its data is removed with it at the end)."""
    if args.brokers is None:
        return None
    state_dir = Path(tempfile.mkdtemp(prefix="batchwire-bench-stack-"))
    return OwnStack(state_dir, brokers=args.brokers, redis_replicas=args.redis_replicas)


def _run_started(
    runner: asyncio.Runner,
    args: argparse.Namespace,
    load: LoadConfig,
    policy: str | None,
    budget: int | None,
    report: RunReport,
    stack: Stack | None,
) -> list[Outcome]:
    spec = SutSpec(
        mode=args.start,
        policy=policy or args.policy,
        workers=args.workers,
        sim_latency_ms=args.sim_latency_ms,
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        gateways=args.gateways,
        batchers=args.batchers,
        slow_worker_latency_ms=args.slow_worker_latency_ms,
        ready_timeout_s=args.ready_timeout,
        stop_grace_s=args.stop_grace,
        own_stack=stack.own if stack is not None else None,
        models=mix_models(args.mix or ()),
        gateway_args=tuple(shlex.split(args.sut_args)),
        result_ttl_s=args.result_ttl_s,
        max_batch_tokens=budget,
    )
    name = spec.policy if budget is None else f"{spec.policy}-{_budget_name(budget).replace(' ', '-')}"
    log_dir = (args.out / "logs" / name) if args.out else Path(tempfile.mkdtemp(prefix="batchwire-bench-"))
    sut = SystemUnderTest(spec, log_dir)
    infra_found: dict[str, object] | None = None
    try:
        with sut:
            print(f"starting {spec.mode} batchwire, policy {spec.policy} (logs in {log_dir})", file=sys.stderr)
            sut.start()
            runner.run(sut.wait_ready())
            _, body = _probe_body(load)
            runner.run(wait_first_answer(sut.urls, body, args.ready_timeout))
            groups = dict(sut.pid_groups())
            redis_url = args.redis_url
            if spec.mode == "kafka":
                settings = stack_settings(stack.own if stack is not None else None, os.environ)
                redis_url = redis_url or settings.get("BATCHWIRE_REDIS_URL")
                if stack is not None and stack.own is not None:
                    infra, how = stack.server_pids(), "stack status --json"
                else:
                    infra, how = discover_infra_pids(STACK_DIR, settings)
                groups["kafka"] = args.kafka_pids or infra["kafka"]
                groups["redis"] = args.redis_pids or infra["redis"]
                if infra.get("sentinel"):
                    groups["sentinel"] = infra["sentinel"]
                infra_found = {**{kind: groups[kind] for kind in infra if kind in groups}, "found_by": how}
            target = Target(
                urls=tuple(sut.urls),
                metrics_urls=() if args.no_metrics else tuple(args.metrics_url or sut.metrics_urls),
                pid_groups=groups,
                workers_hint=spec.workers,
                batch_log=sut.batch_log,
                redis_url=redis_url,
            )
            return runner.run(_measure(args, load, target, report))
    finally:
        report["sut"] = {**sut.describe(), "infra_pids": infra_found}


def stack_settings(own: OwnStack | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The addresses the started roles use: a stack of the run's own gives them alone (``child_env``
    drops the set ones); else the set variables win over ``.batchwire/stack.env``, as in the roles."""
    if own is not None:
        return read_env_file(own.state_dir / "stack.env")
    return {**read_env_file(STACK_DIR / "stack.env"), **environ}


async def _measure(args: argparse.Namespace, load: LoadConfig, target: Target, report: RunReport) -> list[Outcome]:
    """The rates of ``--rate`` into ``report``, or each ``--mix`` (its table, and mix.json under ``--out``);
    returns each rate's (or stream's) outcome."""
    if not args.mix:
        await bench_run(load, target, report)
        return [(rate["ok"], rate["errors"]) for rate in report["rates"]]

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    mixes = await mix_run(load, target, args.mix, progress)
    print(f"\n{report['label']} ({report['policy']})", flush=True)
    for mix in mixes:
        print(f"mix {mix['mix']}\n" + "\n".join(mix_table(mix["streams"])) + "\n", flush=True)
    if args.out is not None:
        print(f"wrote {write_mix(args.out / (report['policy'] or 'given'), mixes)}", file=sys.stderr)
    return [
        (stream["ok"], {**stream["other_errors"], "refused": stream["refused"]})
        for mix in mixes
        for stream in mix["streams"]
    ]


def _probe_body(load: LoadConfig) -> tuple[str, bytes]:
    return InputFactory(load.input_size, random.Random(), field=load.payload_field, nonce="ready").next()


def _sigterm_as_sigint() -> Callable[[], None]:
    """Makes SIGTERM and SIGINT behave like Ctrl-C (the event loop cancels the run, ``finally``
    blocks stop the system under test); returns the function that puts the old handlers back.

    SIGINT gets Python's own handler explicitly: a bench started as a background job (``cmd &``,
    nohup, some CI runners) inherits SIGINT ignored, and would then ignore both signals.
    """
    try:
        previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
    except ValueError:  # not the main thread: signals cannot be handled here
        return lambda: None

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)

    return restore


def _loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if choice == "asyncio":
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def _load_config(args: argparse.Namespace) -> LoadConfig:
    if not args.rate and not args.mix:
        raise UsageError("--rate is required (e.g. --rate 100,500,1000), or --mix, unless --compare is given")
    if args.rate and args.mix:
        raise UsageError("--rate and --mix exclude each other: a mix gives each stream its own rate")
    if args.duration <= 0 or args.warmup < 0 or args.pause < 0:
        raise UsageError("--duration must be above 0 and --warmup, --pause 0 or more")
    _check_schedule_length(args)
    if args.concurrency_limit < 1 or args.timeout <= 0 or args.input_size < 0:
        raise UsageError("--concurrency-limit must be 1 or more, --timeout above 0, --input-size 0 or more")
    if args.start and args.url:
        raise UsageError("--url and --start exclude each other: --start serves on ports it picks itself")
    for flag, count in (("--workers", args.workers), ("--gateways", args.gateways), ("--batchers", args.batchers)):
        if count < 1:
            raise UsageError(f"{flag} must be 1 or more, got {count}: a system with none of them answers nothing")
    if args.start != "kafka" and (args.slow_worker_latency_ms is not None or args.gateways != 1 or args.batchers != 1):
        raise UsageError("--slow-worker-latency-ms, --gateways and --batchers need --start kafka")
    for flag, urls in (("--url", args.url or []), ("--metrics-url", args.metrics_url or [])):
        for url in urls:
            _check_url(flag, url)
    if args.client == "raw" and any(not url.startswith("http://") for url in args.url or []):
        raise UsageError("--client raw speaks plain http:// only; use --client aiohttp for https")
    if args.lone < 0 or args.lone_gap_ms < 0 or args.warm < 0:
        raise UsageError("--lone, --lone-gap-ms and --warm must be 0 or more")
    if args.brokers is not None and (args.start != "kafka" or args.brokers < 1):
        raise UsageError("--brokers needs --start kafka and a count of 1 or more")
    if args.redis_replicas and args.brokers is None:
        raise UsageError("--redis-replicas needs --brokers: only a stack this run starts has its shape chosen here")
    if args.redis_replicas < 0:
        raise UsageError("--redis-replicas must be 0 or more")
    try:
        shlex.split(args.sut_args)
    except ValueError as err:
        raise UsageError(f"--sut-args {args.sut_args!r}: {err}; quote it as a shell would") from err
    if args.redis_url and args.redis_url.partition("://")[0].lower() not in REDIS_SCHEMES:
        raise UsageError(
            f"--redis-url {redacted(args.redis_url)}: the scheme must be one of "
            f"{', '.join(scheme + '://' for scheme in REDIS_SCHEMES)}"
        )
    if args.start and args.pids:
        raise UsageError("--pids counts a server given by --url; --start counts the processes it starts itself")
    if args.start and args.start != "kafka" and (args.kafka_pids or args.redis_pids):
        raise UsageError(
            f"--kafka-pids and --redis-pids need --url or --start kafka; --start {args.start} runs neither"
        )
    for flag, pids in (("--pids", args.pids), ("--kafka-pids", args.kafka_pids), ("--redis-pids", args.redis_pids)):
        if missing := [pid for pid in pids if not psutil.pid_exists(pid)]:
            # Counted silently, a process that is not there shows as 0 µs per request.
            raise UsageError(f"{flag}: no process {', '.join(map(str, missing))} runs here; give the pids of live ones")
    expect: Expect = "reverse" if args.check else args.expect
    return LoadConfig(
        rates_rps=tuple(args.rate or ()),
        duration_s=args.duration,
        warmup_s=args.warmup,
        concurrency_limit=args.concurrency_limit,
        timeout_s=args.timeout,
        input_size=args.input_size,
        seed=args.seed,
        zipf=_zipf(args.zipf),
        lengths=_lengths(args.lengths),
        expect=expect,
        payload_field=args.payload_field,
        pause_s=args.pause,
        client=args.client,
        lone_count=args.lone,
        lone_gap_s=args.lone_gap_ms / 1000.0,
        warm_count=args.warm,
    )


def _check_schedule_length(args: argparse.Namespace) -> None:
    """Refuses a rate or mix whose schedule the bench could not hold (``MAX_SENDS_PER_RATE``)."""
    loads = [(f"--rate {rate:g}", rate) for rate in args.rate or ()]
    for mix in args.mix or ():
        loads.append((f"--mix {','.join(f'{s.name}:{s.rate_rps:g}' for s in mix)}", sum(s.rate_rps for s in mix)))
    span_s = args.warmup + args.duration
    for given, rate_rps in loads:
        if rate_rps * span_s > MAX_SENDS_PER_RATE:
            raise UsageError(
                f"{given} over --warmup {args.warmup:g} + --duration {args.duration:g} s is "
                f"{rate_rps * span_s:,.0f} sends; the bench draws every send's time before the first and keeps "
                f"every answer, so it holds at most {MAX_SENDS_PER_RATE:,} per rate: lower --warmup, --duration "
                "or the rate"
            )


def _check_url(flag: str, url: str) -> None:
    """An absolute http(s) URL: yarl raises a bare ValueError on a bad port once the load starts, and a
    URL with no scheme or host fails every request as a protocol error."""
    try:
        parsed = URL(url)
        port = parsed.port
    except ValueError as err:
        raise UsageError(f"{flag} {url}: {err}; the form is http://HOST:PORT/PATH") from err
    if parsed.scheme not in ("http", "https") or not parsed.host or port is None:
        raise UsageError(f"{flag} {url}: not an http:// or https:// URL with a host; the form is http://HOST:PORT/PATH")


def _lengths(text: str | None) -> Lengths | None:
    if not text:
        return None
    try:
        return Lengths.parse(text)
    except ValueError as err:
        raise UsageError(str(err)) from err


def _zipf(text: str | None) -> Zipf | None:
    if not text:
        return None
    try:
        return Zipf.parse(text)
    except ValueError as err:
        raise UsageError(str(err)) from err


def _policies(args: argparse.Namespace) -> list[str | None]:
    if args.policies:
        if not args.start:
            raise UsageError("--policies needs --start: the bench can only switch policies of a system it starts")
        return list(args.policies)
    return [args.policy] if args.start else [None]


def _budgets(args: argparse.Namespace) -> list[int | None]:
    if args.budgets:
        if not args.start:
            raise UsageError("--budgets needs --start: the bench can only set the token budget of a system it starts")
        return list(args.budgets)
    return [None]


def _budget_name(budget: int) -> str:
    return "count only" if budget == 0 else f"budget {budget}"


def _given_target(args: argparse.Namespace) -> Target:
    urls: list[str] = args.url or [DEFAULT_URL]
    metrics: list[str] = []
    if not args.no_metrics:
        metrics = args.metrics_url or list(dict.fromkeys(default_metrics_url(url) for url in urls))
    groups = {"batchwire": args.pids, "kafka": args.kafka_pids, "redis": args.redis_pids}
    return Target(urls=tuple(urls), metrics_urls=tuple(metrics), pid_groups=groups, redis_url=args.redis_url)


def _label(args: argparse.Namespace) -> str:
    if args.label:
        return str(args.label)
    if args.start:
        return f"{args.start}"
    first: str = (args.url or [DEFAULT_URL])[0]
    return urlsplit(first).netloc


def _raise_open_files_limit(wanted: int) -> None:
    """Each outstanding request holds a socket; the common soft limit of 1024 would fail first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            print(
                f"batchwire bench: open-file limit {soft} is below {wanted}; raise it with ulimit -n", file=sys.stderr
            )


def _write(args: argparse.Namespace, started: dt.datetime, runs: list[RunReport]) -> None:
    config = {key: _jsonable(value) for key, value in vars(args).items() if not callable(value)}
    document = Results(
        schema=results.SCHEMA, label=_label(args), config=config, metadata=results.metadata(started), runs=runs
    )
    path = results.write(document, args.out)
    backend_ms = args.backend_latency_ms
    if backend_ms is None and args.start:
        backend_ms = args.sim_latency_ms
    from batchwire.bench import plots  # matplotlib takes a second to import: only when plots are wanted

    measured = [run for run in runs if run["rates"]]
    written = plots.write_all(measured, args.out, backend_ms) if measured else []
    print(f"wrote {path}" + "".join(f", {p.name}" for p in written), file=sys.stderr)


def _jsonable(value: object) -> object:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    return str(value)


def _compare(path_a: Path, path_b: Path) -> int:
    a, b = results.load(path_a), results.load(path_b)
    pairs: Sequence[tuple[RunReport, RunReport]] = list(zip(a["runs"], b["runs"], strict=False))
    if not pairs:
        raise results.ResultsError("one of the files has no runs")
    try:
        tables = [compare_table(run_a, run_b) for run_a, run_b in pairs]
    except (KeyError, TypeError, AttributeError) as err:  # the schema's name on a file cut short or edited
        fault = f"lacks {err}" if isinstance(err, KeyError) else f"holds a figure of the wrong kind ({err})"
        raise results.ResultsError(
            f"{path_a} or {path_b} {fault} (is each a whole {results.SCHEMA!r} file, as batchwire bench --out "
            "writes it?)"
        ) from err
    print(f"A: {path_a}\nB: {path_b}")
    for table in tables:
        print("\n" + table)
    return 0
