"""``batchwire``: one command for every role and tool. Each flag of a role has a ``BATCHWIRE_*`` variable behind it.

Values come from, in order: the flag, the environment, ``.batchwire/stack.env`` (written by
``batchwire stack up``), the default. ``batchwire <command> --help`` lists them all.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata

from batchwire import flags
from batchwire.settings import SettingsError
from gateway.settings import GatewaySettings
from gpu_worker.backends.base import BackendError
from gpu_worker.backends.factory import BackendConfigError
from telemetry import logs, tracing
from transport.errors import PermanentTransportError


def _up(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = sub.add_parser("up", help="gateway, batcher and workers in one process (no Kafka, no Redis)")
    flags.shared(up)
    flags.observability(up)
    flags.gateway_http(up)
    flags.gateway_admission(up)
    flags.answer_sharing(up)
    flags.batching(up)
    flags.token_budget(up)
    flags.worker(up)
    flags.add(up, "--workers", 2, int, "workers per model, each loading its own copy of the model (hf on one GPU: 1)")
    flags.add(
        up,
        "--max-store-bytes",
        268_435_456,
        int,
        "memory for results, ids and queued inputs: ended results go oldest first, then submits get 503 (0: no limit); "
        "the result cache holds a quarter of it besides",
    )


def _gateway(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gateway = sub.add_parser("gateway", help="the HTTP gateway, over Kafka and Redis")
    flags.shared(gateway)
    flags.observability(gateway)
    flags.kafka_redis(gateway)
    flags.replication(gateway)
    flags.gateway_http(gateway)
    flags.gateway_admission(gateway)
    flags.answer_sharing(gateway)
    flags.token_budget(gateway)
    flags.field_flag(
        gateway,
        GatewaySettings,
        "request_linger_ms",
        float,
        "gather requests this long into one Kafka produce request (fewer round trips); a request 5 lingers or more "
        "after the one before goes at once; 0: send each at once",
    )


def _batcher(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    batcher = sub.add_parser("batcher", help="a batcher process, over Kafka and Redis")
    flags.shared(batcher)
    flags.observability(batcher)
    flags.kafka_redis(batcher)
    flags.replication(batcher)
    flags.batching(batcher)
    flags.token_budget(batcher)
    flags.add(batcher, "--batcher-id", None, str, "unique id of this batcher (random when unset)")
    flags.metrics_endpoint(batcher)
    flags.add(
        batcher, "--session-timeout-ms", 3000, int, "Kafka group session: a dead batcher's requests move after this"
    )
    flags.redis_replica_wait(batcher)


def _worker(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    worker = sub.add_parser("worker", help="a GPU worker process, over Kafka and Redis")
    flags.shared(worker)
    flags.observability(worker)
    flags.kafka_redis(worker)
    flags.replication(worker)
    flags.worker(worker)
    flags.worker_process(worker)
    flags.redis_replica_wait(worker)
    flags.deterministic_models(worker)


def _topics(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    topics = sub.add_parser("topics", help="grow the topics of a running deployment (more workers per model)")
    topics.add_argument("action", choices=["grow"])
    topics.add_argument(
        "--batch-partitions", type=int, default=None, help="grow each model's batch topic to N (at most 10,000)"
    )
    topics.add_argument(
        "--request-partitions",
        type=int,
        default=None,
        help="grow the request topic to N, at most 10,000 (gateways, batchers stopped)",
    )
    flags.add(topics, "--namespace", "batchwire", str, "prefix of every topic and Redis key (isolates deployments)")
    flags.add(topics, "--models", "sim", flags.models, "comma-separated models served; requests name one")
    flags.add(topics, "--kafka-bootstrap", None, str, "Kafka bootstrap servers, HOST:PORT[,HOST:PORT]")
    flags.add(topics, "--log-level", "info", str, logs.LEVEL_NAMES)


def _root() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction[argparse.ArgumentParser]]:
    # The module docstring is the help, its reST literals read as plain text.
    parser = argparse.ArgumentParser(prog="batchwire", description=(__doc__ or "").replace("``", ""))
    # Commands without the observability flags (stack, topics, the tools) log text and trace nothing.
    parser.set_defaults(log_level="info", log_format="text", otlp_endpoint=None, trace_sample_ratio=1.0)
    parser.add_argument("--version", action="version", version=f"batchwire {metadata.version('batchwire')}")
    return parser, parser.add_subparsers(dest="command", required=True, metavar="COMMAND")


def build_parser() -> argparse.ArgumentParser:
    parser, sub = _root()
    for add_command in (_up, _gateway, _batcher, _worker, _topics):
        add_command(sub)
    for name, tool in TOOLS.items():
        # A stand-in for `--help`: the tool's own parser, in its own module, reads its arguments (`tool_parser`).
        sub.add_parser(name, help=tool.help, add_help=False)
    return parser


def tool_parser(name: str) -> argparse.ArgumentParser:
    """The parser of one tool command, from its module (which this imports)."""
    parser, sub = _root()
    importlib.import_module(TOOLS[name].module).add_parser(sub)
    return parser


def role_flags() -> Iterator[tuple[str, str, str]]:
    """(command, flag, help) of each flag of the role commands (``up``, ``gateway``, ``batcher``, ``worker``)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("up", "gateway", "batcher", "worker"):
        for action in sub.choices[command]._actions:
            flag = next((o for o in action.option_strings if o.startswith("--")), None)
            if flag is not None and flag != "--help" and action.help is not None:
                yield command, flag, action.help


