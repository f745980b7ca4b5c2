"""A stand-in for the ``batchwire`` command, so the bench's process handling is tested without the
real services: ``up``/``gateway`` serve /readyz, /metrics and /v1/inference; ``batcher``/``worker``
serve /metrics; ``stack up`` exits at once (with ``--state-dir``, after writing a ``stack.env`` there);
``stack status --json`` lists one fake server of each kind, with this process's pid.

Environment switches: FAKE_BW_LOG (append pid and argv as a JSON line), FAKE_BW_IGNORE_TERM=1 (survive
SIGTERM, to test the SIGKILL fallback), FAKE_BW_FAIL=1 (exit 3 at once, to test early exits),
FAKE_BW_ORPHAN=1 (start a child that outlives this process, its pid logged as "orphan").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("role")
    parser.add_argument("action", nargs="?")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int)
    parser.add_argument("--metrics-port", type=int)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--sim-latency-ms", type=float, default=0.0)
    parser.add_argument("--policy")
    parser.add_argument("--namespace")
    parser.add_argument("--max-batch", type=int)
    parser.add_argument("--max-wait-ms", type=float)
    parser.add_argument("--result-ttl-s", type=float)
    parser.add_argument("--state-dir")
    parser.add_argument("--brokers", type=int)
    parser.add_argument("--redis-replicas", type=int)
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def _app(args: argparse.Namespace) -> web.Application:
    registry = CollectorRegistry()
    sizes = Histogram("batchwire_batch_size", "items", ["model"], buckets=(1, 2, 4), registry=registry)
    flushes = Counter("batchwire_flushes", "flushes", ["model", "reason"], registry=registry)
    busy = Counter("batchwire_worker_busy_seconds", "busy", ["worker"], registry=registry)
    latency_s = args.sim_latency_ms / 1000.0
    reason = "idle_worker" if args.policy == "work-conserving" else "max_wait"

    async def inference(request: web.Request) -> web.Response:
        text = (await request.json())["input"]
        await asyncio.sleep(latency_s)
        sizes.labels("m").observe(1)
        flushes.labels("m", reason).inc()
        busy.labels("w0").inc(latency_s)
        return web.json_response({"output": text[::-1]})

    async def ready(request: web.Request) -> web.Response:
        return web.Response(text="ready")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/inference", inference)
    app.router.add_get("/readyz", ready)
    app.router.add_get("/metrics", metrics)
    return app


def _leave_an_orphan(log: str | None) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"]
    )
    if log:
        with open(log, "a") as file:
            file.write(json.dumps({"orphan": child.pid}) + "\n")


async def _serve(args: argparse.Namespace) -> None:
    runner = web.AppRunner(_app(args), handle_signals=False, access_log=None)
    await runner.setup()
    port = args.port if args.port is not None else args.metrics_port
    await web.TCPSite(runner, "127.0.0.1", port).start()
    stop = asyncio.Event()
    if os.environ.get("FAKE_BW_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await runner.cleanup()


def _stack(args: argparse.Namespace, log: str | None) -> int:
    """Keeps "is the stack up" in a marker file (in --state-dir, else next to the log), so
    status/up/down agree."""
    marker = os.path.join(args.state_dir, "up") if args.state_dir else (log or "fake-batchwire") + ".stack-up"
    if args.action == "up":
        open(marker, "w").close()
        if args.state_dir:
            with open(os.path.join(args.state_dir, "stack.env"), "w") as file:
                file.write("BATCHWIRE_KAFKA_BOOTSTRAP=127.0.0.1:1\nBATCHWIRE_REDIS_URL=redis://127.0.0.1:2/0\n")
    elif args.action == "down" and os.path.exists(marker):
        os.remove(marker)
    elif args.action == "status":
        if args.json:
            kinds = ("kafka", "kafka", "redis", "sentinel", "sentinel")
            servers = [{"kind": kind, "pid": os.getpid(), "alive": True} for kind in kinds]
            print(json.dumps({"servers": [*servers, {"kind": "redis", "pid": None, "alive": False}]}))
        return 0 if os.path.exists(marker) else 1
    return 0


def main() -> None:
    log = os.environ.get("FAKE_BW_LOG")
    if log:
        with open(log, "a") as file:
            addresses = {name: os.environ.get(name) for name in ("BATCHWIRE_STACK_ENV", "BATCHWIRE_KAFKA_BOOTSTRAP")}
            file.write(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:], "env": addresses}) + "\n")
    if os.environ.get("FAKE_BW_FAIL") == "1":
        print("fake batchwire: told to fail", flush=True)
        sys.exit(3)
    args = _parse(sys.argv[1:])
    if args.role == "stack":
        sys.exit(_stack(args, log))
    if os.environ.get("FAKE_BW_ORPHAN") == "1":
        _leave_an_orphan(log)
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
