"""Fixtures: a started gateway app over fresh memory transports, per test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from batchwire.routing import Partitioner
from batchwire.transport.memory import MemoryRequestBus
from gateway.app import create_app
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from tests.gateway.rig import MODELS, RecordingStore, Rig, RigFactory, StubLifecycle


@pytest.fixture
async def make_rig() -> AsyncIterator[RigFactory]:
    """Builds a started app (lifespan entered) over fresh memory transports; tears all down after."""
    stack: list[Rig] = []
    contexts: list[Any] = []

    async def build(
        producer: Any = None, store: RecordingStore | None = None, start: bool = True, **overrides: Any
    ) -> Rig:
        settings = GatewaySettings(**{"models": MODELS, "default_model": "sim", **overrides})
        bus = MemoryRequestBus(Partitioner(settings.models, 4))
        store = store or RecordingStore()
        gateway = Gateway(settings, producer or bus.producer(), store)
        lifecycle = StubLifecycle()
        app = create_app(gateway, lifecycle)
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
