"""A role's process lifecycle: the event loop it runs on, its signals, and its exit status."""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

import uvicorn
import uvloop
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, start_http_server

from batchwire.flags import METRICS_HOST
from batchwire.gc_tuning import Threshold, tune_gc
from batchwire.settings import SettingsError
from gateway.edge.descriptors import connection_cap
from gateway.edge.events import StreamsEnd
from gateway.edge.http_limits import limited_http_protocol
from gateway.settings import GatewaySettings
from telemetry import logs
from transport.cancelling import cancel_and_wait

log = logging.getLogger("batchwire")


class Lifecycle(Protocol):
    """A part of a role that is started before the role serves and closed, in reverse, after."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class Parts:
    """A role's parts: started in order, closed in reverse. Only the parts that started are closed, so a
    start that fails part-way (a model that cannot load) closes what came up before it."""

    def __init__(self, *parts: Lifecycle) -> None:
        self._parts = parts
        self._started: list[Lifecycle] = []

    async def start(self) -> None:
        for part in self._parts:
            await part.start()
            self._started.append(part)

    async def close(self) -> None:
        """Closes every part that started, the others too when one's close fails; then raises the first
        failure (each is logged)."""
        failure: Exception | None = None
        while self._started:
            part = self._started.pop()
            try:
                await part.close()
            except Exception as err:
                log.exception("closing %s failed", type(part).__name__)
                failure = failure or err
        if failure is not None:
            raise failure


async def supervise(
    start: Callable[[], Awaitable[None]],
    close: Callable[[], Awaitable[None]],
    failed: asyncio.Event,
    *,
    failure_code: Callable[[], int] = lambda: 1,
    close_timeout_s: float = 60.0,
) -> int:
    """Runs until SIGTERM/SIGINT (graceful: ``close``) or a crashed loop; a second signal exits at once.

    Returns 0 after a signal, ``failure_code()`` after a crash; a ``start`` that raises is closed, then
    re-raised, and one a signal cuts short (``_start_unless_stopped``) is closed, returning 0. ``close``
    gets ``close_timeout_s``: a shutdown that cannot finish (a broker that does not answer) must not hang
    the process.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        if len(received) > 1:
            exit_at_once(signum)
        log.info("signal %d: finishing the work in hand, then exiting (send again to exit at once)", signum)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    stop_task = asyncio.create_task(stop.wait())
    try:
        stopped_starting = await _start_unless_stopped(start, stop_task)
    except BaseException:
        stop_task.cancel()
        await asyncio.gather(stop_task, return_exceptions=True)
        try:
            await _close_within(close, close_timeout_s)
        except Exception as err:  # the start's failure is the one to tell
            log.warning("closing after the failed start failed too: %r", err)
        raise
    if stopped_starting:
        return 0 if await _close_within(close, close_timeout_s) else 1
    failed_task = asyncio.create_task(failed.wait())
    await asyncio.wait([stop_task, failed_task], return_when=asyncio.FIRST_COMPLETED)
    stop_task.cancel()
    failed_task.cancel()
    await asyncio.gather(stop_task, failed_task, return_exceptions=True)
    code = failure_code() if failed.is_set() else 0
    if not await _close_within(close, close_timeout_s):
        return code or 1
    if code:
        log.error("exiting with status %d after a failure", code)
    return code


