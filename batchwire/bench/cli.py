"""``batchwire bench``: its flags, and ``main``/``run`` to execute them.

Importing this module is cheap (argparse only): ``batchwire bench`` mounts it with ``add_parser(sub)``
and ``run(args)`` (``batchwire.cli.TOOLS``), so parsing its flags, ``--help`` included, loads neither
aiohttp nor matplotlib.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from batchwire.bench.streams import Stream, parse_mix
from batchwire.settings import number

DEFAULT_URL = "http://127.0.0.1:8000/v1/inference"
POLICIES = ("work-conserving", "classic")
RESULT_TTL_S = 300.0


def _floats(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from err
    if not values or not all(0 < value < math.inf for value in values):  # NaN too
        raise argparse.ArgumentTypeError(f"expected positive finite numbers, got {text!r}")
    return values


def _whole_numbers(text: str, least: int) -> list[int] | None:
    """The comma-separated whole numbers of ``text``, each ``least`` or more; None when it holds none, or another."""
    try:
        numbers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        return None
    return numbers if numbers and min(numbers) >= least else None


def _ints(text: str) -> list[int]:
    pids = _whole_numbers(text, 1)
    if pids is None:
        raise argparse.ArgumentTypeError(f"expected process ids (1 or more) separated by commas, got {text!r}")
    return pids


def _mix(text: str) -> list[Stream]:
    try:
        return parse_mix(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _names(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in POLICIES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"policies are {', '.join(POLICIES)}; got {text!r}")
    return names


def _budgets(text: str) -> list[int]:
    budgets = _whole_numbers(text, 0)
    if budgets is None:
        raise argparse.ArgumentTypeError(f"token budgets are whole numbers, 0 or more (0: count only); got {text!r}")
    return budgets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every ``batchwire bench`` flag, on a parser of the caller's choosing (e.g. a subparser)."""
    _add_target_arguments(parser)
    _add_load_arguments(parser)
    _add_output_arguments(parser)
    _add_start_arguments(parser)


def _add_target_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument(
        "--url",
        action="append",
        metavar="URL",
        help=f'inference URL taking POST {{"input": ...}}; repeat to spread load round-robin (default {DEFAULT_URL})',
    )
    target.add_argument("--payload-field", default="input", help="JSON field that carries the input (default input)")
    target.add_argument(
        "--metrics-url",
        action="append",
        metavar="URL",
        help="Prometheus page to scrape before and after each rate; repeat for several processes "
        "(default: /metrics at the origin of each --url)",
    )
    target.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics")
    target.add_argument("--pids", type=_ints, default=[], help="comma list of server pids whose CPU to count")
    target.add_argument("--kafka-pids", type=_ints, default=[], help="Kafka broker pids, counted separately")
    target.add_argument("--redis-pids", type=_ints, default=[], help="Redis server pids, counted separately")
    target.add_argument(
        "--redis-url",
        help="the deployment's Redis, whose INFO commandstats give its commands per request "
        "(default with --start kafka: the stack's)",
    )


def _add_load_arguments(parser: argparse.ArgumentParser) -> None:
    load = parser.add_argument_group("load")
    load.add_argument("--rate", type=_floats, help="offered load in req/s; a comma list runs each in turn")
    load.add_argument(
        "--mix",
        action="append",
        type=_mix,
        metavar="STREAMS",
        help="instead of --rate: streams sent together, each [model/]tier:rate (e.g. high:200,low:6000 or "
        "a/normal:6000,b/normal:1000), reported per stream; repeat to run several mixes in turn",
    )
    load.add_argument("--duration", type=number, default=10.0, help="measured seconds per rate (default 10)")
    load.add_argument("--warmup", type=number, default=2.0, help="seconds sent before each window, not measured")
    load.add_argument("--pause", type=number, default=1.0, help="seconds between rates (default 1)")
    load.add_argument(
        "--concurrency-limit",
        type=int,
        default=1000,
        help="most requests outstanding; a send beyond it counts as error client_limit (default 1000)",
    )
    load.add_argument("--timeout", type=number, default=30.0, help="per-request timeout in s (default 30)")
    _add_input_arguments(load)
    load.add_argument(
        "--client",
        choices=("aiohttp", "raw"),
        default="aiohttp",
        help="HTTP client: aiohttp, or raw (minimal HTTP/1.1, ~3x less generator CPU per request)",
    )
    load.add_argument(
        "--lone",
        type=int,
        default=20,
        help="lone-request probe after the rates: this many requests one at a time, each to an idle "
        "service (0: none; default 20)",
    )
    load.add_argument(
        "--lone-gap-ms",
        type=number,
        default=300.0,
        help="idle time after each lone request's answer before the next is sent (default 300)",
    )
    load.add_argument(
        "--warm",
        type=int,
        default=20,
        help="warm-path probe after the lone one: this many requests one at a time, each sent the moment "
        "the previous answer arrives, so the processes on the path are still awake (0: none; default 20)",
    )
    load.add_argument(
        "--loop",
        choices=("auto", "uvloop", "asyncio"),
        default="auto",
        help="event loop for the generator (auto: uvloop when installed)",
    )


