"""Composition roots: each command builds its transports and services and runs them until a signal.

The services never learn which transports they got; this package is the only place that decides.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging

from batcher.service import Batcher
from batchwire import role_settings as rs
from batchwire.embedded import EmbeddedRuntime, EmbeddedSettings
from batchwire.fleet import Heartbeats, batcher_beat, gateway_beat, worker_beat
from batchwire.gateway_transports import GatewayTransports
from batchwire.operations import check_settings_agree, durability, ensure_role_topics
from batchwire.settings import SettingsError, SharedSettings
from batchwire.supervise import Parts, check_listen, run_loop, serve_http, serve_metrics, supervise
from gateway.edge.app import create_app
from gateway.edge.events import StreamsEnd
from gateway.service import Gateway
from gpu_worker.backends.base import Backend
from gpu_worker.backends.factory import make_backend
from gpu_worker.journal import BatchJournal
from gpu_worker.runner import EXIT_BACKEND_HUNG
from gpu_worker.settings import WorkerSettings
from gpu_worker.worker import HAND_BACK_WRITE_S, Worker
from telemetry import metrics
from transport.kafka.consumers import KafkaBatchConsumer, KafkaRequestConsumer
from transport.kafka.group import GroupTiming
from transport.kafka.producers import DEFAULT_REQUEST_TIMEOUT_MS, KafkaBatchProducer, KafkaDeadLetterProducer
from transport.memory.cache import MemoryResultCache
from transport.memory.limits import MemoryRateLimiter
from transport.redis.credits import RedisCreditPool
from transport.redis.deliveries import RedisDeliveryLog
from transport.redis.fleet import RedisFleet
from transport.redis.pools import PoolOptions, follower_of
from transport.redis.store import STORE_POOL, RedisTaskStore
from transport.replicas import ReplicaSettings, ReplicaWait

log = logging.getLogger("batchwire")


def embedded_settings(args: argparse.Namespace, shared: SharedSettings) -> EmbeddedSettings:
    """``batchwire up``'s settings: its batcher takes the request log's partitions, so it knows it
    serves each model alone (``Dispatcher.alone``) and spaces its busy workers."""
    return EmbeddedSettings(
        shared=shared,
        batcher=rs.batcher_settings(args, shared.request_partitions),
        workers_per_model=args.workers,
        batch_log=args.batch_log,
        worker=rs.worker_settings(args, shared.models[0]),
        max_store_bytes=args.max_store_bytes,
        deterministic_models=tuple(args.deterministic_models),
    )


def embedded_cache(settings: EmbeddedSettings, cache_ttl_s: float) -> MemoryResultCache | None:
    """``batchwire up``'s result cache (None when off): one process, so its answers are kept in its memory,
    within a share of the embedded memory budget."""
    if cache_ttl_s <= 0:
        return None
    return MemoryResultCache(max_bytes=settings.result_cache_max_bytes)


def run_embedded(args: argparse.Namespace) -> int:
    shared = rs.shared_settings(args)
    backends = rs.embedded_backend_settings(args, shared)
    count_tokens = rs.token_counter_of(args)
    embedded = embedded_settings(args, shared)
    runtime = EmbeddedRuntime(embedded, lambda model, index: make_backend(backends, model), count_tokens)
    settings = rs.gateway_settings(args, shared)
    check_listen(settings)  # before the models load
    limiter = None  # one process: the rate limits' buckets live in memory
    if settings.rate_limit_per_s > 0:
        limiter = MemoryRateLimiter(settings.rate_limit_per_s, settings.rate_limit_burst_tokens)
    cache = embedded_cache(embedded, settings.cache_ttl_s)
    gateway = Gateway(
        settings,
        runtime.producer,
        runtime.store,
        queue_depth=runtime.queue_depth,
        limiter=limiter,
        cache=cache,
        credits=runtime.credits,
        count_tokens=count_tokens,
    )
    runtime.load()
    log.info(
        "batchwire (embedded) on %s: models %s, %d workers each",
        settings.url,
        ",".join(shared.models),
        args.workers,
    )
    streams_end = StreamsEnd()
    runtime.heartbeats = Heartbeats(
        runtime.fleet, lambda window: [gateway_beat(gateway, window, streams_end.ended), *runtime.beats(window)]
    )
    app = create_app(gateway, runtime, streams_end, runtime.fleet, metrics.REGISTRY)  # every role in one process
    return serve_http(app, settings, args.log_level, args.gc_threshold, streams_end, runtime.failure)


def run_gateway(args: argparse.Namespace) -> int:
    shared = rs.process_shared_settings(args)
    settings = rs.gateway_settings(
        args,
        shared,
        request_linger_ms=args.request_linger_ms,
    )
    count_tokens = rs.token_counter_of(args)  # a tokenizer that cannot load stops it before Redis and Kafka
    check_listen(settings)
    transports = GatewayTransports(shared, settings)
    # Before serving (a refusal exits 2), and the batch topics too: the queue depth reads their end offsets,
    # which for a topic no batcher or worker created yet fail after seconds of aiokafka ERROR lines.
    asyncio.run(ensure_role_topics(shared, durability(args), True, shared.models))
    asyncio.run(check_settings_agree(shared, "gateway", settings.gateway_id))
    gateway = Gateway(
        settings,
        transports.producer,
        transports.store,
        queue_depth=transports.queue_depth,
        limiter=transports.limiter,
        cache=transports.cache,
        credits=transports.credits,
        count_tokens=count_tokens,
    )
    streams_end = StreamsEnd()
    transports.heartbeats = Heartbeats(
        transports.fleet,
        lambda window: [gateway_beat(gateway, window, streams_end.ended)],
        result_ttl_s=shared.result_ttl_s,
    )
    app = create_app(gateway, transports, streams_end, transports.fleet, metrics.GATEWAY_EXPORTS)
    log.info(
        "gateway %s on %s: namespace %s, models %s",
        settings.gateway_id,
        settings.url,
        shared.namespace,
        ",".join(shared.models),
    )
    return serve_http(app, settings, args.log_level, args.gc_threshold, streams_end)


def run_batcher(args: argparse.Namespace) -> int:
    shared = rs.process_shared_settings(args)
    settings = rs.batcher_settings(
        args,
        shared.request_partitions,
        batcher_id=args.batcher_id,
    )

    replicas = _replica_settings(args)
    count_tokens = rs.token_counter_of(args)

    async def main() -> int:
        bootstrap = shared.require_kafka()
        redis_url = shared.require_redis()
        await ensure_role_topics(shared, durability(args), True, shared.models)
        await check_settings_agree(shared, "batcher", settings.batcher_id)
        follower = follower_of(redis_url)  # one for every pool: the Sentinels are asked once a round
        store = RedisTaskStore(
            redis_url, shared.names, ttl_s=shared.result_ttl_s, pool=_replica_pool(replicas), follower=follower
        )
        credits = RedisCreditPool(redis_url, shared.names, follower=follower)
        producer = KafkaBatchProducer(bootstrap, shared.names)
        consumer = KafkaRequestConsumer(bootstrap, shared.names, timing=batcher_group_timing(args.session_timeout_ms))
        wait = ReplicaWait(store, replicas, settings.batcher_id, role="batcher", retry_max_s=settings.retry_max_s)
        batcher = Batcher(settings, consumer, producer, credits, store, replicas=wait, count_tokens=count_tokens)
        fleet = RedisFleet(redis_url, shared.names, follower=follower)
        heartbeats = Heartbeats(
            fleet, lambda window: [batcher_beat(batcher, shared.models, window)], result_ttl_s=shared.result_ttl_s
        )
        parts = Parts(store, credits, producer, fleet, heartbeats, batcher)

        async def start() -> None:
            await parts.start()
            heartbeats.beat_soon()  # shown serving now, not a period later
            log.info("batcher %s up (%s policy)", settings.batcher_id, settings.policy.name.value)

        return await supervise(start, parts.close, batcher.failed)

    serve_metrics(metrics.BATCHER_EXPORTS, args.metrics_port, args.metrics_host)
    return run_loop(main(), args.gc_threshold)


def batcher_group_timing(session_timeout_ms: int) -> GroupTiming:
    """The batchers' group timing. Its revocation lets the batches on their way land (each waits at most
    the batch producer's ack timeout) and then commits them (at most ``commit_timeout_s``)."""
    return GroupTiming.revoking_within(
        session_timeout_ms, DEFAULT_REQUEST_TIMEOUT_MS / 1000 + GroupTiming().commit_timeout_s
    )