async def _start_unless_stopped(start: Callable[[], Awaitable[None]], stop: asyncio.Task[Any]) -> bool:
    """Runs ``start``; whether a signal cut it short. A start can take minutes (a model loading): a process
    stopped meanwhile does not wait it out and then serve (a worker would join its group, rebalancing every
    worker, only to leave it again); the part starting is cancelled, and ``close`` closes what started."""
    starting = asyncio.ensure_future(start())
    try:
        await asyncio.wait([starting, stop], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not starting.done():
            await cancel_and_wait(starting)
    if starting.cancelled():
        log.info("signalled while starting: closing what started; nothing more starts")
        return True
    starting.result()  # the start's failure, if it failed
    return False


async def _close_within(close: Callable[[], Awaitable[None]], timeout_s: float) -> bool:
    """Whether ``close`` finished within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            await close()
    except TimeoutError:
        log.error("shutdown did not finish within %.0f s; exiting anyway", timeout_s)
        return False
    return True


def exit_at_once(signum: int) -> None:
    """A second shutdown signal: the process ends now, with the status a signal's death would give."""
    log.warning("second signal: exiting at once")
    logging.shutdown()
    os._exit(128 + signum)


def run_loop(main: Coroutine[Any, Any, int], gc_threshold: Threshold | None) -> int:
    """Runs a role's main coroutine on uvloop (as uvicorn does for the gateway): fewer µs per wake-up."""
    tune_gc(gc_threshold)
    return uvloop.run(main)


def serve_metrics(exports: CollectorRegistry, port: int, host: str = METRICS_HOST) -> None:
    """Prometheus ``/metrics`` of a batcher or worker process on ``host:port`` (port 0: none): ``exports``,
    the families that role writes (``telemetry.metrics.BATCHER_EXPORTS``, ``WORKER_EXPORTS``)."""
    if not 0 <= port <= 65535:
        raise SettingsError(f"--metrics-port must be within 0..65535 (0: off), got {port} (BATCHWIRE_METRICS_PORT)")
    if not port and host != METRICS_HOST:
        raise SettingsError(
            f"--metrics-host (BATCHWIRE_METRICS_HOST) is {host}, and --metrics-port (BATCHWIRE_METRICS_PORT) is 0, "
            "which serves no /metrics: set the port, or leave the host unset"
        )
    if port:
        try:
            start_http_server(port, addr=host, registry=exports)
        except OSError as err:
            raise SettingsError(
                f"cannot serve /metrics on {host}:{port}: {err} (--metrics-host, --metrics-port)"
            ) from err


def check_listen(settings: GatewaySettings) -> None:
    """Binds the gateway's address once, as the server will, and lets it go: a port in use or a host this
    machine lacks stops the role in one line naming the setting, before its parts start (uvicorn finds
    out only once the app has started: models loaded, the gateway shown in the fleet)."""
    try:
        found = socket.getaddrinfo(settings.host, settings.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in found:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:  # as asyncio's create_server, beside an IPv4 socket on the port
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(address)
    except OSError as err:  # socket.gaierror too: a host that does not resolve
        reason = "address already in use" if err.errno == errno.EADDRINUSE else err.strerror or str(err)
        raise SettingsError(
            f"cannot listen on {settings.host}:{settings.port}: {reason} (--host / BATCHWIRE_HOST, "
            "--port / BATCHWIRE_PORT)"
        ) from err


SHUTDOWN_GRACE_S = 5
"""How long past the longest request deadline the HTTP server waits for requests in hand at shutdown."""


def graceful_shutdown_s(settings: GatewaySettings) -> int:
    """How long a shutdown waits for requests in hand before uvicorn cancels them (a plain 500): past the
    longest deadline a request may have (``--max-timeout-ms``), which answers it. Long-polls and event
    streams end at the signal (``StreamsEnd``)."""
    return math.ceil(settings.max_timeout_ms / 1000) + SHUTDOWN_GRACE_S


def serve_http(
    app: FastAPI,
    settings: GatewaySettings,
    log_level: str,
    gc_threshold: Threshold | None,
    streams_end: StreamsEnd,
    failure: Callable[[], BaseException | None] = lambda: None,
) -> int:
    """Serves ``app`` with uvicorn, under the gateway's HTTP limits (``gateway.edge.http_limits``); the first
    shutdown signal also ends ``streams_end``'s event streams, which would hold the graceful shutdown.

    A ``failure`` (a part that crashed: embedded mode's batcher) shuts the server down as a signal does, and
    the process exits 1 rather than serving on without it."""
    tune_gc(gc_threshold)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        # JSON logs: uvicorn's loggers go to the root's JSON handler instead of its own text ones.
        log_config=None if logs.structured() else uvicorn.config.LOGGING_CONFIG,
        access_log=False,
        loop="uvloop",
        http=limited_http_protocol(settings, connection_cap(settings.max_connections)),
        ws="none",  # no route speaks WebSocket: an Upgrade to it is served as plain HTTP/1.1, under the limits
        lifespan="on",
        proxy_headers=False,  # bound to loopback by default; a proxy in front sets X-Client-Id
        server_header=False,
        date_header=False,
        timeout_graceful_shutdown=graceful_shutdown_s(settings),
    )

    class Server(uvicorn.Server):
        failed = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            """As every role: the first signal shuts down gracefully and the process exits 0 (uvicorn
            would raise the signal again once done, and the process would die of it), a second one
            exits at once."""
            if self.should_exit:
                exit_at_once(sig)
            streams_end.end()
            self.should_exit = True

        async def on_tick(self, counter: int) -> bool:
            if not self.should_exit and (err := failure()) is not None:
                log.error("a part of the process failed (%r); shutting down", err)
                self.failed = True
                streams_end.end()
                return True
            return await super().on_tick(counter)

    server = Server(config)
    server.run()
    return 0 if server.started and not server.failed else 1