def _add_input_arguments(load: argparse._ArgumentGroup) -> None:
    """What each request sends, and how its answer is checked."""
    load.add_argument("--input-size", type=int, default=32, help="characters per (unique, random) input")
    load.add_argument("--seed", type=int, default=1, help="seed for arrival times and inputs")
    load.add_argument(
        "--zipf",
        metavar="DISTINCT:S",
        help="draw inputs from DISTINCT inputs with Zipf popularity s (e.g. 1000:1.1) instead of unique ones; "
        "shows what collapsing and the result cache save",
    )
    load.add_argument(
        "--lengths",
        metavar="MEDIAN:P99",
        help="inputs of log-normal lengths in words (one token each in most vocabularies), e.g. 16:256, "
        "instead of --input-size characters",
    )
    load.add_argument(
        "--expect",
        choices=("reverse", "none"),
        default="none",
        help="check each 200 answer: reverse = output must be the input reversed (sim backend)",
    )
    load.add_argument("--check", action="store_true", help="same as --expect reverse")


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    output = parser.add_argument_group("output")
    output.add_argument("--out", type=Path, help="directory for results.json and the plots")
    output.add_argument("--label", help="name for this run in tables, plots and --compare")
    output.add_argument(
        "--backend-latency-ms",
        type=number,
        help="draw this ideal latency on the latency plot (default with --start: --sim-latency-ms)",
    )
    output.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("A.json", "B.json"),
        help="print two results files side by side with ratios B/A; sends no load",
    )


def _add_start_arguments(parser: argparse.ArgumentParser) -> None:
    start = parser.add_argument_group("start the system under test")
    start.add_argument(
        "--start",
        choices=("embedded", "kafka", "echo", "echo-asgi"),
        help="start batchwire itself and stop it at the end (echo: a bare FastAPI echo endpoint, the CPU floor; "
        "echo-asgi: the same answers from a plain ASGI callable, the HTTP server's share of it)",
    )
    start.add_argument("--policy", choices=POLICIES, default="work-conserving", help="batching policy to start")
    start.add_argument("--policies", type=_names, help="comma list: run every rate once per policy (with --start)")
    start.add_argument(
        "--budgets",
        type=_budgets,
        help="comma list of token budgets: run every rate once per budget, the started service's "
        "--max-batch-tokens (0: count only; with --start)",
    )
    start.add_argument("--workers", type=int, default=1, help="GPU workers to start (default 1)")
    start.add_argument("--sim-latency-ms", type=number, default=100.0, help="simulated GPU latency (default 100)")
    start.add_argument(
        "--slow-worker-latency-ms",
        type=number,
        help="kafka mode: the first worker takes this latency instead (slow-worker figure)",
    )
    start.add_argument("--max-batch", type=int, help="passed to the batcher")
    start.add_argument("--max-wait-ms", type=number, help="passed to the batcher")
    start.add_argument("--gateways", type=int, default=1, help="kafka mode: gateway processes (default 1)")
    start.add_argument("--batchers", type=int, default=1, help="kafka mode: batcher processes (default 1)")
    start.add_argument(
        "--brokers",
        type=int,
        help="kafka mode: start a stack of this run's own with this many Kafka brokers (topics get RF min(3, N)) "
        "in a fresh state dir, and remove it at the end (default: the .batchwire stack)",
    )
    start.add_argument(
        "--redis-replicas",
        type=int,
        default=0,
        help="with --brokers: Redis replicas beside the primary (1 or more: 3 Sentinels, and the roles use the "
        "redis+sentinel:// URL; default 0)",
    )
    start.add_argument(
        "--keep-stack",
        action="store_true",
        help="kafka mode: leave Kafka + Redis running even if this run started them",
    )
    start.add_argument(
        "--sut-args",
        default="",
        help="more flags for the started gateways (or the embedded service), e.g. '--max-queue-depth 4000'",
    )
    start.add_argument("--ready-timeout", type=number, default=60.0, help="seconds to wait for readiness (default 60)")
    start.add_argument("--stop-grace", type=number, default=10.0, help="seconds between SIGTERM and SIGKILL")
    start.add_argument(
        "--result-ttl-s",
        type=number,
        default=RESULT_TTL_S,
        help="how long the started service keeps results (its --result-ttl-s; default %(default)g): the bench reads "
        "each answer at once, and a short life keeps a shared stack's Redis from filling up over many runs; at "
        "least the started gateways' --max-timeout-ms (30 s by default), or they refuse to start",
    )


DESCRIPTION = (
    "Open-loop (Poisson) load against an inference URL: latency from the scheduled send time, "
    "throughput, batch sizes, GPU busy share and CPU per request."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchwire bench", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``bench`` as a ``batchwire`` command."""
    add_arguments(sub.add_parser("bench", description=DESCRIPTION))


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Runs the command parsed by a parser that ``add_arguments`` set up; returns the exit status."""
    # Here, not at the top: ``command`` imports this module, and every ``batchwire`` start builds
    # the parser without needing the load generator.
    from batchwire.bench.command import execute

    return execute(args)
