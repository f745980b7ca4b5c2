"""The flags of the roles (and of some tools), each with a ``BATCHWIRE_*`` variable behind it.

A flag that sets a field of a role's settings takes its default from that field
(``field_flag``), so the settings dataclasses are the one place a default is written.
Values come from, in order: the flag, the environment, ``.batchwire/stack.env`` (written by
``batchwire stack up``), the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

from batcher.settings import BatcherSettings
from batchwire.gc_tuning import DEFAULT as GC_DEFAULT
from batchwire.gc_tuning import Threshold, parse_threshold
from batchwire.settings import SharedSettings, env, number, stack_env_path
from gateway.settings import GatewaySettings
from gpu_worker.backends.factory import BackendSettings
from gpu_worker.settings import WorkerSettings
from telemetry.logs import LEVEL_NAMES
from telemetry.settings import ObservabilitySettings
from transport.replicas import parse_min_replicas


def models(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def boolean(text: str) -> bool:
    """An empty value is refused, as a number flag's is: read as false, ``BATCHWIRE_ADMIT_BY_WAIT=`` would
    turn off a setting that is on by default."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _min_replicas(text: str) -> int | None:
    try:
        return parse_min_replicas(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected auto or a number of replicas, got {text!r}") from err


def _gc_threshold(text: str) -> Threshold | None:
    try:
        return parse_threshold(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


class _FromVariable(str):
    """A flag's default read from its variable: argparse converts it with the flag's type, and a
    refusal then names the variable, since whoever set it passed no flag."""

    origin: str


def _naming_variables(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    name = getattr(kind, "__name__", repr(kind))

    def convert(text: str) -> Any:
        try:
            return kind(str(text))
        except (ValueError, TypeError, argparse.ArgumentTypeError) as err:
            if not isinstance(text, _FromVariable):
                raise  # a flag's own value: argparse words the refusal, by this function's name
            reason = err if isinstance(err, argparse.ArgumentTypeError) else f"invalid {name} value: {str(text)!r}"
            raise argparse.ArgumentTypeError(f"{reason} (from {text.origin}: correct it or unset it)") from err

    convert.__name__ = name
    return convert


_FLAG_OF_VARIABLE: dict[str, str] = {}
"""Each variable's flag, as ``add`` makes them: ``with_flags`` names the flag beside the variable."""
_VARIABLE = re.compile(r"(?<![\w-])BATCHWIRE_[A-Z0-9_]+(?!\w)")


def with_flags(message: str, parser: argparse.ArgumentParser) -> str:
    """``message`` naming the flags of ``parser`` where it names their settings: a setting's own check knows
    its field and variable (``max_inflight (BATCHWIRE_MAX_INFLIGHT)``), not the flag a caller gave.

    A field named before its variable, or a field name with an underscore anywhere, becomes its flag
    (``--max-inflight (BATCHWIRE_MAX_INFLIGHT)``); a variable whose flag is still not named gets it beside
    (``(--workers / BATCHWIRE_WORKERS)``). A message that names the flag already is left as it is."""
    for variable in dict.fromkeys(_VARIABLE.findall(message)):
        flag = _FLAG_OF_VARIABLE.get(variable)
        if (
            flag is None
            or flag not in parser._option_string_actions
            or re.search(rf"{re.escape(flag)}(?![\w-])", message)
        ):
            continue
        field = variable.removeprefix("BATCHWIRE_").lower()
        message = re.sub(rf"(?<![\w-]){field} \({variable}\)", f"{flag} ({variable})", message)
        if "_" in field:
            message = re.sub(rf"(?<![\w./-]){field}(?![\w/-])", flag, message)  # not in a path
        if not re.search(rf"{re.escape(flag)}(?![\w-])", message):
            message = re.sub(rf"(?<![\w-]){variable}(?!\w)", f"{flag} / {variable}", message)
    return message


def add(
    parser: argparse.ArgumentParser,
    flag: str,
    default: Any,
    kind: Callable[[str], Any],
    help_text: str,
    var: str | None = None,
) -> None:
    """Adds ``--flag`` whose default comes from ``BATCHWIRE_FLAG`` (or the stack file) when set; a
    ``float`` flag takes finite numbers only (``number``), and a ``boolean`` one alone means true."""
    var = var or "BATCHWIRE_" + flag.lstrip("-").replace("-", "_").upper()
    _FLAG_OF_VARIABLE[var] = flag
    kind = number if kind is float else kind
    raw = env(var)
    value = default
    if raw is not None:
        value = _FromVariable(raw)
        value.origin = var if var in os.environ else f"{var} in {stack_env_path()}"
    shown = "unset" if default is None else "none" if default == "" else default
    switch: dict[str, Any] = {"nargs": "?", "const": True} if kind is boolean else {}
    parser.add_argument(
        flag, default=value, type=_naming_variables(kind), help=f"{help_text} [{var}; default: {shown}]", **switch
    )


def default_of(settings: type[Any], name: str) -> Any:
    """The default a settings dataclass gives its field ``name`` (slotted dataclasses keep it only here)."""
    for item in dataclasses.fields(settings):
        if item.name == name:
            if item.default is dataclasses.MISSING:
                raise TypeError(f"{settings.__name__}.{name} has no plain default")
            return item.default
    raise TypeError(f"{settings.__name__} has no field {name}")


def field_flag(
    parser: argparse.ArgumentParser, settings: type[Any], name: str, kind: Callable[[str], Any], help_text: str
) -> None:
    """``--name-with-dashes`` for the field ``name`` of ``settings``, defaulting to the field's default."""
    add(parser, "--" + name.replace("_", "-"), default_of(settings, name), kind, help_text)


def shared(parser: argparse.ArgumentParser) -> None:
    field_flag(parser, SharedSettings, "namespace", str, "prefix of every topic and Redis key (isolates deployments)")
    add(
        parser,
        "--models",
        ",".join(default_of(SharedSettings, "models")),
        models,
        "comma-separated models served; requests name one",
    )
    field_flag(
        parser, SharedSettings, "request_partitions", int, "partitions of the request topic (split among models)"
    )
    field_flag(
        parser,
        SharedSettings,
        "batch_partitions",
        int,
        "partitions of each model's batch topic (max workers per model)",
    )
    field_flag(
        parser,
        SharedSettings,
        "result_ttl_s",
        float,
        "how long task states and results are kept (at least the gateways' --max-timeout-ms)",
    )
    add(parser, "--log-level", "info", str, LEVEL_NAMES)
    add(
        parser,
        "--gc-threshold",
        ",".join(map(str, GC_DEFAULT)),
        _gc_threshold,
        "Python GC thresholds young,middle,full after freezing start-up objects (off: Python's own)",
    )


def observability(parser: argparse.ArgumentParser) -> None:
    field_flag(parser, ObservabilitySettings, "log_format", str, "log lines as text (for a terminal) or json")
    field_flag(
        parser,
        ObservabilitySettings,
        "otlp_endpoint",
        str,
        "send OpenTelemetry traces over OTLP/HTTP to this collector, e.g. http://localhost:4318 (unset: no tracing)",
    )
    field_flag(
        parser,
        ObservabilitySettings,
        "trace_sample_ratio",
        float,
        "with --otlp-endpoint, the share of requests traced (a caller's traceparent decides for its own)",
    )


def kafka_redis(parser: argparse.ArgumentParser) -> None:
    add(parser, "--kafka-bootstrap", None, str, "Kafka bootstrap servers, HOST:PORT[,HOST:PORT]")
    add(
        parser,
        "--redis-url",
        None,
        str,
        "Redis URL: redis://HOST:PORT/DB, redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/DB] to follow "
        "Sentinel failovers, or redis+cluster://HOST:PORT[,HOST:PORT...] for a Redis Cluster",
    )


def replication(parser: argparse.ArgumentParser) -> None:
    add(
        parser,
        "--replication-factor",
        None,
        int,
        "copies of each partition of a topic this creates; an existing topic with fewer stops it (unset: the smaller "
        "of 3 and the brokers)",
    )
    add(
        parser,
        "--min-insync-replicas",
        None,
        int,
        "copies a write needs before Kafka acknowledges it, set on each topic this creates; an existing topic with "
        "fewer stops it (unset: replication factor - 1, at least 1)",
    )


def gateway_http(parser: argparse.ArgumentParser) -> None:
    """Where the gateway listens, and what one HTTP request may be."""
    g = GatewaySettings
    field_flag(parser, g, "host", str, "address the HTTP server binds")
    field_flag(parser, g, "port", int, "port the HTTP server listens on")
    add(parser, "--gateway-id", None, str, "unique id of this gateway process (random when unset)")
    add(parser, "--default-model", None, str, "model used when a request names none (first of --models)")
    field_flag(parser, g, "default_timeout_ms", int, "deadline of a request that sets no timeout_ms")
    field_flag(parser, g, "max_timeout_ms", int, "the longest timeout_ms a request may ask for")
    field_flag(
        parser, g, "max_input_chars", int, "longest accepted input, in characters (and at most about 1 MiB in UTF-8)"
    )
    field_flag(parser, g, "max_body_bytes", int, "largest accepted request body")
    field_flag(
        parser, g, "max_body_bytes_in_flight", int, "bytes all bodies being read may hold at once (past it: 503)"
    )
    field_flag(parser, g, "max_header_bytes", int, "largest request line plus headers; beyond it 431 and a close")
    field_flag(parser, g, "header_timeout_s", float, "a request's headers must come within this; then 408 and a close")
    field_flag(parser, g, "body_timeout_s", float, "a request's body must come within this of its headers; then 408")
    field_flag(
        parser,
        g,
        "max_connections",
        int,
        "open HTTP connections; at the cap a new one replaces the longest waiting without a request, else gets 503",
    )


def gateway_admission(parser: argparse.ArgumentParser) -> None:
    """How many callers the gateway holds, when it refuses, and whom it lets in."""
    g = GatewaySettings
    field_flag(parser, g, "max_inflight", int, "requests one gateway holds at once before answering 503")
    field_flag(parser, g, "max_watchers", int, "event streams and long-polls one gateway holds open before a 503")
    field_flag(
        parser, g, "max_watchers_per_client", int, "of --max-watchers, what one client (API key, or address) may hold"
    )
    field_flag(parser, g, "max_poll_wait_s", float, "the longest a long-poll waits (a longer ?wait= waits this long)")
    field_flag(
        parser,
        g,
        "max_queue_depth",
        int,
        "requests of one model accepted and not yet at a worker before its submits get 503 (0: no limit)",
    )
    field_flag(
        parser, g, "queue_fraction_normal", float, "share of --max-queue-depth past which 'normal' requests get 503"
    )
    field_flag(parser, g, "queue_fraction_low", float, "share of --max-queue-depth past which 'low' requests get 503")
    field_flag(
        parser,
        g,
        "admit_by_wait",
        boolean,
        "refuse (503) a request whose deadline its model's queue cannot meet, from the measured drain rate",
    )
    field_flag(
        parser, g, "stall_s", float, "a model with requests waiting and no batch taken this long is stalled (503)"
    )
    field_flag(
        parser,
        g,
        "reply_recheck_s",
        float,
        "a synchronous caller without its reply this long is looked up in the store (then at 2x, 4x, up to 8x), "
        "and its connection watched; a task still queued or batched this long past its deadline is ended expired "
        "by a gateway that reads it",
    )
    field_flag(
        parser, g, "stream_recheck_s", float, "a long-poll or event stream without a change this long re-reads its task"
    )
    field_flag(
        parser,
        g,
        "sse_ping_s",
        float,
        "an event stream quiet this long gets a keep-alive comment (at most 50; keep it under a proxy's idle timeout)",
    )
    field_flag(
        parser, g, "sse_max_s", float, "an event stream closes after this long; its client resumes it (Last-Event-ID)"
    )
    field_flag(parser, g, "rate_limit_per_s", float, "submits per second per client, shared by all gateways (0: off)")
    field_flag(parser, g, "rate_limit_burst", int, "submits a client may save up (0: one second's worth of the rate)")
    field_flag(
        parser,
        g,
        "trust_client_id",
        boolean,
        "without API keys, rate-limit by the X-Client-Id header instead of the peer address (only behind a proxy "
        "that sets it)",
    )
    api_keys(parser)


def answer_sharing(parser: argparse.ArgumentParser) -> None:
    """Which models' requests share answers (collapsing, the result cache), and for how long."""
    g = GatewaySettings
    deterministic_models(parser)
    add(
        parser,
        "--public-models",
        ",".join(default_of(g, "public_models")),
        models,
        "comma-separated deterministic models whose answers every API key shares (others: per key)",
    )
    field_flag(
        parser,
        g,
        "cache_ttl_s",
        float,
        "serve a deterministic model's completed answers from a cache this long (0: off)",
    )


def deterministic_models(parser: argparse.ArgumentParser) -> None:
    add(
        parser,
        "--deterministic-models",
        ",".join(default_of(GatewaySettings, "deterministic_models")),
        models,
        "comma-separated models whose answer depends on the input alone: only their identical requests are "
        "collapsed and cached, and their workers run a batch's duplicate inputs once",
    )


def api_keys(parser: argparse.ArgumentParser) -> None:
    add(
        parser,
        "--api-keys",
        None,
        str,
        "comma-separated API keys, or sha256:<hex> digests of them; prefer the variable or the file to the flag",
    )
    add(
        parser,
        "--api-keys-file",
        None,
        str,
        "file of API keys (or sha256:<hex> digests), one a line; 'operator <key>' marks a key that may read "
        "/metrics and the fleet",
    )


def batching(parser: argparse.ArgumentParser) -> None:
    add(parser, "--policy", "work-conserving", str, "flush policy: work-conserving or classic (size-or-timeout)")
    add(parser, "--max-batch", None, int, "items per batch at most (work-conserving: 100, classic: 32)")
    add(parser, "--max-wait-ms", None, float, "age that seals a batch (work-conserving: 1000, classic: 50)")
    add(
        parser,
        "--reserve-ms",
        None,
        float,
        "work-conserving at light load: hold a just-claimed idle worker up to this long for a fresh arrival "
        "when only requests that already waited are there (default 50; 0: off; classic refuses it)",
    )
    field_flag(
        parser,
        BatcherSettings,
        "spacing_margin_ms",
        float,
        "keep busy workers' calls evenly spread, sealing a batch this long before its call should start, in a "
        "batcher that holds all of the model's request partitions (-1: off)",
    )
    field_flag(
        parser,
        BatcherSettings,
        "tier_min_share",
        float,
        "share of each batch's slots a priority tier earns while it waits behind a higher one (0: strict priority)",
    )


def token_budget(parser: argparse.ArgumentParser) -> None:
    """The token budget: batchers keep every batch's padded tokens within it, gateways refuse an input over it."""
    field_flag(
        parser,
        GatewaySettings,
        "max_batch_tokens",
        int,
        "padded tokens per batch at most (inputs x the longest, in tokens); batches group inputs of like lengths "
        "and an input over it gets 413 (0: count items only)",
    )
    add(
        parser,
        "--tokenizer",
        None,
        str,
        "with --max-batch-tokens: the model's tokenizer.json, or its directory (up: default --model-path; "
        "unset: one token per 4 UTF-8 bytes)",
    )


def backend(parser: argparse.ArgumentParser) -> None:
    b = BackendSettings
    field_flag(parser, b, "backend", str, "model backend: sim (reversed input) or hf (transformers)")
    field_flag(parser, b, "sim_latency_ms", float, "sim backend: latency of one call, whatever the batch size")
    field_flag(parser, b, "model_path", str, "hf backend: local directory of the checkpoint (nothing is downloaded)")
    field_flag(
        parser,
        b,
        "hf_task",
        str,
        "hf backend: generate or embed (embed pools as the model's sentence-transformers layout says, by the "
        "mean or the CLS token, L2-normalized unless the layout has no Normalize; a Dense layer or another "
        "pooling is refused at load)",
    )
    field_flag(parser, b, "hf_max_new_tokens", int, "hf backend: tokens generated per input")
    field_flag(parser, b, "hf_max_input_tokens", int, "hf backend: longest input in tokens (default: the model's)")
    field_flag(parser, b, "hf_truncate", boolean, "hf backend: truncate long inputs instead of rejecting them")
    field_flag(parser, b, "hf_num_threads", int, "hf backend on CPU: torch threads (default: cores - 1)")
    field_flag(parser, b, "device", str, "hf backend: auto, cpu, cuda or cuda:N")
    field_flag(parser, b, "dtype", str, "hf backend: auto, float32, float16 or bfloat16")


def worker(parser: argparse.ArgumentParser) -> None:
    backend(parser)
    w = WorkerSettings
    field_flag(parser, w, "batch_log", str, "append one JSON line per batch run to this file (audits, tests)")
    field_flag(
        parser, w, "credit_ttl_s", float, "an idle worker's credit lives this long; it is renewed while unclaimed"
    )
    field_flag(
        parser,
        w,
        "max_deliveries",
        int,
        "an input in flight alone at this many worker deaths is dead-lettered (a batch of one fetched behind the "
        "call that killed its worker counts as alone: at 1 it is dead-lettered without having run; a batch a worker "
        "hands back on a stop or a rebalance is no death)",
    )
    field_flag(parser, w, "hang_factor", float, "a backend call this many times its expected latency is hung (0: off)")
    field_flag(parser, w, "hang_min_s", float, "the hang limit is never shorter than this")
    field_flag(parser, w, "expected_latency_ms", float, "expected backend call latency (default: moving average)")
    field_flag(
        parser, w, "credit_lead_ms", float, "offer the next credit this long before the call should end (0: off)"
    )
    field_flag(
        parser, w, "credit_lead_full_ms", float, "the lead while the running batch is at least half full (0: off)"
    )
    field_flag(
        parser, w, "drain_timeout_s", float, "on SIGTERM or a rebalance, how long the batches in hand may still run"
    )
    field_flag(
        parser,
        BackendSettings,
        "sim_hang_on",
        str,
        "sim backend (fault tests): hang forever on an input containing this",
    )
    field_flag(
        parser,
        BackendSettings,
        "sim_crash_on",
        str,
        "sim backend (fault tests): exit 70 at once on an input containing this",
    )
    field_flag(
        parser,
        w,
        "max_output_bytes",
        int,
        "a longer output (UTF-8) fails its task with output_too_large instead of being stored (0: no limit)",
    )


def redis_replica_wait(parser: argparse.ArgumentParser) -> None:
    """How a worker (a batch's results) and a batcher (the requests it ends) wait for Redis replicas."""
    add(
        parser,
        "--redis-min-replicas",
        "auto",
        _min_replicas,
        "Redis replicas that must hold the task states this stores (a worker's results, a batcher's expired "
        "requests) before the Kafka offset behind them is committed (auto: 1 while the primary has a replica in "
        "sync, else 0)",
    )
    add(parser, "--redis-replica-wait-ms", 1000, int, "how long one store of task states waits for those replicas")


METRICS_HOST = "127.0.0.1"
"""The default ``--metrics-host``: this machine alone."""


def metrics_endpoint(parser: argparse.ArgumentParser) -> None:
    """Where a batcher or worker process serves its Prometheus ``/metrics``."""
    add(parser, "--metrics-port", 0, int, "serve Prometheus /metrics on this port (0: off)")
    add(
        parser,
        "--metrics-host",
        METRICS_HOST,
        str,
        "address /metrics listens on, with --metrics-port (0.0.0.0 for a Prometheus in another container or host)",
    )


def worker_process(parser: argparse.ArgumentParser) -> None:
    """The flags only a worker process has: its identity and its endpoints."""
    add(parser, "--model", None, str, "the model this worker serves (first of --models)")
    add(parser, "--worker-id", None, str, "unique id of this worker (random when unset)")
    add(parser, "--max-batch", None, int, "largest batch this worker's backend takes (sim: 100, hf: 32)")
    metrics_endpoint(parser)
    add(parser, "--session-timeout-ms", 3000, int, "Kafka group session: a dead worker's batches move after this")
