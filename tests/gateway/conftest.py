"""Fixtures: a started gateway app over fresh memory transports, per test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gateway.edge.app import create_app
from gateway.edge.events import StreamsEnd
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from tests.support.gateway_rig import MODELS, RecordingStore, Rig, RigFactory, StubLifecycle
from transport.memory.lag import MemoryQueueDepth
from transport.memory.requests import MemoryRequestBus
from transport.routing import Partitioner


@pytest.fixture
async def make_rig() -> AsyncIterator[RigFactory]:
    """Builds a started app (lifespan entered) over fresh memory transports; tears all down after.

    ``store`` may be any TaskStore (a Redis one for tests over the real thing); ``queue_depth="bus"``
    measures the rig's own bus; ``bus`` lets several gateways share one bus; ``cache`` is the
    gateway's result cache; ``fleet`` is where ``/v1/fleet`` reads heartbeats; ``streams_end`` is the
    server's shutdown signal to its waits; ``count_tokens`` is the token budget's counter (with
    ``max_batch_tokens``); ``clock`` is the gateway's (wall time a test moves forward).
    """
    stack: list[Rig] = []
    contexts: list[Any] = []

    async def build(
        producer: Any = None,
        store: Any = None,
        start: bool = True,
        queue_depth: Any = None,
        limiter: Any = None,
        bus: MemoryRequestBus | None = None,
        cache: Any = None,
        fleet: Any = None,
        streams_end: StreamsEnd | None = None,
        count_tokens: Any = None,
        clock: Any = None,
        **overrides: Any,
    ) -> Rig:
        settings = GatewaySettings(**{"models": MODELS, "default_model": "sim", **overrides})
        bus = bus or MemoryRequestBus(Partitioner(settings.models, 4))
        store = store or RecordingStore()
        if queue_depth == "bus":
            queue_depth = MemoryQueueDepth(bus)
        gateway = Gateway(
            settings,
            producer or bus.producer(),
            store,
            clock,
            queue_depth=queue_depth,
            limiter=limiter,
            cache=cache,
            count_tokens=count_tokens,
        )
        lifecycle = StubLifecycle()
        app = create_app(gateway, lifecycle, streams_end, fleet_store=fleet)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
        if start:
            context = app.router.lifespan_context(app)
            await context.__aenter__()
            contexts.append(context)
        rig = Rig(settings, bus, store, gateway, lifecycle, app, client, [])
        stack.append(rig)
        return rig

    yield build
    for rig in stack:
        for worker in rig.workers:
            await worker.close()
        await rig.client.aclose()
    for context in reversed(contexts):
        await context.__aexit__(None, None, None)


@pytest.fixture
async def rig(make_rig: RigFactory) -> Rig:
    return await make_rig()
