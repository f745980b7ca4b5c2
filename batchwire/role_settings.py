"""Each role's typed settings, built from its parsed flags.

A role reads only flags its own command defines; what another command lacks (the embedded mode
has no Kafka) is passed in by name, never probed for.
"""

from __future__ import annotations

import argparse
from typing import Any

from batcher.policy import FlushPolicy, PolicyName
from batcher.settings import BatcherSettings
from batcher.tokens import TokenCounter, token_counter
from batchwire.settings import SettingsError, SharedSettings
from gateway.edge.auth import load_api_keys
from gateway.settings import GatewaySettings
from gpu_worker.backends.factory import BackendSettings
from gpu_worker.journal import BatchJournal
from gpu_worker.settings import WorkerSettings

GATEWAY_FLAGS = (
    "host",
    "port",
    "default_timeout_ms",
    "max_timeout_ms",
    "max_input_chars",
    "max_body_bytes",
    "max_body_bytes_in_flight",
    "max_inflight",
    "max_watchers",
    "max_watchers_per_client",
    "max_poll_wait_s",
    "max_queue_depth",
    "queue_fraction_normal",
    "queue_fraction_low",
    "admit_by_wait",
    "stall_s",
    "reply_recheck_s",
    "stream_recheck_s",
    "sse_ping_s",
    "sse_max_s",
    "rate_limit_per_s",
    "rate_limit_burst",
    "trust_client_id",
    "max_header_bytes",
    "header_timeout_s",
    "body_timeout_s",
    "max_connections",
    "deterministic_models",
    "public_models",
    "cache_ttl_s",
    "max_batch_tokens",
)
"""GatewaySettings fields set one to one from the flag of the same name."""

BACKEND_FLAGS = (
    "backend",
    "sim_latency_ms",
    "max_batch",
    "model_path",
    "hf_task",
    "hf_max_new_tokens",
    "hf_max_input_tokens",
    "hf_truncate",
    "hf_num_threads",
    "device",
    "dtype",
    "sim_hang_on",
    "sim_crash_on",
)

WORKER_FLAGS = (
    "batch_log",
    "credit_ttl_s",
    "max_deliveries",
    "hang_factor",
    "hang_min_s",
    "expected_latency_ms",
    "credit_lead_ms",
    "credit_lead_full_ms",
    "drain_timeout_s",
    "max_output_bytes",
)


def shared_settings(
    args: argparse.Namespace, *, kafka_bootstrap: str | None = None, redis_url: str | None = None
) -> SharedSettings:
    return SharedSettings(
        namespace=args.namespace,
        models=tuple(args.models),
        request_partitions=args.request_partitions,
        batch_partitions=args.batch_partitions,
        result_ttl_s=args.result_ttl_s,
        kafka_bootstrap=kafka_bootstrap,
        redis_url=redis_url,
    )


def process_shared_settings(args: argparse.Namespace) -> SharedSettings:
    """A Kafka + Redis role's shared settings (its command has ``--kafka-bootstrap`` and ``--redis-url``)."""
    return shared_settings(args, kafka_bootstrap=args.kafka_bootstrap, redis_url=args.redis_url)


def _policy(args: argparse.Namespace) -> FlushPolicy:
    if args.reserve_ms and args.policy == PolicyName.CLASSIC:
        # Only work-conserving holds an idle worker in reserve: classic seals by size or age alone.
        raise SettingsError(
            f"--reserve-ms (BATCHWIRE_RESERVE_MS) is {args.reserve_ms:g}, and --policy (BATCHWIRE_POLICY) is "
            "classic, which holds no worker in reserve: use work-conserving, or leave the reserve unset"
        )
    if args.policy not in {name.value for name in PolicyName}:
        raise SettingsError(f"--policy (BATCHWIRE_POLICY) is {args.policy!r}; use work-conserving or classic")
    try:
        return FlushPolicy.named(args.policy, args.max_batch, args.max_wait_ms, args.reserve_ms, args.max_batch_tokens)
    except ValueError as err:  # a bound of a batching flag, which its message names
        raise SettingsError(str(err)) from err


def batcher_settings(
    args: argparse.Namespace,
    request_partitions: int,
    *,
    batcher_id: str | None = None,
) -> BatcherSettings:
    """The keywords left None keep BatcherSettings' defaults."""
    kwargs: dict[str, Any] = {}
    if batcher_id:
        kwargs["batcher_id"] = batcher_id
    try:
        return BatcherSettings(
            policy=_policy(args),
            models=tuple(args.models),
            request_partitions=request_partitions,
            spacing_margin_ms=args.spacing_margin_ms,
            tier_min_share=args.tier_min_share,
            **kwargs,
        )
    except ValueError as err:
        raise SettingsError(str(err)) from err


