"""Composition roots: each command builds its transports and services and runs them until a signal.

The services never learn which transports they got; this module is the only place that decides.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from batcher.policy import FlushPolicy
from batcher.settings import BatcherSettings
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


def batcher_settings(args: argparse.Namespace) -> BatcherSettings:
    kwargs: dict[str, Any] = {"policy": _policy(args)}
    if getattr(args, "batcher_id", None):
        kwargs["batcher_id"] = args.batcher_id
    return BatcherSettings(**kwargs)


def gateway_settings(args: argparse.Namespace, shared: SharedSettings) -> Any:
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
    }
    if args.gateway_id:
        kwargs["gateway_id"] = args.gateway_id
    try:
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
    )


def _serve_http(app: Any, host: str, port: int, log_level: str) -> int:
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        timeout_graceful_shutdown=30,
    )
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1


# embedded ----------------------------------------------------------------------------------------
def run_embedded(args: argparse.Namespace) -> int:
    from batchwire.embedded import EmbeddedRuntime, EmbeddedSettings
    from gateway.app import create_app
    from gateway.service import Gateway
    from gpu_worker.backends.factory import make_backend

    shared = shared_settings(args)
    backends = backend_settings(args)
    runtime = EmbeddedRuntime(
        EmbeddedSettings(
            shared=shared, batcher=batcher_settings(args), workers_per_model=args.workers, batch_log=args.batch_log
        ),
        lambda model, index: make_backend(backends, model),
    )
    settings = gateway_settings(args, shared)
    gateway = Gateway(settings, runtime.producer, runtime.store)
    log.info(
        "batchwire (embedded) on http://%s:%d: models %s, %d workers each",
        settings.host,
        settings.port,
        ",".join(shared.models),
        args.workers,
    )
    return _serve_http(create_app(gateway, runtime), settings.host, settings.port, args.log_level)


# Kafka + Redis roles -----------------------------------------------------------------------------
async def _ensure_topics(shared: SharedSettings, request_topic: bool, models: tuple[str, ...]) -> None:
    from infra.topics import ensure_topics

    names = shared.names
    topics: dict[str, int] = {}
    if request_topic:
        topics[names.request_topic] = shared.request_partitions
    for model in models:
        topics[names.batch_topic(model)] = shared.batch_partitions
    await ensure_topics(shared.require_kafka(), topics)


class GatewayTransports:
    """The gateway's Kafka producer and Redis store, as the app's lifecycle."""

    def __init__(self, shared: SharedSettings) -> None:
        from batchwire.routing import Partitioner
        from batchwire.transport.kafka import KafkaRequestProducer
        from batchwire.transport.redis import RedisTaskStore

        self.shared = shared
        self.producer = KafkaRequestProducer(
            shared.require_kafka(), shared.names, Partitioner(shared.models, shared.request_partitions)
        )
        self.store = RedisTaskStore(shared.require_redis(), shared.names, ttl_s=shared.result_ttl_s)

    async def start(self) -> None:
        await _ensure_topics(self.shared, True, ())
        await self.store.start()
        await self.producer.start()

    async def close(self) -> None:
        await self.producer.close()
        await self.store.close()

    async def ready(self) -> dict[str, bool]:
        return {"kafka": await self.producer.ready(), "redis": await self.store.ready()}


def run_gateway(args: argparse.Namespace) -> int:
    from gateway.app import create_app
    from gateway.service import Gateway

    shared = shared_settings(args)
    transports = GatewayTransports(shared)
    settings = gateway_settings(args, shared)
    gateway = Gateway(settings, transports.producer, transports.store)
    return _serve_http(create_app(gateway, transports), settings.host, settings.port, args.log_level)


async def _supervise(
    start: Callable[[], Awaitable[None]], close: Callable[[], Awaitable[None]], failed: asyncio.Event
) -> int:
    """Runs until SIGTERM/SIGINT (graceful: ``close``) or a crashed loop; a second signal exits at once."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        if len(received) > 1:
            log.warning("second signal: exiting at once")
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
    await close()
    return 1 if failed.is_set() else 0