def worker_group_timing(session_timeout_ms: int, drain_timeout_s: float) -> GroupTiming:
    """The workers' group timing. Its revocation lets the batches in hand end and commit (at most
    ``drain_timeout_s``), then records those it hands back (at most ``HAND_BACK_WRITE_S``)."""
    return GroupTiming.revoking_within(session_timeout_ms, drain_timeout_s + HAND_BACK_WRITE_S)


def _replica_settings(args: argparse.Namespace) -> ReplicaSettings:
    """``--redis-min-replicas`` and ``--redis-replica-wait-ms``, checked."""
    try:
        return ReplicaSettings(args.redis_min_replicas, args.redis_replica_wait_ms)
    except ValueError as err:
        raise SettingsError(str(err)) from err


def _replica_pool(replicas: ReplicaSettings) -> PoolOptions:
    """The task store's pool: a store's answer may come a replica wait later, so its socket waits that much longer."""
    return dataclasses.replace(STORE_POOL, socket_timeout_s=STORE_POOL.socket_timeout_s + replicas.wait_ms / 1000)


@dataclasses.dataclass
class _WorkerProcess:
    """One worker process's flags, resolved: its model, settings, replica wait and backend."""

    args: argparse.Namespace
    shared: SharedSettings
    settings: WorkerSettings
    replicas: ReplicaSettings
    backend: Backend

    async def main(self) -> int:
        args, shared, settings = self.args, self.shared, self.settings
        bootstrap, redis_url, names = shared.require_kafka(), shared.require_redis(), shared.names
        await ensure_role_topics(shared, durability(args), False, (settings.model,), dead_letters=True)
        await check_settings_agree(shared, "worker", settings.worker_id)
        follower = follower_of(redis_url)  # one for every pool: the Sentinels are asked once a round
        store = RedisTaskStore(
            redis_url, names, ttl_s=shared.result_ttl_s, pool=_replica_pool(self.replicas), follower=follower
        )
        credits = RedisCreditPool(redis_url, names, follower=follower)
        deliveries = RedisDeliveryLog(redis_url, names, ttl_s=shared.result_ttl_s, follower=follower)
        dead_letters = KafkaDeadLetterProducer(bootstrap, names)
        timing = worker_group_timing(args.session_timeout_ms, settings.drain_timeout_s)
        consumer = KafkaBatchConsumer(bootstrap, names, settings.model, timing=timing)
        worker = Worker(
            settings,
            consumer,
            credits,
            store,
            self.backend,
            BatchJournal(args.batch_log) if args.batch_log else None,
            deliveries=deliveries,
            dead_letters=dead_letters,
            replicas=ReplicaWait(store, self.replicas, settings.worker_id, retry_max_s=settings.retry_max_s),
        )
        fleet = RedisFleet(redis_url, names, follower=follower)
        heartbeats = Heartbeats(fleet, lambda window: [worker_beat(worker, window)], result_ttl_s=shared.result_ttl_s)
        parts = Parts(store, credits, deliveries, dead_letters, fleet, heartbeats, worker)

        async def start() -> None:
            await parts.start()
            heartbeats.beat_soon()  # shown serving now, not a period later
            log.info("worker %s up (model %s, backend %s)", settings.worker_id, settings.model, self.backend.name)

        return await supervise(
            start,
            parts.close,
            worker.failed,
            failure_code=lambda: EXIT_BACKEND_HUNG if worker.hung else 1,
            close_timeout_s=settings.drain_timeout_s + 30.0,
        )


def run_worker(args: argparse.Namespace) -> int:
    """A worker process; exits 0 after a signal, 75 when its backend hung (restart it), 1 after a crash."""
    shared = rs.process_shared_settings(args)
    model = args.model or shared.models[0]
    if model not in shared.models:
        raise SettingsError(f"--model {model!r} is not among --models {','.join(shared.models)}")
    if unknown := [name for name in args.deterministic_models if name not in shared.models]:
        raise SettingsError(
            f"--deterministic-models names {','.join(unknown)}, not among --models {','.join(shared.models)} "
            "(BATCHWIRE_DETERMINISTIC_MODELS)"
        )
    replicas = _replica_settings(args)
    settings = rs.worker_settings(args, model, args.worker_id)
    process = _WorkerProcess(args, shared, settings, replicas, make_backend(rs.backend_settings(args), model))
    serve_metrics(metrics.WORKER_EXPORTS, args.metrics_port, args.metrics_host)
    return run_loop(process.main(), args.gc_threshold)