def gateway_settings(args: argparse.Namespace, shared: SharedSettings, **transport: Any) -> GatewaySettings:
    """``transport``: the fields only the Kafka gateway's command sets (its linger)."""
    kwargs: dict[str, Any] = {name: getattr(args, name) for name in GATEWAY_FLAGS}
    kwargs.update(transport, models=shared.models, default_model=args.default_model or shared.models[0])
    if args.gateway_id:
        kwargs["gateway_id"] = args.gateway_id
    try:
        keys = load_api_keys(args.api_keys, args.api_keys_file)
        kwargs["api_keys"], kwargs["operator_keys"] = keys.digests, keys.operators
        kwargs["key_tiers"] = keys.tiers
        args.api_keys = None  # only digests are kept (the environment is the operator's: use sha256: there)
        settings = GatewaySettings(**kwargs)
    except ValueError as err:
        raise SettingsError(str(err)) from err
    _check_result_ttl(shared, settings)
    return settings


def _check_result_ttl(shared: SharedSettings, settings: GatewaySettings) -> None:
    """A task is first stored when it is queued and kept ``result_ttl_s`` from then until it ends: a TTL
    shorter than the longest deadline drops a task still waiting for a worker (its polls 404, and its
    end, written afresh without its API key's owner, is unreadable to the caller)."""
    if shared.result_ttl_s * 1000 < settings.max_timeout_ms:
        raise SettingsError(
            f"--result-ttl-s (BATCHWIRE_RESULT_TTL_S) is {shared.result_ttl_s:g} s, shorter than the longest "
            f"timeout_ms a request may ask for ({settings.max_timeout_ms} ms, --max-timeout-ms / "
            "BATCHWIRE_MAX_TIMEOUT_MS): a task still waiting past the TTL would be dropped before it ends; "
            f"raise --result-ttl-s to at least {settings.max_timeout_ms / 1000:g} s or lower --max-timeout-ms"
        )


def backend_settings(args: argparse.Namespace) -> BackendSettings:
    try:
        return BackendSettings(**{name: getattr(args, name) for name in BACKEND_FLAGS})
    except ValueError as err:
        raise SettingsError(str(err)) from err


def embedded_backend_settings(args: argparse.Namespace, shared: SharedSettings) -> BackendSettings:
    """``up``'s backend settings, which every model it serves is built from: one ``--model-path`` loaded
    under several names would be one checkpoint answering for models the caller takes to be different."""
    backend = backend_settings(args)
    if backend.backend == "hf" and len(shared.models) > 1:
        raise SettingsError(
            f"batchwire up serves one hf model (one --model-path), and --models (BATCHWIRE_MODELS) names "
            f"{len(shared.models)} ({', '.join(shared.models)}): each would load {backend.model_path} under its own "
            "name; name one model, or run a worker per model, each with its own --model and --model-path"
        )
    return backend


def worker_settings(args: argparse.Namespace, model: str, worker_id: str | None = None) -> WorkerSettings:
    """A worker's settings from its flags (in embedded mode, the template of every worker's)."""
    kwargs: dict[str, Any] = {name: getattr(args, name) for name in WORKER_FLAGS}
    _check_batch_log(args.batch_log)
    if worker_id:
        kwargs["worker_id"] = worker_id
    try:
        return WorkerSettings(model=model, deterministic=model in args.deterministic_models, **kwargs)
    except ValueError as err:
        raise SettingsError(str(err)) from err


def _check_batch_log(path: str | None) -> None:
    """Opens the batch log once: one that cannot be written stops the role before it starts, naming the
    flag, rather than in a traceback when its workers are built."""
    if not path:
        return
    try:
        BatchJournal(path).close()
    except OSError as err:
        raise SettingsError(f"cannot append to --batch-log {path}: {err.strerror} (BATCHWIRE_BATCH_LOG)") from err


def token_counter_of(args: argparse.Namespace) -> TokenCounter:
    """The counter for the token budget: ``--tokenizer``, else the hf backend's ``--model-path`` (where
    this command has it), else the estimate."""
    if args.tokenizer and args.max_batch_tokens <= 0:
        raise SettingsError(
            "--tokenizer (BATCHWIRE_TOKENIZER) counts tokens for a token budget, and --max-batch-tokens "
            "(BATCHWIRE_MAX_BATCH_TOKENS) is 0: set the budget, or leave the tokenizer unset"
        )
    path = args.tokenizer or getattr(args, "model_path", None)
    try:
        return token_counter(path if args.max_batch_tokens > 0 else None)
    except ValueError as err:
        raise SettingsError(f"{err} (--tokenizer)") from err
