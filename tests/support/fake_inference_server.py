"""A stand-in inference server for bench tests: answers the reversed input after a fixed delay.

It runs in its own thread with its own event loop, so a test can drive ``batchwire bench`` either
through ``main()`` (which owns an event loop) or through the async API.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest


@dataclass
class Behaviour:
    """What the fake does: ``fail_every``-th request gets 503, ``wrong_every``-th a wrong answer."""

    delay_s: float = 0.0
    fail_every: int = 0
    wrong_every: int = 0
    batch_size: int = 2
    script: tuple[str, ...] = ()
    """Answers in turn, cycled, instead of the above: "200"; "503" or "429" (at once, no delay);
    "504:<status>" (after the delay, with a task id whose ``/v1/result`` then says <status>); "504"
    (no task id)."""


@dataclass
class FakeServer:
    behaviour: Behaviour
    url: str = ""
    metrics_url: str = ""
    requests: int = 0
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    task_status: dict[str, str] = field(default_factory=dict)
    answered: list[str] = field(default_factory=list)
    """The script entry each request got, in the order the requests came."""
    in_flight: int = 0
    max_in_flight: int = 0
    spans: list[tuple[float, float]] = field(default_factory=list)
    """(arrival, answer) of each request on the monotonic clock, in the order they were answered."""

    def __post_init__(self) -> None:
        self.batch_size = Histogram(
            "batchwire_batch_size", "items per batch", ["model"], buckets=(1, 2, 4, 8), registry=self.registry
        )
        self.flushes = Counter("batchwire_flushes", "flushes", ["model", "reason"], registry=self.registry)
        self.busy = Counter("batchwire_worker_busy_seconds", "busy", ["worker"], registry=self.registry)
        self.items = Counter("batchwire_backend_items", "inputs", ["model"], registry=self.registry)
        self.stages = Counter("batchwire_request_stage_seconds", "stages", ["model", "stage"], registry=self.registry)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-server", daemon=True)
        self._runner: web.AppRunner | None = None

    async def _inference(self, request: web.Request) -> web.Response:
        arrived = time.monotonic()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._answer(request)
        finally:
            self.in_flight -= 1
            self.spans.append((arrived, time.monotonic()))

    async def _answer(self, request: web.Request) -> web.Response:
        self.requests += 1
        number = self.requests
        document = await request.json()
        text = document["input"]
        if self.behaviour.script:
            return await self._scripted(number, text)
        if self.behaviour.delay_s:
            await asyncio.sleep(self.behaviour.delay_s)
        if self.behaviour.fail_every and number % self.behaviour.fail_every == 0:
            return web.json_response({"error": "overloaded"}, status=503)
        if number % self.behaviour.batch_size == 0:
            self.batch_size.labels("m").observe(self.behaviour.batch_size)
            self.flushes.labels("m", "full").inc()
            self.busy.labels("0").inc(self.behaviour.delay_s)
            size = self.behaviour.batch_size  # each input waited 2 ms for the call, then the whole call
            self.items.labels("m").inc(size)
            self.stages.labels("m", "sealed_to_started").inc(size * 0.002)
            self.stages.labels("m", "call").inc(size * self.behaviour.delay_s)
        answer = text[::-1]
        if self.behaviour.wrong_every and number % self.behaviour.wrong_every == 0:
            answer = text
        return web.json_response({"output": answer})

    async def _scripted(self, number: int, text: str) -> web.Response:
        entry = self.behaviour.script[(number - 1) % len(self.behaviour.script)]
        self.answered.append(entry)
        status, _, later = entry.partition(":")
        if status in ("503", "429"):
            return web.json_response({"error": {"code": "overloaded", "message": "full"}}, status=int(status))
        await asyncio.sleep(self.behaviour.delay_s)
        if status == "200":
            return web.json_response({"output": text[::-1]})
        error = {"code": "deadline_exceeded", "message": "deadline passed"}
        if later:
            error["task_id"] = f"task-{number}"
            self.task_status[error["task_id"]] = later
        return web.json_response({"error": error}, status=int(status))

    async def _result(self, request: web.Request) -> web.Response:
        status = self.task_status.get(request.match_info["task_id"])
        if status is None:
            return web.json_response({"error": {"code": "task_not_found", "message": "no such task"}}, status=404)
        return web.json_response({"task_id": request.match_info["task_id"], "status": status})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_post("/v1/inference", self._inference)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/result/{task_id}", self._result)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
        await web.SockSite(self._runner, sock).start()
        return port

    def start(self) -> FakeServer:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        self.url = f"http://127.0.0.1:{port}/v1/inference"
        self.metrics_url = f"http://127.0.0.1:{port}/metrics"
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
