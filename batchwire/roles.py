"""Composition roots: each command builds its transports and services and runs them until a signal.

The services never learn which transports they got; this module is the only place that decides.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from batcher.policy import FlushPolicy
from batcher.settings import BatcherSettings
from batchwire.gc_tuning import Threshold, tune_gc
from batchwire.settings import SettingsError, SharedSettings

log = logging.getLogger("batchwire")


# settings from parsed flags ---------------------------------------------------------------------
def shared_settings(args: argparse.Namespace) -> SharedSettings:
    return SharedSettings(
        namespace=args.namespace,
        models=tuple(args.models),
        request_partitions=args.request_partitions,
        batch_partitions=args.batch_partitions,
        result_ttl_s=args.result_ttl_s,
        kafka_bootstrap=getattr(args, "kafka_bootstrap", None),
        redis_url=getattr(args, "redis_url", None),
    )


def _policy(args: argparse.Namespace) -> FlushPolicy:
    try:
        return FlushPolicy.named(args.policy, args.max_batch, args.max_wait_ms)
    except ValueError as err:
        raise SettingsError(f"{err} (--policy is work-conserving or classic)") from err


def batcher_settings(
    args: argparse.Namespace, request_partitions: int = 0, *, keep_credit: bool = True
) -> BatcherSettings:
    kwargs: dict[str, Any] = {
        "policy": _policy(args),
        "models": tuple(args.models),
        "request_partitions": request_partitions,
        "spacing_margin_ms": args.spacing_margin_ms,
    }
    if not keep_credit:  # embedded: a claim costs no round trip there
        kwargs["keep_credit_s"] = 0.0
    if getattr(args, "batcher_id", None):
        kwargs["batcher_id"] = args.batcher_id
    if hasattr(args, "read_pace_ms"):  # a batcher process: reads are fetch round trips
        kwargs["read_pace_ms"] = args.read_pace_ms
    return BatcherSettings(**kwargs)


def gateway_settings(args: argparse.Namespace, shared: SharedSettings) -> Any:
    from gateway.auth import load_api_keys
    from gateway.settings import GatewaySettings

    kwargs: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "models": shared.models,
        "default_model": args.default_model or shared.models[0],
        "default_timeout_ms": args.default_timeout_ms,
        "max_timeout_ms": args.max_timeout_ms,
        "max_input_chars": args.max_input_chars,
        "max_body_bytes": args.max_body_bytes,
        "max_inflight": args.max_inflight,
        "max_watchers": args.max_watchers,
        "max_queue_depth": args.max_queue_depth,
        "admit_by_wait": args.admit_by_wait,
        "stall_s": args.stall_s,
        "reply_recheck_s": args.reply_recheck_s,
        "stream_recheck_s": args.stream_recheck_s,
        "rate_limit_per_s": args.rate_limit_per_s,
        "rate_limit_burst": args.rate_limit_burst,
        "trust_client_id": args.trust_client_id,
        "max_header_bytes": args.max_header_bytes,
        "header_timeout_s": args.header_timeout_s,
        "body_timeout_s": args.body_timeout_s,
        "max_connections": args.max_connections,
    }
    if hasattr(args, "express"):
        kwargs["express"] = args.express
        kwargs["express_record_delay_ms"] = args.express_record_delay_ms
    if hasattr(args, "request_linger_ms"):
        kwargs["request_linger_ms"] = args.request_linger_ms
    if args.gateway_id:
        kwargs["gateway_id"] = args.gateway_id
    try:
        keys = load_api_keys(args.api_keys, args.api_keys_file)
        kwargs["api_keys"], kwargs["operator_keys"] = keys.digests, keys.operators
        args.api_keys = None  # only digests are kept (the environment is the operator's: use sha256: there)
        return GatewaySettings(**kwargs)
    except ValueError as err:
        raise SettingsError(str(err)) from err


def backend_settings(args: argparse.Namespace) -> Any:
    from gpu_worker.backends.factory import BackendSettings

    return BackendSettings(
        backend=args.backend,
        sim_latency_ms=args.sim_latency_ms,
        max_batch=args.max_batch,
        model_path=args.model_path,
        hf_task=args.hf_task,
        hf_max_new_tokens=args.hf_max_new_tokens,
        hf_max_input_tokens=args.hf_max_input_tokens,
        hf_truncate=args.hf_truncate,
        hf_num_threads=args.hf_num_threads,
        device=args.device,
        dtype=args.dtype,
        sim_hang_on=args.sim_hang_on,
        sim_crash_on=args.sim_crash_on,
    )


def worker_settings(args: argparse.Namespace, model: str, worker_id: str | None = None) -> Any:
    """A worker's settings from its flags (in embedded mode, the template of every worker's)."""
    from gpu_worker.settings import WorkerSettings

    kwargs: dict[str, Any] = {
        "model": model,
        "batch_log": args.batch_log,
        "credit_ttl_s": args.credit_ttl_s,
        "max_deliveries": args.max_deliveries,
        "hang_factor": args.hang_factor,
        "hang_min_s": args.hang_min_s,
        "expected_latency_ms": args.expected_latency_ms,
        "credit_lead_ms": args.credit_lead_ms,
        "credit_lead_full_ms": args.credit_lead_full_ms,
        "drain_timeout_s": args.drain_timeout_s,
        "max_output_bytes": args.max_output_bytes,
    }
    if worker_id:
        kwargs["worker_id"] = worker_id
    try:
        return WorkerSettings(**kwargs)
    except ValueError as err:
        raise SettingsError(str(err)) from err


def _serve_http(app: Any, settings: Any, log_level: str, gc_threshold: Threshold | None, streams_end: Any) -> int:
    """Serves ``app`` with uvicorn, under the gateway's HTTP limits (``gateway.http_limits``); the first
    shutdown signal also ends ``streams_end``'s event streams, which would hold the graceful shutdown."""
    import uvicorn

    from gateway.http_limits import connection_cap, limited_http_protocol

    tune_gc(gc_threshold)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        access_log=False,
        loop="uvloop",
        http=limited_http_protocol(settings, connection_cap(settings.max_connections)),
        lifespan="on",
        proxy_headers=False,  # bound to loopback by default; a proxy in front sets X-Client-Id
        server_header=False,
        date_header=False,
        timeout_graceful_shutdown=30,
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            streams_end.end()
            super().handle_exit(sig, frame)

    server = Server(config)
    server.run()
    return 0 if server.started else 1


