"""/readyz names the part that is down, its state and why (Redis failing over behind Sentinel)."""

from __future__ import annotations

import logging
from typing import Any

from batchwire.gateway_transports import redis_readiness
from gateway.health import Down, probe
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from schemas.records import Credit
from tests.support.eventually import eventually
from tests.support.gateway_rig import RigFactory, error_of
from transport.memory.credits import MemoryCreditPool
from transport.memory.lag import MemoryQueueDepth
from transport.memory.requests import MemoryRequestBus
from transport.memory.store import MemoryTaskStore
from transport.routing import Partitioner


async def test_readyz_says_which_part_is_failing_over_and_why(make_rig: RigFactory) -> None:
    rig = await make_rig()
    parts: dict[str, Any] = rig.lifecycle.parts
    parts["redis"] = Down("failing over", "the Sentinels see the primary as down; they are promoting a replica")
    parts["kafka"] = True
    response = await rig.client.get("/readyz")
    assert response.status_code == 503, response.text
    doc = response.json()
    assert doc["checks"]["redis"] is False and doc["checks"]["kafka"] is True, doc
    assert doc["down"] == {
        "redis": {
            "state": "failing over",
            "reason": "the Sentinels see the primary as down; they are promoting a replica",
        }
    }
    assert error_of(response)["message"] == (
        "not ready: redis (failing over: the Sentinels see the primary as down; they are promoting a replica)"
    )

    parts["redis"] = True
    ready = await rig.client.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert "down" not in ready.json()


async def test_a_plain_redis_url_that_is_down_is_named_without_its_password() -> None:
    assert await redis_readiness(True, "redis://:secret@127.0.0.1:1/0", 1.0) is True
    down = await redis_readiness(False, "redis://:secret@127.0.0.1:1/0", 1.0)
    assert isinstance(down, Down) and down.state == "down", down
    assert "127.0.0.1:1" in down.reason and "secret" not in down.reason, down


async def test_a_redis_url_with_its_password_in_the_query_is_named_without_it() -> None:
    """redis-py reads ``?password=`` as the password; /readyz is open to anyone, so its reason must not show it."""
    down = await redis_readiness(False, "redis://127.0.0.1:1/0?password=secret&socket_timeout=1", 1.0)
    assert isinstance(down, Down), down
    assert "127.0.0.1:1" in down.reason and "secret" not in down.reason, down
    assert "socket_timeout=1" in down.reason, down


async def test_readyz_is_503_when_no_model_can_be_admitted(make_rig: RigFactory, monkeypatch: Any) -> None:
    """One stalled model leaves the gateway ready for the others; with every model stalled it only
    refuses, and a load balancer should send callers to another gateway."""
    rig = await make_rig()
    states = {"sim": "stalled", "other": "serving"}
    monkeypatch.setattr(rig.gateway, "models", lambda: dict(states))
    ready = await rig.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["models"] == states, ready.text

    states["other"] = "stalled"
    response = await rig.client.get("/readyz")
    assert response.status_code == 503, response.text
    doc = response.json()
    assert doc["down"]["models"]["reason"].startswith("no model can be admitted: other, sim stalled"), doc
    assert doc["models"] == states and response.headers["retry-after"], doc


class _BrokenPool(MemoryCreditPool):
    """A credit pool whose read fails with a bug's error, not a transport's."""

    def __init__(self) -> None:
        super().__init__()
        self.raised = False

    async def offered(self, model: str) -> list[Credit]:
        self.raised = True
        raise RuntimeError("a credit the gateway cannot read")


async def test_a_gateway_whose_admission_sampler_died_is_not_ready() -> None:
    """The sampler shows a stall while no request comes and ends it when a worker waits: once it has
    died (logged), the gateway says so in its readiness rather than run on without it."""
    settings = GatewaySettings(models=("sim",), default_model="sim")
    bus = MemoryRequestBus(Partitioner(settings.models, 1))
    pool = _BrokenPool()
    gateway = Gateway(settings, bus.producer(), MemoryTaskStore(), queue_depth=MemoryQueueDepth(bus), credits=pool)
    await gateway.start()
    try:
        await eventually(lambda: pool.raised, "the sampler to read the credits")
        await eventually(lambda: not gateway.ready()["gateway"], "the gateway to say it is not ready", timeout_s=2)
    finally:
        await gateway.close()


async def test_a_check_that_raises_reads_down_and_logs_one_line_naming_its_error(caplog: Any) -> None:
    """A load balancer probes every few seconds: a dependency that is down must not add a traceback each time."""

    async def failing() -> bool:
        raise ConnectionError("connection refused")

    with caplog.at_level(logging.WARNING, logger="gateway.health"):
        assert await probe(failing(), 1.0, "store") is False
    [record] = caplog.records
    assert record.getMessage() == "readiness check of store failed: ConnectionError: connection refused"
    assert record.exc_info is None, "no traceback"
