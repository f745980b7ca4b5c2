"""``batchwire up``'s composition (``batchwire/roles.py``)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from batchwire import role_settings as rs
from batchwire.cli import build_parser
from batchwire.embedded import EmbeddedRuntime, EmbeddedSettings
from batchwire.fleet import Heartbeats
from batchwire.roles import embedded_cache, embedded_settings, worker_group_timing
from batchwire.supervise import graceful_shutdown_s, serve_http
from gateway.edge.app import create_app
from gateway.edge.events import StreamsEnd
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from gpu_worker.backends.sim import SimBackend
from gpu_worker.settings import WorkerSettings
from gpu_worker.worker import HAND_BACK_WRITE_S
from schemas.records import InferenceRequest
from tests.support.eventually import eventually
from transport.memory.cache import MemoryResultCache
from transport.memory.fleet import MemoryFleet

pytestmark = pytest.mark.timeout(60)


async def test_the_embedded_batcher_serves_each_model_alone() -> None:
    """The batcher knows it owns every partition of the in-memory request log, so it spaces its busy
    workers' calls (``Spacing``); with another partition count in its settings than the log's it would
    think another batcher shares the workers."""
    args = build_parser().parse_args(["up", "--models", "a,b", "--workers", "1"])
    runtime = EmbeddedRuntime(embedded_settings(args, rs.shared_settings(args)), lambda model, index: SimBackend(1.0))
    await runtime.start()
    try:
        alone = {model: runtime.batcher.dispatcher.alone(model) for model in ("a", "b")}
        assert alone == {"a": True, "b": True}, f"the one batcher serves every model alone: {alone}"
    finally:
        await runtime.close()


async def test_the_embedded_runtime_reports_its_transports_to_readyz() -> None:
    """The composition root probes the bus and the store (the gateway probes neither): once each."""
    args = build_parser().parse_args(["up", "--workers", "1"])
    runtime = EmbeddedRuntime(embedded_settings(args, rs.shared_settings(args)), lambda model, index: SimBackend(1.0))
    await runtime.start()
    try:
        assert await runtime.ready() == {"bus": True, "store": True, "batcher": True, "workers": True}
        await runtime.store.close()  # the memory store reports not ready once closed
        assert (await runtime.ready())["store"] is False
    finally:
        await runtime.close()


def test_the_embedded_result_cache_holds_a_quarter_of_the_memory_budget() -> None:
    """Its answers live in the process's memory beside the task store's, so its bytes are bounded by a
    share of the same setting; with no budget (0) only its entry cap bounds it."""

    def cache_of(*flags: str, ttl_s: float = 60.0) -> MemoryResultCache | None:
        args = build_parser().parse_args(["up", "--workers", "1", *flags])
        return embedded_cache(embedded_settings(args, rs.shared_settings(args)), ttl_s)

    bounded = cache_of("--max-store-bytes", "4000000")
    assert bounded is not None and bounded.max_bytes == 1_000_000, bounded and bounded.max_bytes
    default = cache_of()
    assert default is not None and default.max_bytes == 64 * 2**20, default and default.max_bytes
    unbounded = cache_of("--max-store-bytes", "0")
    assert unbounded is not None and unbounded.max_bytes is None, unbounded and unbounded.max_bytes
    assert cache_of(ttl_s=0.0) is None, "no cache without a TTL"


def test_a_workers_group_waits_for_its_revocation_to_drain_and_record_its_hand_back() -> None:
    """A revocation whose drain runs out then records the hand-back (up to ``HAND_BACK_WRITE_S``): a
    coordinator that stopped waiting before that would drop the worker and refuse its commits."""
    timing = worker_group_timing(3000, 30.0)
    needed_ms = 3000 + 30_000 + HAND_BACK_WRITE_S * 1000
    assert timing.rebalance_timeout_ms is not None and timing.rebalance_timeout_ms >= needed_ms, (
        f"the group waits {timing.rebalance_timeout_ms} ms; the revocation may take {needed_ms} ms"
    )


def test_a_shutdown_waits_for_requests_in_hand_past_the_longest_deadline() -> None:
    """uvicorn cancels what is still running when its wait runs out: a plain 500 to a caller whose
    request, given a longer timeout, would have been answered."""
    for max_timeout_ms in (30_000, 120_000):
        settings = GatewaySettings(models=("sim",), max_timeout_ms=max_timeout_ms, default_timeout_ms=30_000)
        assert graceful_shutdown_s(settings) > max_timeout_ms / 1000


class SlowLoading(SimBackend):
    """Loads once ``loaded`` is set: a model that takes a while."""

    def __init__(self, loaded: threading.Event) -> None:
        super().__init__(1.0)
        self.loaded = loaded

    def load(self) -> None:
        self.loaded.wait(30)


async def worker_states(fleet: MemoryFleet, want: dict[str, str | tuple[str, ...]]) -> None:
    """Until the fleet shows the workers in ``want``'s states, a state or one of several (each check
    awaits the fleet's read)."""
    seen: dict[str, str] = {}
    for _ in range(2000):
        seen = {beat.id: beat.state for beat in await fleet.members() if beat.role == "worker"}
        if seen.keys() == want.keys() and all(
            seen[worker] in (state if isinstance(state, tuple) else (state,)) for worker, state in want.items()
        ):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"the fleet shows {seen}, not {want}")