# embedded ----------------------------------------------------------------------------------------
def run_embedded(args: argparse.Namespace) -> int:
    from batchwire.embedded import EmbeddedRuntime, EmbeddedSettings
    from gateway.app import create_app
    from gateway.events import StreamsEnd
    from gateway.service import Gateway
    from gpu_worker.backends.factory import make_backend

    shared = shared_settings(args)
    backends = backend_settings(args)
    runtime = EmbeddedRuntime(
        EmbeddedSettings(
            shared=shared,
            batcher=batcher_settings(args, shared.request_partitions, keep_credit=False),
            workers_per_model=args.workers,
            batch_log=args.batch_log,
            worker=worker_settings(args, shared.models[0]),
            max_store_bytes=args.max_store_bytes,
        ),
        lambda model, index: make_backend(backends, model),
    )
    settings = gateway_settings(args, shared)
    limiter = None  # one process: the rate limits' buckets live in memory
    if settings.rate_limit_per_s > 0:
        from transport.memory.bus import MemoryRateLimiter

        limiter = MemoryRateLimiter(settings.rate_limit_per_s, settings.rate_limit_burst_tokens)
    gateway = Gateway(settings, runtime.producer, runtime.store, queue_depth=runtime.queue_depth, limiter=limiter)
    log.info(
        "batchwire (embedded) on http://%s:%d: models %s, %d workers each",
        settings.host,
        settings.port,
        ",".join(shared.models),
        args.workers,
    )
    streams_end = StreamsEnd()
    app = create_app(gateway, runtime, streams_end)
    return _serve_http(app, settings, args.log_level, args.gc_threshold, streams_end)


