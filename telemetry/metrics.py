"""Prometheus metrics shared by every role. Names are documented in docs/operations.md's metrics table.

Every metric lives in one registry per process, ``REGISTRY``: in embedded mode the gateway's ``/metrics``
shows all roles at once. A separate role serves only the families it writes (``GATEWAY_EXPORTS``,
``BATCHER_EXPORTS``, ``WORKER_EXPORTS``): another role's unwritten gauges would read 0 there, and a sum or
mean across the fleet would count them.
"""

from __future__ import annotations

import math
from collections import Counter as Tally
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from schemas.records import TaskState

REGISTRY = CollectorRegistry(auto_describe=True)

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.11,
    0.125,
    0.15,
    0.175,
    0.2,
    0.25,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
"""Up to minutes: ``--max-timeout-ms`` may be raised past its 30 s default (a model that generates for long)."""
_SHORT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100, 128, 256)

REQUESTS = Counter(
    "batchwire_requests",
    "HTTP requests by route and status code; route `edge`: the answers the HTTP edge writes before routing "
    "(connection cap, header and body limits and timeouts, invalid HTTP).",
    ["route", "status"],
    registry=REGISTRY,
)
TIER_SUBMITS = Counter(
    "batchwire_tier_submits",
    "Submits by model, priority tier and outcome: admitted or refused (503) by admission, answered (a "
    "synchronous 200 without an Idempotency-Key).",
    ["model", "priority", "outcome"],
    registry=REGISTRY,
)
REQUEST_LATENCY = Histogram(
    "batchwire_request_latency_seconds",
    "End-to-end latency of answered synchronous requests, accept to answer.",
    ["model"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
INFLIGHT = Gauge(
    "batchwire_inflight_requests",
    "Requests this gateway is handling now: a synchronous one until its answer, an asynchronous one until queued.",
    registry=REGISTRY,
)
REDIS_FULL = Gauge(
    "batchwire_redis_full",
    "1 while Redis refuses writes for memory (used memory over maxmemory, noeviction), as this gateway last "
    "read it: every submit is refused 503 unavailable.",
    registry=REGISTRY,
)
REDIS_REFUSES_WRITES = Gauge(
    "batchwire_redis_refuses_writes",
    "1 while Redis refuses writes (full, NOREPLICAS or MISCONF), as this gateway last asked it: every submit is "
    "refused 503 unavailable.",
    registry=REGISTRY,
)
READY = Gauge(
    "batchwire_ready",
    "1 for each readiness check that passes, 0 for each that does not: the checks /readyz names, as the "
    "gateway's latest /metrics or /readyz ran them (with every series 1, /readyz answers 200).",
    ["check"],
    registry=REGISTRY,
)
WATCHERS = Gauge(
    "batchwire_open_watchers",
    "Long-polls and event streams this gateway holds open (at most BATCHWIRE_MAX_WATCHERS).",
    registry=REGISTRY,
)
SPACING_WAIT = Histogram(
    "batchwire_spacing_wait_seconds",
    "How long a batch for a busy worker was sealed late to keep the workers' calls evenly spread.",
    ["model"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
QUEUE_WAIT = Histogram(
    "batchwire_queue_wait_seconds",
    "Time from acceptance until the request was sealed into a batch.",
    ["model"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
BATCH_SIZE = Histogram(
    "batchwire_batch_size", "Items per dispatched batch.", ["model"], buckets=_SIZE_BUCKETS, registry=REGISTRY
)
FLUSHES = Counter(
    "batchwire_flushes",
    "Sealed batches by reason (full, idle_worker, max_wait, deadline).",
    ["model", "reason"],
    registry=REGISTRY,
)
BATCH_WAIT = Histogram(
    "batchwire_batch_wait_seconds",
    "Time from sealing a batch until a worker took it from the bus (not its wait there behind the running "
    "call, which batchwire_request_stage_seconds_total's sealed_to_started counts too).",
    ["model"],
    buckets=_SHORT_BUCKETS,
    registry=REGISTRY,
)
BACKEND_CALL = Histogram(
    "batchwire_backend_call_seconds",
    "Duration of one batchstring call.",
    ["model", "backend"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
BACKEND_BATCH_LATENCY = Gauge(
    "batchwire_backend_batch_latency_seconds",
    "Latest measured backend latency for one batch size (bucketed to powers of two).",
    ["model", "backend", "batch_size"],
    registry=REGISTRY,
)
BACKEND_TOKENS = Counter(
    "batchwire_backend_tokens",
    "Tokens of the batches an hf backend ran: `input` (the inputs' own) and `padding` (added to line each "
    "batch up to its longest input); padding / (input + padding) is the share of compute spent on padding.",
    ["model", "kind"],
    registry=REGISTRY,
)
WORKER_BUSY = Counter(
    "batchwire_worker_busy_seconds", "Seconds each worker spent inside batchstring.", ["worker"], registry=REGISTRY
)
WORKER_CALL_RUNNING = Gauge(
    "batchwire_worker_call_running_seconds",
    "How long each worker's backend call has run so far, until its end counts it in the busy seconds (0 "
    "between calls): their sum grows with the time inside batchstring while a long or hung call runs.",
    ["worker"],
    registry=REGISTRY,
)
BACKEND_CPU = Counter(
    "batchwire_backend_cpu_seconds",
    "CPU seconds the backend's calling thread used inside batchstring (a model computing on the CPU).",
    ["worker"],
    registry=REGISTRY,
)
WORKER_BATCHES = Counter(
    "batchwire_worker_batches", "Batches each worker ran, by outcome.", ["worker", "outcome"], registry=REGISTRY
)
WORKER_ITEMS = Counter(
    "batchwire_worker_items",
    "Inputs of the batches each worker ran; over batchwire_worker_batches_total's ok and partial ones (a "
    "dead letter runs none), its mean batch size.",
    ["worker"],
    registry=REGISTRY,
)
REDELIVERED = Counter(
    "batchwire_batches_redelivered",
    "Batches a worker runs again that had been delivered before (a holder died or handed them back): each runs "
    "with care, in halves. A batch whose "
    "tasks had all ended meanwhile runs nothing and is not counted.",
    ["worker"],
    registry=REGISTRY,
)
TASKS_ENDED = Counter(
    "batchwire_tasks_ended",
    "Tasks ended, by their end status, each counted once: by the process whose write to the task store ended "
    "it (a write the store refused, the task having ended already, is not counted).",
    ["model", "status"],
    registry=REGISTRY,
)
RESULTS_UNREPLICATED = Counter(
    "batchwire_results_unreplicated",
    "Stores of task states (a worker's batch results, a batcher's ended requests) that fewer Redis replicas "
    "acknowledged in time than --redis-min-replicas (their Kafka record stays uncommitted and they are stored "
    "again).",
    ["process"],
    registry=REGISTRY,
)
STATED_RATE = Gauge(
    "batchwire_model_stated_rate",
    "Requests/s a model's workers state they take (full batches at their recent call time), as this "
    "gateway last read their credits; admission predicts waits by it until it has measured the drain rate.",
    ["model"],
    registry=REGISTRY,
)
REQUEST_LAG = Gauge(
    "batchwire_request_topic_lag", "Requests on the request topic not yet committed by a batcher.", registry=REGISTRY
)
REQUEST_LAG.set(math.nan)  # unknown until read: a gateway without the reader never sets it, and 0 reads as empty
PENDING = Gauge(
    "batchwire_batcher_pending",
    "Requests a batcher holds that are not yet handed to a worker.",
    ["model"],
    registry=REGISTRY,
)
CACHE_HITS = Counter(
    "batchwire_cache_hits",
    "Requests of a deterministic model answered from the result cache.",
    ["model"],
    registry=REGISTRY,
)
CACHE_MISSES = Counter(
    "batchwire_cache_misses",
    "Requests of a deterministic model the result cache had no answer for.",
    ["model"],
    registry=REGISTRY,
)
CACHE_BYPASSED = Counter(
    "batchwire_cache_bypassed",
    "Result cache reads and writes that failed (its store down or slow); the request went the normal way.",
    ["model"],
    registry=REGISTRY,
)
COLLAPSED = Counter(
    "batchwire_collapsed_requests",
    "Synchronous requests that joined an identical request's computation instead of starting their own.",
    ["model"],
    registry=REGISTRY,
)
BACKEND_ITEMS = Counter(
    "batchwire_backend_items",
    "Inputs handed to the backend (a deterministic model's duplicates within one batch count once).",
    ["model"],
    registry=REGISTRY,
)
REQUEST_STAGE = Counter(
    "batchwire_request_stage_seconds",
    "Seconds that inputs spent in each stage of the worker, summed over inputs (a batch of n adds n "
    "times its time): sealed_to_started (the batch formed, its call not begun) and call. Over "
    "batchwire_request_stage_inputs_total: the mean per input.",
    ["model", "stage"],
    registry=REGISTRY,
)
REQUEST_STAGE_INPUTS = Counter(
    "batchwire_request_stage_inputs",
    "Inputs that batchwire_request_stage_seconds counted, its denominator (batchwire_backend_items_total "
    "is not: a deterministic model runs duplicates once, and a failing batch's bisection runs inputs again).",
    ["model"],
    registry=REGISTRY,
)


def _exports(*families: MetricWrapperBase) -> CollectorRegistry:
    """A registry of ``families`` only, for one separate role's ``/metrics``: each metric is registered in it
    besides ``REGISTRY``, so one write shows in both. (``REGISTRY.restricted_registry`` filters by sample
    name, ``_total``, ``_bucket`` and the like, and drops a family until it has a sample.)"""
    registry = CollectorRegistry(auto_describe=True)
    for family in families:
        registry.register(family)
    return registry


EVERY_ROLE = (TASKS_ENDED,)
"""Families every role writes: each ends tasks through its task store."""
GATEWAY_EXPORTS = _exports(
    *EVERY_ROLE,
    REQUESTS,
    TIER_SUBMITS,
    REQUEST_LATENCY,
    INFLIGHT,
    REDIS_FULL,
    REDIS_REFUSES_WRITES,
    READY,
    WATCHERS,
    STATED_RATE,
    REQUEST_LAG,
    CACHE_HITS,
    CACHE_MISSES,
    CACHE_BYPASSED,
    COLLAPSED,
)
"""What a gateway over Kafka and Redis serves on ``/metrics``."""
BATCHER_EXPORTS = _exports(*EVERY_ROLE, SPACING_WAIT, QUEUE_WAIT, BATCH_SIZE, FLUSHES, PENDING, RESULTS_UNREPLICATED)
"""What a batcher process serves on ``--metrics-port``."""
WORKER_EXPORTS = _exports(
    *EVERY_ROLE,
    BATCH_WAIT,
    BACKEND_CALL,
    BACKEND_BATCH_LATENCY,
    BACKEND_TOKENS,
    WORKER_BUSY,
    WORKER_CALL_RUNNING,
    BACKEND_CPU,
    WORKER_BATCHES,
    WORKER_ITEMS,
    REDELIVERED,
    RESULTS_UNREPLICATED,
    BACKEND_ITEMS,
    REQUEST_STAGE,
    REQUEST_STAGE_INPUTS,
)
"""What a worker process serves on ``--metrics-port``."""
EXPORTS_BY_ROLE = {"gateway": GATEWAY_EXPORTS, "batcher": BATCHER_EXPORTS, "worker": WORKER_EXPORTS}
"""Each separate role's ``/metrics``; embedded mode serves all of ``REGISTRY``."""


def forget_worker(worker_id: str) -> None:
    """Removes a replaced worker's series. A worker process's series end with the process; in one process
    (embedded) each replacement would add its own for the life of the process."""
    for metric in (WORKER_BUSY, WORKER_CALL_RUNNING, BACKEND_CPU, WORKER_BATCHES, WORKER_ITEMS, REDELIVERED):
        metric.remove_by_labels({"worker": worker_id})


def count_ended(written: Iterable[TaskState]) -> None:
    """Counts in ``batchwire_tasks_ended`` the terminal states among ``written``: those the task store
    says this write applied, so that each end is counted once, whichever process writes it first."""
    ended = Tally((state.model, state.status.value) for state in written if state.status.terminal)
    for (model, status), count in ended.items():  # one labels() lookup per model and status, not per task
        TASKS_ENDED.labels(model=model, status=status).inc(count)


def show_readiness(checks: Mapping[str, bool]) -> None:
    """Sets ``batchwire_ready`` to ``checks``: one series per check, and none for a check not made this time
    (``models`` is named only while no model can be admitted), so that no stale 1 or 0 outlives its check."""
    (family,) = READY.collect()
    for stale in {sample.labels["check"] for sample in family.samples} - checks.keys():
        READY.remove(stale)
    for check, passes in checks.items():
        READY.labels(check=check).set(1 if passes else 0)
