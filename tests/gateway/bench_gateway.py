"""CPU cost per synchronous request through the gateway, with memory transports and an instant worker.

Not a test (pytest does not collect it). Run from the repository root:

    .venv/bin/python -m tests.gateway.bench_gateway asgi  --requests 20000 --concurrency 64 [--loop uvloop]
    .venv/bin/python -m tests.gateway.bench_gateway http  --requests 20000 --concurrency 64

``asgi`` calls the ASGI app directly (the gateway's own cost: routing, parsing, service, store,
bus, the fake worker); ``http`` runs uvicorn in a child process and loads it over keep-alive
sockets from this one, reporting the server process's CPU (adds HTTP parsing and the socket I/O).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

from gateway.edge.app import create_app
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from tests.support.gateway_rig import FakeWorker, StubLifecycle
from transport.memory.requests import MemoryRequestBus
from transport.memory.store import MemoryTaskStore
from transport.routing import Partitioner

BODY = json.dumps({"input": "the quick brown fox jumps over the lazy dog"}).encode()


def build() -> tuple[Any, FakeWorker]:
    """The app over memory transports, and an instant worker that the app's lifecycle runs."""
    settings = GatewaySettings(models=("sim",))
    bus = MemoryRequestBus(Partitioner(settings.models, 4))
    store = MemoryTaskStore()
    worker = FakeWorker(bus, store)

    class WithWorker(StubLifecycle):
        async def start(self) -> None:
            await worker.start()

        async def close(self) -> None:
            await worker.close()

    return create_app(Gateway(settings, bus.producer(), store), WithWorker()), worker


async def call(app: Any) -> int:
    """One POST /v1/inference straight into the ASGI app; returns the status."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/inference",
        "raw_path": b"/v1/inference",
        "query_string": b"",
        "root_path": "",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 1),
        "headers": [
            (b"host", b"gw"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(BODY)).encode()),
        ],
    }
    sent = False
    status = 0
    answered = asyncio.Event()

    async def receive() -> dict[str, Any]:
        # As ASGI servers do: the body, then http.disconnect once the response was sent.
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            answered.set()

    await app(scope, receive, send)
    return status


async def bench_asgi(requests: int, concurrency: int) -> None:
    app, _ = build()
    async with app.router.lifespan_context(app):
        for _ in range(500):  # warm up
            await call(app)
        queue = iter(range(requests))
        statuses: list[int] = []

        async def client() -> None:
            for _ in queue:
                statuses.append(await call(app))

        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    assert statuses.count(200) == requests, f"not all answered 200: {set(statuses)}"
    print(
        f"asgi: {requests} requests, concurrency {concurrency}: {cpu / requests * 1e6:.0f} µs CPU per request "
        f"(gateway + fake worker, one process), {requests / wall:.0f} req/s on one core"
    )


def serve(port: int) -> None:
    import uvicorn

    app, _ = build()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


async def load(port: int, requests: int, concurrency: int) -> list[int]:
    request = (
        b"POST /v1/inference HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
    )
    queue = iter(range(requests))
    statuses: list[int] = []

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in queue:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            statuses.append(int(head[9:12]))
            length = next(
                int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
        writer.close()
        await writer.wait_closed()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return statuses


def bench_http(requests: int, concurrency: int) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    child = subprocess.Popen([sys.executable, "-m", "tests.gateway.bench_gateway", "serve", "--port", str(port)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        asyncio.run(load(port, 500, 8))  # warm up
        cpu0, wall0 = _cpu_of(child.pid), time.perf_counter()
        statuses = asyncio.run(load(port, requests, concurrency))
        cpu, wall = _cpu_of(child.pid) - cpu0, time.perf_counter() - wall0
    finally:
        child.terminate()
        child.wait(10)
    assert statuses.count(200) == requests, f"not all answered 200: {set(statuses)}"
    print(
        f"http: {requests} requests, concurrency {concurrency}: {cpu / requests * 1e6:.0f} µs server CPU per "
        f"request (uvicorn + gateway + fake worker), {requests / wall:.0f} req/s with the load generator "
        f"on the same {os.cpu_count()} cores"
    )


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["asgi", "http", "serve"])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--loop", choices=["asyncio", "uvloop"], default="asyncio", help="asgi mode's event loop (uvicorn runs uvloop)"
    )
    args = parser.parse_args()
    if args.mode == "asgi":
        if args.loop == "uvloop":
            import uvloop

            uvloop.run(bench_asgi(args.requests, args.concurrency))
        else:
            asyncio.run(bench_asgi(args.requests, args.concurrency))
    elif args.mode == "http":
        bench_http(args.requests, args.concurrency)
    else:
        serve(args.port)


if __name__ == "__main__":
    main()