# Kafka + Redis roles -----------------------------------------------------------------------------
def _durability(args: argparse.Namespace) -> Any:
    from infra.topic_checks import Durability

    return Durability(args.replication_factor, args.min_insync_replicas)


async def _ensure_topics(
    shared: SharedSettings,
    durability: Any,
    request_topic: bool,
    models: tuple[str, ...],
    *,
    dead_letters: bool = False,
) -> None:
    """Creates the role's topics with the asked replication, after checking them all (exit 2 if one falls short)."""
    from infra.topics import TopicConfigError, ensure_topics

    names = shared.names
    topics: dict[str, int] = {}
    if request_topic:
        topics[names.request_topic] = shared.request_partitions
    for model in models:
        topics[names.batch_topic(model)] = shared.batch_partitions
    if dead_letters:
        topics[names.dead_letter_topic] = 1
    try:
        await ensure_topics(shared.require_kafka(), topics, durability=durability)
    except TopicConfigError as err:
        raise SettingsError(str(err)) from err


class GatewayTransports:
    """The gateway's Kafka producer, Redis store, queue-depth reader and rate limiter, as the app's lifecycle.

    The queue-depth reader (request topic lag, refreshed in the background) exists only when
    ``max_queue_depth`` is on, the Redis rate limiter only when ``rate_limit_per_s`` is.
    """

    def __init__(self, shared: SharedSettings, settings: Any) -> None:
        from gateway.settings import REQUEST_RUN
        from transport.express.copies import RedisExpress
        from transport.express.requests import ExpressRequestProducer
        from transport.kafka.bus import KafkaRequestProducer
        from transport.kafka.lag import KafkaQueueDepth
        from transport.ports import RequestProducer
        from transport.redis.limits import RedisRateLimiter
        from transport.redis.store import RedisTaskStore
        from transport.routing import Partitioner

        self.shared = shared
        bootstrap = shared.require_kafka()
        redis_url = shared.require_redis()
        partitioner = Partitioner(shared.models, shared.request_partitions, run=REQUEST_RUN)
        kafka = KafkaRequestProducer(bootstrap, shared.names, partitioner, linger_ms=settings.request_linger_ms)
        self.producer: RequestProducer = kafka
        if settings.express:
            self.producer = ExpressRequestProducer(
                kafka, RedisExpress(redis_url, shared.names), record_delay_s=settings.express_record_delay_ms / 1000
            )
        self.store = RedisTaskStore(redis_url, shared.names, ttl_s=shared.result_ttl_s)
        self.redis_url = redis_url
        self.queue_depth: KafkaQueueDepth | None = None
        if settings.max_queue_depth > 0 or settings.admit_by_wait:
            self.queue_depth = KafkaQueueDepth(
                bootstrap,
                shared.names,
                shared.request_partitions,
                models=shared.models,
                batch_partitions=shared.batch_partitions,
            )
        self.limiter: RedisRateLimiter | None = None
        if settings.rate_limit_per_s > 0:
            self.limiter = RedisRateLimiter(
                redis_url, shared.names, settings.rate_limit_per_s, settings.rate_limit_burst_tokens
            )

    async def start(self) -> None:
        await self.store.start()
        await self.producer.start()
        if self.queue_depth is not None:
            await self.queue_depth.start()
        if self.limiter is not None:
            await self.limiter.start()

    async def close(self) -> None:
        if self.limiter is not None:
            await self.limiter.close()
        if self.queue_depth is not None:
            await self.queue_depth.close()
        await self.producer.close()
        await self.store.close()

    async def ready(self) -> dict[str, Any]:
        """Each part's readiness (``gateway.health.Ready``): Redis says whether it is failing over."""
        from gateway.health import Down, Ready, redis_readiness

        kafka = await self.producer.ready()
        redis_ready = await redis_readiness(await self.store.ready(), self.redis_url, timeout_s=1.0)
        checks: dict[str, Ready] = {
            "kafka": kafka
            or Down("down", "the request topic has no connected leader (its broker is down or being replaced)"),
            "redis": redis_ready,
        }
        if self.queue_depth is not None:
            checks["queue_depth"] = self.queue_depth.alive
        return checks