async def test_a_worker_loading_its_model_is_starting_and_shown_serving_as_soon_as_it_is_up() -> None:
    """``status`` right after the service is ready must not say the model has no live worker, nor, while
    the model loads, that an idle worker serves it. The heartbeats' period is an hour: only the beat at
    start and the one the runtime asks for once up can show these."""
    args = build_parser().parse_args(["up", "--workers", "1"])
    loaded = threading.Event()
    settings = embedded_settings(args, rs.shared_settings(args))
    runtime = EmbeddedRuntime(settings, lambda model, index: SlowLoading(loaded))
    runtime.heartbeats = Heartbeats(runtime.fleet, runtime.beats, interval_s=3600.0)
    starting = asyncio.create_task(runtime.start())
    try:
        await worker_states(runtime.fleet, {"sim-worker-0": "starting"})
        loaded.set()
        await asyncio.wait_for(starting, 30)
        await worker_states(runtime.fleet, {"sim-worker-0": "idle"})
    finally:
        loaded.set()
        await asyncio.gather(starting, return_exceptions=True)
        await runtime.close()


async def test_a_replaced_worker_is_shown_in_the_state_it_stopped_in_and_its_replacement_at_once() -> None:
    """A worker replaced before its next beat stayed shown as it last beat (idle: live) until its beats went
    stale, and its replacement was missing for a period. The heartbeats' period is an hour here."""
    backends = [SimBackend(latency_ms=20, hang_on="hang")]

    def backend(model: str, index: int) -> SimBackend:
        return backends.pop() if backends else SimBackend(latency_ms=20)

    settings = EmbeddedSettings(workers_per_model=1, worker=WorkerSettings(hang_min_s=0.3, expected_latency_ms=20))
    runtime = EmbeddedRuntime(settings, backend)
    runtime.heartbeats = Heartbeats(runtime.fleet, runtime.beats, interval_s=3600.0)
    await runtime.start()
    try:
        now = int(time.time() * 1000)
        await runtime.producer.send(InferenceRequest("a", "sim", "hang here", now, now + 30_000, reply_to="gw"))
        await eventually(lambda: runtime.replaced == 1, "the hung worker's replacement")
        await worker_states(runtime.fleet, {"sim-worker-0": "hung", "sim-worker-0.1": ("idle", "busy")})
        finals = {beat.id: beat.final for beat in await runtime.fleet.members() if beat.role == "worker"}
        assert finals == {"sim-worker-0": True, "sim-worker-0.1": False}, "the replaced worker's beat is its last"
    finally:
        await runtime.close()
    ended = {(beat.role, beat.id): (beat.state, beat.final) for beat in await runtime.fleet.members()}
    assert ended == {
        ("batcher", runtime.batcher.settings.batcher_id): ("stopped", True),
        ("worker", "sim-worker-0"): ("hung", True),
        ("worker", "sim-worker-0.1"): ("stopped", True),
    }, "at close each role beats once more, saying how it stopped"


def test_an_embedded_process_whose_batcher_crashed_shuts_down_and_exits_1() -> None:
    """The batcher is not replaced as a worker is: without it nothing is batched, so the process ends
    (its supervisor restarts it) instead of serving on, unready for good."""
    runtime = EmbeddedRuntime(EmbeddedSettings(workers_per_model=1), lambda model, index: SimBackend(1.0))

    async def crash() -> None:
        raise RuntimeError("a bug in the batcher's loop")

    runtime.batcher._expiry_loop = crash  # type: ignore[method-assign]
    settings = GatewaySettings(models=("sim",), port=0)
    gateway = Gateway(settings, runtime.producer, runtime.store, credits=runtime.credits)
    streams_end = StreamsEnd()
    app = create_app(gateway, runtime, streams_end, runtime.fleet)
    codes: list[int] = []
    # A thread of its own (uvicorn leaves the signals alone off the main thread), a daemon: a server that
    # serves on must not hold the test run.
    server = threading.Thread(
        target=lambda: codes.append(serve_http(app, settings, "warning", None, streams_end, runtime.failure)),
        daemon=True,
    )
    server.start()
    server.join(30)
    assert not server.is_alive(), "the process still serves without its batcher"
    assert codes == [1]
    assert runtime.batcher.failure is not None