def _metrics_server(port: int) -> None:
    if port:
        from prometheus_client import start_http_server

        from batchwire.metrics import REGISTRY

        start_http_server(port, addr="127.0.0.1", registry=REGISTRY)


def run_batcher(args: argparse.Namespace) -> int:
    shared = shared_settings(args)
    settings = batcher_settings(args)

    async def main() -> int:
        from batcher.service import Batcher
        from batchwire.transport.kafka import KafkaBatchProducer, KafkaRequestConsumer
        from batchwire.transport.redis import RedisCreditPool, RedisTaskStore

        bootstrap = shared.require_kafka()
        redis_url = shared.require_redis()
        await _ensure_topics(shared, True, shared.models)
        store = RedisTaskStore(redis_url, shared.names, ttl_s=shared.result_ttl_s)
        credits = RedisCreditPool(redis_url, shared.names)
        producer = KafkaBatchProducer(bootstrap, shared.names)
        batcher = Batcher(settings, KafkaRequestConsumer(bootstrap, shared.names), producer, credits, store)

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
    return asyncio.run(main())


def run_worker(args: argparse.Namespace) -> int:
    from gpu_worker.backends.factory import make_backend
    from gpu_worker.journal import BatchJournal
    from gpu_worker.settings import WorkerSettings

    shared = shared_settings(args)
    model = args.model or shared.models[0]
    if model not in shared.models:
        raise SettingsError(f"--model {model!r} is not among --models {','.join(shared.models)}")
    kwargs: dict[str, Any] = {"model": model, "batch_log": args.batch_log}
    if args.worker_id:
        kwargs["worker_id"] = args.worker_id
    settings = WorkerSettings(**kwargs)
    backend = make_backend(backend_settings(args), model)

    async def main() -> int:
        from batchwire.transport.kafka import KafkaBatchConsumer
        from batchwire.transport.redis import RedisCreditPool, RedisTaskStore
        from gpu_worker.worker import Worker

        bootstrap = shared.require_kafka()
        redis_url = shared.require_redis()
        await _ensure_topics(shared, False, (model,))
        store = RedisTaskStore(redis_url, shared.names, ttl_s=shared.result_ttl_s)
        credits = RedisCreditPool(redis_url, shared.names)
        journal = BatchJournal(args.batch_log) if args.batch_log else None
        worker = Worker(settings, KafkaBatchConsumer(bootstrap, shared.names, model), credits, store, backend, journal)

        async def start() -> None:
            await store.start()
            await credits.start()
            await worker.start()
            log.info("worker %s up (model %s, backend %s)", settings.worker_id, model, backend.name)

        async def close() -> None:
            await worker.close()
            await credits.close()
            await store.close()

        return await _supervise(start, close, worker.failed)

    _metrics_server(args.metrics_port)
    return asyncio.run(main())


def run_stack(args: argparse.Namespace) -> int:
    import sys

    from infra import stack
    from infra.topics import ensure_topics

    state_dir = Path(args.state_dir)
    if args.action == "up":
        from infra.errors import InfraError

        try:
            variables = stack.stack_up(state_dir)
        except InfraError as err:
            print(f"stack up failed: {err}", file=sys.stderr)
            return 1
        shared = shared_settings(args)
        topics = {shared.names.request_topic: shared.request_partitions}
        topics.update({shared.names.batch_topic(m): shared.batch_partitions for m in shared.models})
        asyncio.run(ensure_topics(variables["BATCHWIRE_KAFKA_BOOTSTRAP"], topics))
        for key, value in variables.items():
            print(f"{key}={value}")
        print(f"# written to {state_dir / 'stack.env'}; stop with: batchwire stack down", file=sys.stderr)
        return 0
    if args.action == "down":
        return stack.cmd_down(state_dir, out=sys.stdout, err=sys.stderr)
    return stack.cmd_status(state_dir, out=sys.stdout)