def run_gateway(args: argparse.Namespace) -> int:
    from gateway.app import create_app
    from gateway.events import StreamsEnd
    from gateway.service import Gateway

    shared = shared_settings(args)
    settings = gateway_settings(args, shared)
    transports = GatewayTransports(shared, settings)
    asyncio.run(_ensure_topics(shared, _durability(args), True, ()))  # before serving: a refusal exits 2
    gateway = Gateway(
        settings,
        transports.producer,
        transports.store,
        queue_depth=transports.queue_depth,
        limiter=transports.limiter,
    )
    streams_end = StreamsEnd()
    app = create_app(gateway, transports, streams_end)
    return _serve_http(app, settings, args.log_level, args.gc_threshold, streams_end)


async def _supervise(
    start: Callable[[], Awaitable[None]],
    close: Callable[[], Awaitable[None]],
    failed: asyncio.Event,
    *,
    failure_code: Callable[[], int] = lambda: 1,
    close_timeout_s: float = 60.0,
) -> int:
    """Runs until SIGTERM/SIGINT (graceful: ``close``) or a crashed loop; a second signal exits at once.

    Returns 0 after a signal, ``failure_code()`` after a crash. ``close`` gets ``close_timeout_s``:
    a shutdown that cannot finish (a broker that does not answer) must not hang the process.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        if len(received) > 1:
            log.warning("second signal: exiting at once")
            logging.shutdown()
            os._exit(128 + signum)
        log.info("signal %d: finishing the work in hand, then exiting (send again to exit at once)", signum)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await start()
    stop_task = asyncio.create_task(stop.wait())
    failed_task = asyncio.create_task(failed.wait())
    await asyncio.wait([stop_task, failed_task], return_when=asyncio.FIRST_COMPLETED)
    stop_task.cancel()
    failed_task.cancel()
    await asyncio.gather(stop_task, failed_task, return_exceptions=True)
    code = failure_code() if failed.is_set() else 0
    try:
        await asyncio.wait_for(close(), close_timeout_s)
    except TimeoutError:
        log.error("shutdown did not finish within %.0f s; exiting anyway", close_timeout_s)
        return code or 1
    if code:
        log.error("exiting with status %d after a failure", code)
    return code


def _run_loop(main: Coroutine[Any, Any, int], gc_threshold: Threshold | None) -> int:
    """Runs a role's main coroutine on uvloop (as uvicorn does for the gateway): fewer µs per wake-up."""
    import uvloop

    tune_gc(gc_threshold)
    return uvloop.run(main)


def _metrics_server(port: int) -> None:
    if port:
        from prometheus_client import start_http_server

        from telemetry.metrics import REGISTRY

        start_http_server(port, addr="127.0.0.1", registry=REGISTRY)