def config_table() -> str:
    """docs/operations.md's configuration table, made from the parsers so the two cannot drift apart."""
    rows: dict[str, tuple[str, dict[str, list[str]]]] = {}
    for command, flag, help_text in role_flags():
        text, _, tail = help_text.rpartition(" [")
        var, _, default = tail.rstrip("]").partition("; default: ")
        meanings = rows.setdefault(flag, (var, {}))[1]
        meanings.setdefault(f"{text} (default: {default})", []).append(command)
    lines = ["| flag | variable | used by | meaning |", "|---|---|---|---|"]
    for flag, (var, meanings) in rows.items():
        commands = [command for users in meanings.values() for command in users]
        if len(meanings) == 1:
            text = next(iter(meanings))
        else:  # a flag that means something else to another command (a worker's --max-batch) says both
            text = "; ".join(f"{', '.join(users)}: {meaning}" for meaning, users in meanings.items())
        lines.append(f"| `{flag}` | `{var}` | {', '.join(commands)} | {text} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Tool:
    """A command that is not a role: its module is imported only when the command runs, so nothing that
    ``batchwire up`` or a role imports reaches it, nor the optional extra it may need."""

    module: str
    """Holds ``add_parser(sub)`` and ``run(args)``."""
    help: str
    extra: str | None = None
    """The optional dependencies it needs (``pip install 'batchwire[EXTRA]'``); None: the core's."""


TOOLS: dict[str, Tool] = {
    "stack": Tool("batchwire.stack_command", "start or stop a local Kafka broker and Redis server in the background"),
    "bench": Tool("batchwire.bench.cli", "open-loop load test with latency percentiles", "bench"),
    "profile": Tool("batchwire.capacity.profile", "time a backend's calls by batch size and write a curve file"),
    "simulate": Tool("batchwire.capacity.simulate", "simulate a deployment on a latency curve at given request rates"),
    "plan": Tool("batchwire.capacity.plan", "size a deployment: GPUs (simulated), partitions, processes, Kafka, Redis"),
    "status": Tool("batchwire.status", "the fleet: every gateway, batcher and worker and their figures, per model"),
    "dead-letters": Tool("batchwire.dead_letters", "the inputs workers set aside, from the dead-letter topic, as JSON"),
    "validate-sim": Tool(
        "batchwire.capacity.validate",
        "measured bench runs beside the simulation of the same deployment, as a markdown table",
        "bench",
    ),
}


SERVICE_NAMES = {
    "up": "batchwire",
    "gateway": "batchwire-gateway",
    "batcher": "batchwire-batcher",
    "worker": "batchwire-worker",
}
"""The OpenTelemetry service name each role's spans carry."""

HANDLERS: dict[str, tuple[str, str]] = {
    "up": ("batchwire.roles", "run_embedded"),
    "gateway": ("batchwire.roles", "run_gateway"),
    "batcher": ("batchwire.roles", "run_batcher"),
    "worker": ("batchwire.roles", "run_worker"),
    "topics": ("batchwire.operations", "run_topics"),
}
"""Each command's module and function, imported when it runs: a tool (``status``) need not load the roles."""


def _handler(command: str) -> Callable[[argparse.Namespace], int]:
    module, name = HANDLERS[command]
    handler: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module), name)
    return handler


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # Ctrl-C while the command's modules load: as at any later moment
        return 130


def _main(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if command.startswith("-") and command not in ("-h", "--help", "--version"):
        return _options_first(argv)
    tool = TOOLS.get(command)
    if tool is None:  # a role, `topics`, `--help` or a mistake: the full parser says which
        parser = build_parser()
        args = parser.parse_args(argv)
        return _run(args, _handler(args.command), parser)
    try:
        parser = tool_parser(command)
        return _run(parser.parse_args(argv), importlib.import_module(tool.module).run, parser)
    except ModuleNotFoundError as err:
        if tool.extra is None:
            raise
        print(
            f"batchwire {command} needs the {tool.extra} extra: pip install 'batchwire[{tool.extra}]' "
            f"(missing module: {err.name})",
            file=sys.stderr,
        )
        return 2


def _options_first(argv: list[str]) -> int:
    """Options before the command: argparse alone would call the first option's value an unknown command."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    named_at = [i for i, arg in enumerate(argv) if arg in sub.choices]
    # A command name right after an option (``--namespace up gateway``) is likelier that option's value.
    standalone = [i for i in named_at if i == 0 or not argv[i - 1].startswith("-") or "=" in argv[i - 1]]
    if not named_at:
        build_parser().parse_args(argv)  # no command at all: argparse's own error, exit 2
        return 2
    at = (standalone or named_at)[0]
    named, rest = argv[at], argv[:at] + argv[at + 1 :]
    print(f"batchwire: options go after the command: batchwire {named} {' '.join(rest)}", file=sys.stderr)
    return 2


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command_parser: argparse.ArgumentParser = sub.choices[command]
    return command_parser


def _run(
    args: argparse.Namespace, handler: Callable[[argparse.Namespace], int], parser: argparse.ArgumentParser
) -> int:
    try:
        logs.configure(str(args.log_level), args.log_format)
        service = SERVICE_NAMES.get(args.command, "batchwire")
        tracing.configure(args.otlp_endpoint, service, sample_ratio=args.trace_sample_ratio)
    except ValueError as err:  # TracingError and a wrong --log-format name their flag
        print(f"batchwire {args.command}: {err}", file=sys.stderr)
        return 2
    try:
        return handler(args)
    # a setting that cannot work, a backend that cannot load, or the servers refuse
    except (SettingsError, BackendConfigError, PermanentTransportError) as err:
        print(
            f"batchwire {args.command}: {flags.with_flags(str(err), _command_parser(parser, args.command))}",
            file=sys.stderr,
        )
        return 2
    except BackendError as err:  # raised out of a role only by its load: the model did not load
        print(f"batchwire {args.command}: the model did not load: {err}", file=sys.stderr)
        return 2
    finally:
        tracing.shutdown()  # exports the spans still held


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
