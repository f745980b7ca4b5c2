"""``batchwire``: one command for every role. Each flag has a ``BATCHWIRE_*`` variable behind it.

Values come from, in order: the flag, the environment, ``.batchwire/stack.env`` (written by
``batchwire stack up``), the default. ``batchwire <command> --help`` lists them all.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from batchwire.gc_tuning import DEFAULT as GC_DEFAULT
from batchwire.gc_tuning import Threshold, parse_threshold
from batchwire.settings import SettingsError, env


def _models(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _add(
    parser: argparse.ArgumentParser,
    flag: str,
    default: Any,
    kind: Callable[[str], Any],
    help_text: str,
    var: str | None = None,
) -> None:
    """Adds ``--flag`` whose default comes from ``BATCHWIRE_FLAG`` (or the stack file) when set."""
    var = var or "BATCHWIRE_" + flag.lstrip("-").replace("-", "_").upper()
    raw = env(var)
    value = default if raw is None else raw
    shown = "unset" if default is None else default
    parser.add_argument(flag, default=value, type=kind, help=f"{help_text} [{var}; default: {shown}]")


def _memory_size(text: str) -> str:
    from infra.redis_server import checked_maxmemory

    try:
        return checked_maxmemory(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _min_replicas(text: str) -> int | None:
    from gpu_worker.replicas import parse_min_replicas

    try:
        return parse_min_replicas(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected auto or a number of replicas, got {text!r}") from err


def _gc_threshold(text: str) -> Threshold | None:
    try:
        return parse_threshold(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _shared(parser: argparse.ArgumentParser) -> None:
    _add(parser, "--namespace", "batchwire", str, "prefix of every topic and Redis key (isolates deployments)")
    _add(parser, "--models", "sim", _models, "comma-separated models served; requests name one")
    _add(parser, "--request-partitions", 12, int, "partitions of the request topic (split among models)")
    _add(parser, "--batch-partitions", 8, int, "partitions of each model's batch topic (max workers per model)")
    _add(parser, "--result-ttl-s", 3600.0, float, "how long task states and results are kept")
    _add(parser, "--log-level", "info", str, "debug, info, warning or error")
    _add(
        parser,
        "--gc-threshold",
        ",".join(map(str, GC_DEFAULT)),
        _gc_threshold,
        "Python GC thresholds young,middle,full after freezing start-up objects (off: Python's own)",
    )


def _kafka_redis(parser: argparse.ArgumentParser) -> None:
    _add(parser, "--kafka-bootstrap", None, str, "Kafka bootstrap servers, HOST:PORT[,HOST:PORT]")
    _add(
        parser,
        "--redis-url",
        None,
        str,
        "Redis URL: redis://HOST:PORT/DB, or redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/DB] to follow "
        "Sentinel failovers",
    )


def _replication(parser: argparse.ArgumentParser) -> None:
    _add(
        parser,
        "--replication-factor",
        None,
        int,
        "copies of each partition of a topic this creates; an existing topic with fewer stops it (unset: the smaller "
        "of 3 and the brokers)",
    )
    _add(
        parser,
        "--min-insync-replicas",
        None,
        int,
        "copies a write needs before Kafka acknowledges it, set on each topic this creates; an existing topic with "
        "fewer stops it (unset: replication factor - 1, at least 1)",
    )


def _gateway_opts(parser: argparse.ArgumentParser, default_port: int) -> None:
    _add(parser, "--host", "127.0.0.1", str, "address the HTTP server binds")
    _add(parser, "--port", default_port, int, "port the HTTP server listens on")
    _add(parser, "--gateway-id", None, str, "unique id of this gateway process (random when unset)")
    _add(parser, "--default-model", None, str, "model used when a request names none (first of --models)")
    _add(parser, "--default-timeout-ms", 30_000, int, "deadline of a request that sets no timeout_ms")
    _add(parser, "--max-timeout-ms", 30_000, int, "the longest timeout_ms a request may ask for")
    _add(parser, "--max-input-chars", 65_536, int, "longest accepted input, in characters")
    _add(parser, "--max-body-bytes", 1_048_576, int, "largest accepted request body")
    _add(parser, "--max-header-bytes", 16_384, int, "largest request line plus headers; beyond it 431 and a close")
    _add(parser, "--header-timeout-s", 10.0, float, "a request's headers must come within this; then 408 and a close")
    _add(parser, "--body-timeout-s", 30.0, float, "a request's body must come within this of its headers; then 408")
    _add(
        parser,
        "--max-connections",
        4096,
        int,
        "open HTTP connections; at the cap a new one replaces the longest waiting without a request, else gets 503",
    )
    _add(parser, "--max-inflight", 10_000, int, "requests one gateway holds at once before answering 503")
    _add(parser, "--max-watchers", 2_000, int, "event streams and long-polls one gateway holds open before a 503")
    _add(
        parser,
        "--max-queue-depth",
        20_000,
        int,
        "requests of one model accepted and not yet at a worker before its submits get 503 (0: no limit)",
    )
    _add(
        parser,
        "--admit-by-wait",
        True,
        _bool,
        "refuse (503) a request whose deadline its model's queue cannot meet, from the measured drain rate",
    )
    _add(parser, "--stall-s", 5.0, float, "a model with requests waiting and no batch taken this long is stalled (503)")
    _add(
        parser,
        "--reply-recheck-s",
        1.0,
        float,
        "a synchronous caller without its reply this long is looked up in the store (then at 2x, 4x, up to 8x), "
        "and its connection watched",
    )
    _add(parser, "--stream-recheck-s", 5.0, float, "an event stream without a change this long re-reads its task")
    _add(parser, "--rate-limit-per-s", 0.0, float, "submits per second per client, shared by all gateways (0: off)")
    _add(parser, "--rate-limit-burst", 0, int, "submits a client may save up (0: one second's worth of the rate)")
    _add(
        parser,
        "--trust-client-id",
        False,
        _bool,
        "without API keys, rate-limit by the X-Client-Id header instead of the peer address (only behind a proxy "
        "that sets it)",
    )
    _add(
        parser,
        "--api-keys",
        None,
        str,
        "comma-separated API keys, or sha256:<hex> digests of them; prefer the variable or the file to the flag",
    )
    _add(
        parser,
        "--api-keys-file",
        None,
        str,
        "file of API keys (or sha256:<hex> digests), one a line; 'operator <key>' marks a key that may read /metrics",
    )


def _express(parser: argparse.ArgumentParser) -> None:
    _add(
        parser,
        "--express",
        True,
        _bool,
        "over Kafka, also hand requests and batches on over Redis, a faster hop (Kafka keeps the record)",
    )


def _batcher_opts(parser: argparse.ArgumentParser) -> None:
    _add(parser, "--policy", "work-conserving", str, "flush policy: work-conserving or classic (size-or-timeout)")
    _add(parser, "--max-batch", None, int, "items per batch at most (work-conserving: 100, classic: 32)")
    _add(parser, "--max-wait-ms", None, float, "age that seals a batch (work-conserving: 1000, classic: 50)")
    _add(
        parser,
        "--spacing-margin-ms",
        5.0,
        float,
        "keep busy workers' calls evenly spread, sealing a batch this long before its call should start (-1: off)",
    )


def _worker_opts(parser: argparse.ArgumentParser) -> None:
    _add(parser, "--backend", "sim", str, "model backend: sim (reversed input) or hf (transformers)")
    _add(parser, "--sim-latency-ms", 100.0, float, "sim backend: latency of one call, whatever the batch size")
    _add(parser, "--model-path", None, str, "hf backend: local directory of the checkpoint (nothing is downloaded)")
    _add(parser, "--hf-task", "generate", str, "hf backend: generate or embed")
    _add(parser, "--hf-max-new-tokens", 32, int, "hf backend: tokens generated per input")
    _add(parser, "--hf-max-input-tokens", None, int, "hf backend: longest input in tokens (default: the model's)")
    _add(parser, "--hf-truncate", False, _bool, "hf backend: truncate long inputs instead of rejecting them")
    _add(parser, "--hf-num-threads", None, int, "hf backend on CPU: torch threads (default: cores - 1)")
    _add(parser, "--device", "auto", str, "hf backend: auto, cpu, cuda or cuda:N")
    _add(parser, "--dtype", "auto", str, "hf backend: auto, float32, float16 or bfloat16")
    _add(parser, "--batch-log", None, str, "append one JSON line per batch run to this file (audits, tests)")
    _add(parser, "--credit-ttl-s", 5.0, float, "an idle worker's credit lives this long; it is renewed while unclaimed")
    _add(parser, "--max-deliveries", 3, int, "an input in flight alone at this many worker deaths is dead-lettered")
    _add(parser, "--hang-factor", 10.0, float, "a backend call this many times its expected latency is hung (0: off)")
    _add(parser, "--hang-min-s", 5.0, float, "the hang limit is never shorter than this")
    _add(parser, "--expected-latency-ms", None, float, "expected backend call latency (default: moving average)")
    _add(parser, "--credit-lead-ms", 15.0, float, "offer the next credit this long before the call should end (0: off)")
    _add(parser, "--credit-lead-full-ms", 40.0, float, "the lead while batches are at least half full (0: off)")
    _add(parser, "--drain-timeout-s", 30.0, float, "on SIGTERM, how long the batch in hand may still run")
    _add(parser, "--sim-hang-on", None, str, "sim backend (fault tests): hang forever on an input containing this")
    _add(parser, "--sim-crash-on", None, str, "sim backend (fault tests): exit 70 at once on an input containing this")
    _add(
        parser,
        "--max-output-bytes",
        1_048_576,
        int,
        "a longer output (UTF-8) fails its task with output_too_large instead of being stored (0: no limit)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchwire", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="gateway, batcher and sim workers in one process (no Kafka, no Redis)")
    _shared(up)
    _gateway_opts(up, 8000)
    _batcher_opts(up)
    _worker_opts(up)
    _add(up, "--workers", 2, int, "workers per model")
    _add(
        up,
        "--max-store-bytes",
        268_435_456,
        int,
        "memory for results, ids and queued inputs: ended results go oldest first, then submits get 503 (0: no limit)",
    )

    gateway = sub.add_parser("gateway", help="the HTTP gateway, over Kafka and Redis")
    _shared(gateway)
    _kafka_redis(gateway)
    _replication(gateway)
    _gateway_opts(gateway, 8000)
    _express(gateway)
    _add(
        gateway,
        "--express-record-delay-ms",
        6.0,
        float,
        "with --express, produce a synchronous request's Kafka record this long after its express copy",
    )
    _add(
        gateway,
        "--request-linger-ms",
        4.0,
        float,
        "gather requests this long into one Kafka produce request (fewer round trips; 0: send at once)",
    )

    batcher = sub.add_parser("batcher", help="a batcher process, over Kafka and Redis")
    _shared(batcher)
    _kafka_redis(batcher)
    _replication(batcher)
    _batcher_opts(batcher)
    _add(batcher, "--batcher-id", None, str, "unique id of this batcher (random when unset)")
    _add(batcher, "--metrics-port", 0, int, "serve Prometheus /metrics on this port (0: off)")
    _add(batcher, "--session-timeout-ms", 3000, int, "Kafka group session: a dead batcher's requests move after this")
    _add(
        batcher,
        "--read-pace-ms",
        10.0,
        float,
        "while every worker is busy, fetch requests at most this often, catching up before each seal (0: always)",
    )
    _express(batcher)

    worker = sub.add_parser("worker", help="a GPU worker process, over Kafka and Redis")
    _shared(worker)
    _kafka_redis(worker)
    _replication(worker)
    _worker_opts(worker)
    _add(worker, "--model", None, str, "the model this worker serves (first of --models)")
    _add(worker, "--worker-id", None, str, "unique id of this worker (random when unset)")
    _add(worker, "--max-batch", None, int, "largest batch this worker's backend takes (sim: 100, hf: 32)")
    _add(worker, "--metrics-port", 0, int, "serve Prometheus /metrics on this port (0: off)")
    _add(worker, "--session-timeout-ms", 3000, int, "Kafka group session: a dead worker's batches move after this")
    _add(
        worker,
        "--redis-min-replicas",
        "auto",
        _min_replicas,
        "Redis replicas that must hold a batch's results before its offset is committed (auto: 1 while the "
        "primary has a replica in sync, else 0)",
    )
    _add(worker, "--redis-replica-wait-ms", 1000, int, "how long one store of results waits for those replicas")

    stack = sub.add_parser("stack", help="start or stop a local Kafka broker and Redis server in the background")
    stack.add_argument("action", choices=["up", "down", "status"])
    _add(stack, "--state-dir", ".batchwire", str, "where the stack keeps data, logs and stack.env")
    _add(
        stack,
        "--redis-maxmemory",
        "512mb",
        _memory_size,
        "Redis's memory bound (bytes, or with kb/mb/gb; 0: none) when up starts it; over it writes are refused",
    )
    _add(stack, "--brokers", 1, int, "Kafka nodes up starts (more than 1: a KRaft cluster, internal topics RF 3)")
    _add(stack, "--redis-replicas", 0, int, "Redis replicas up starts beside the primary (1 or more: 3 Sentinels too)")
    stack.add_argument("--json", action="store_true", help="status: every server as JSON (pid, port, leaders, roles)")
    _shared(stack)
    _replication(stack)

    topics = sub.add_parser("topics", help="grow the topics of a running deployment (more workers per model)")
    topics.add_argument("action", choices=["grow"])
    topics.add_argument("--batch-partitions", type=int, default=None, help="grow each model's batch topic to N")
    topics.add_argument(
        "--request-partitions", type=int, default=None, help="grow the request topic to N (gateways, batchers stopped)"
    )
    _add(topics, "--namespace", "batchwire", str, "prefix of every topic and Redis key (isolates deployments)")
    _add(topics, "--models", "sim", _models, "comma-separated models served; requests name one")
    _add(topics, "--kafka-bootstrap", None, str, "Kafka bootstrap servers, HOST:PORT[,HOST:PORT]")
    _add(topics, "--log-level", "info", str, "debug, info, warning or error")

    bench = sub.add_parser("bench", help="open-loop load test with latency percentiles", add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    return parser


def config_table() -> str:
    """The README's configuration table, made from the parsers so the two cannot drift apart."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    rows: dict[str, tuple[str, str, list[str]]] = {}
    for command in ("up", "gateway", "batcher", "worker"):
        for action in sub.choices[command]._actions:
            flag = next((o for o in action.option_strings if o.startswith("--")), None)
            if flag is None or flag == "--help" or action.help is None:
                continue
            text, _, tail = action.help.rpartition(" [")
            var, _, default = tail.rstrip("]").partition("; default: ")
            entry = rows.setdefault(flag, (var, f"{text} (default: {default})", []))
            entry[2].append(command)
    lines = ["| flag | variable | used by | meaning |", "|---|---|---|---|"]
    for flag, (var, text, commands) in rows.items():
        lines.append(f"| `{flag}` | `{var}` | {', '.join(commands)} | {text} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from batchwire.bench.cli import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(getattr(args, "log_level", "info")).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from batchwire import roles

    try:
        handler: Callable[[argparse.Namespace], int] = {
            "up": roles.run_embedded,
            "gateway": roles.run_gateway,
            "batcher": roles.run_batcher,
            "worker": roles.run_worker,
            "stack": roles.run_stack,
            "topics": roles.run_topics,
        }[args.command]
        return handler(args)
    except SettingsError as err:
        print(f"batchwire {args.command}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