def run_batcher(args: argparse.Namespace) -> int:
    shared = shared_settings(args)
    settings = batcher_settings(args, shared.request_partitions)

    async def main() -> int:
        from batcher.service import Batcher
        from transport.express.batches import ExpressBatchProducer
        from transport.express.copies import RedisExpress
        from transport.express.requests import ExpressRequestConsumer
        from transport.kafka.bus import KafkaBatchProducer, KafkaRequestConsumer
        from transport.ports import BatchProducer, RequestConsumer
        from transport.redis.store import RedisCreditPool, RedisTaskStore

        bootstrap = shared.require_kafka()
        redis_url = shared.require_redis()
        await _ensure_topics(shared, _durability(args), True, shared.models)
        store = RedisTaskStore(redis_url, shared.names, ttl_s=shared.result_ttl_s)
        credits = RedisCreditPool(redis_url, shared.names)
        kafka_producer = KafkaBatchProducer(bootstrap, shared.names)
        producer: BatchProducer = kafka_producer
        if args.express:
            express = RedisExpress(redis_url, shared.names, deliveries_ttl_s=shared.result_ttl_s)  # as the workers'
            producer = ExpressBatchProducer(kafka_producer, express)
        consumer: RequestConsumer = KafkaRequestConsumer(
            bootstrap, shared.names, session_timeout_ms=args.session_timeout_ms
        )
        if args.express:
            consumer = ExpressRequestConsumer(consumer, redis_url, shared.names)
        batcher = Batcher(settings, consumer, producer, credits, store)

        async def start() -> None:
            await store.start()
            await credits.start()
            await producer.start()
            await batcher.start()
            log.info("batcher %s up (%s policy)", settings.batcher_id, settings.policy.name.value)

        async def close() -> None:
            await batcher.close()
            await producer.close()
            await credits.close()
            await store.close()

        return await _supervise(start, close, batcher.failed)

    _metrics_server(args.metrics_port)
    return _run_loop(main(), args.gc_threshold)


def run_worker(args: argparse.Namespace) -> int:
    """A worker process; exits 0 after a signal, 75 when its backend hung (restart it), 1 after a crash."""
    from gpu_worker.backends.factory import make_backend
    from gpu_worker.journal import BatchJournal
    from gpu_worker.replicas import ReplicaSettings
    from gpu_worker.runner import EXIT_BACKEND_HUNG

    shared = shared_settings(args)
    model = args.model or shared.models[0]
    if model not in shared.models:
        raise SettingsError(f"--model {model!r} is not among --models {','.join(shared.models)}")
    settings = worker_settings(args, model, args.worker_id)
    try:
        replica_settings = ReplicaSettings(args.redis_min_replicas, args.redis_replica_wait_ms)
    except ValueError as err:
        raise SettingsError(str(err)) from err
    backend = make_backend(backend_settings(args), model)

    async def main() -> int:
        from gpu_worker.replicas import ReplicaWait
        from gpu_worker.worker import Worker
        from transport.express.batches import ExpressBatchConsumer
        from transport.express.copies import RedisExpress
        from transport.kafka.bus import KafkaBatchConsumer, KafkaDeadLetterProducer
        from transport.redis.deliveries import RedisDeliveryLog
        from transport.redis.store import STORE_POOL, RedisCreditPool, RedisTaskStore

        bootstrap = shared.require_kafka()
        redis_url = shared.require_redis()
        names = shared.names
        await _ensure_topics(shared, _durability(args), False, (model,), dead_letters=True)
        # A store's answer may come a replica wait later: the socket waits that much longer.
        socket_timeout_s = STORE_POOL.socket_timeout_s + replica_settings.wait_ms / 1000
        pool = dataclasses.replace(STORE_POOL, socket_timeout_s=socket_timeout_s)
        store = RedisTaskStore(redis_url, names, ttl_s=shared.result_ttl_s, pool=pool)
        credits = RedisCreditPool(redis_url, names)
        deliveries = RedisDeliveryLog(redis_url, names, ttl_s=shared.result_ttl_s)
        dead_letters = KafkaDeadLetterProducer(bootstrap, names)
        replicas = ReplicaWait(store, replica_settings, settings.worker_id, retry_max_s=settings.retry_max_s)
        consumer = ExpressBatchConsumer(  # batchers may send by Redis too (batcher --express)
            KafkaBatchConsumer(bootstrap, names, model, session_timeout_ms=args.session_timeout_ms),
            RedisExpress(redis_url, names),
            settings.worker_id,
        )
        journal = BatchJournal(args.batch_log) if args.batch_log else None
        worker = Worker(
            settings,
            consumer,
            credits,
            store,
            backend,
            journal,
            deliveries=deliveries,
            dead_letters=dead_letters,
            replicas=replicas,
        )

        async def start() -> None:
            await store.start()
            await credits.start()
            await deliveries.start()
            await dead_letters.start()
            await worker.start()
            log.info("worker %s up (model %s, backend %s)", settings.worker_id, model, backend.name)

        async def close() -> None:
            await worker.close()
            await dead_letters.close()
            await deliveries.close()
            await credits.close()
            await store.close()

        return await _supervise(
            start,
            close,
            worker.failed,
            failure_code=lambda: EXIT_BACKEND_HUNG if worker.hung else 1,
            close_timeout_s=settings.drain_timeout_s + 30.0,
        )

    _metrics_server(args.metrics_port)
    return _run_loop(main(), args.gc_threshold)


def run_stack(args: argparse.Namespace) -> int:
    import sys

    from infra import cluster_stack, stack, stack_report

    state_dir = Path(args.state_dir)
    if args.action == "up":
        from infra.errors import InfraError

        shape = cluster_stack.Shape(args.brokers, args.redis_replicas)
        try:
            up = cluster_stack.up_any(state_dir, shape, redis_maxmemory=args.redis_maxmemory)
        except InfraError as err:
            print(f"stack up failed: {err}", file=sys.stderr)
            return 1
        shared = dataclasses.replace(shared_settings(args), kafka_bootstrap=up.env[stack.KAFKA_ENV])
        asyncio.run(_ensure_topics(shared, _durability(args), True, shared.models))
        stack.print_up(up, state_dir, out=sys.stdout, err=sys.stderr)
        return 0
    if args.action == "down":
        return cluster_stack.cmd_down_any(state_dir, out=sys.stdout, err=sys.stderr)
    return stack_report.cmd_status_report(state_dir, as_json=args.json, out=sys.stdout)


def run_topics(args: argparse.Namespace) -> int:
    """``topics grow``: adds partitions to the batch topics (safe live) and the request topic (only with no batcher)."""
    from infra.topics import TopicConfigError, group_members, grow_topics

    names = SharedSettings(namespace=args.namespace, models=tuple(args.models)).names
    bootstrap = SharedSettings(kafka_bootstrap=args.kafka_bootstrap).require_kafka()
    topics = {names.batch_topic(m): args.batch_partitions for m in args.models if args.batch_partitions is not None}
    if args.request_partitions is not None:
        topics[names.request_topic] = args.request_partitions
    if not topics:
        raise SettingsError("topics grow: name a count, --batch-partitions N and/or --request-partitions N")

    async def main() -> dict[str, int]:
        if args.request_partitions is not None:
            batchers = await group_members(bootstrap, names.batcher_group)
            if batchers:
                raise SettingsError(
                    f"not growing {names.request_topic}: {batchers} batcher(s) are running. Its partitions are split "
                    "among the models by their count, so a new count moves partitions from one model to another, "
                    "and every gateway and batcher must use it together (a batcher reads a new partition only after "
                    "its metadata refresh, minutes later). Stop the gateways and batchers, run this again, then start "
                    f"them with --request-partitions {args.request_partitions} (workers may keep running)"
                )
        try:
            return await grow_topics(bootstrap, topics)
        except TopicConfigError as err:
            raise SettingsError(str(err)) from err

    before = asyncio.run(main())
    for name, count in topics.items():
        print(
            f"{name}: {before[name]} -> {count} partitions" if before[name] < count else f"{name}: {count} partitions"
        )
    print("start new roles with the new counts (--batch-partitions / --request-partitions); running ones keep working")
    return 0
