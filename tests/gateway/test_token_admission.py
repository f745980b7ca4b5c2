"""Admission under a token budget: one client's long inputs do not lock another client's short ones out.

An embedded deployment with one worker of 50 ms calls and a budget of 256 tokens (the estimate, 4 UTF-8
bytes a token). The heavy client sends inputs of 250 tokens, each a batch of its own, at 1.5 times the
calls the worker makes a second; the light client sends inputs of a few tokens, which share batches,
at twice the heavy client's count, a small part of the GPU's time. Both ask for the same deadline, so
batches take them first come, first served. The light client must be answered: the heavy one is the
client over its share of the model's work.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from batcher.policy import FlushPolicy
from batcher.settings import BatcherSettings
from batcher.tokens import estimated
from batchwire.embedded import EmbeddedRuntime, EmbeddedSettings
from batchwire.settings import SharedSettings
from gateway.edge.app import create_app
from gateway.edge.callers import CLIENT_ID_HEADER
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from gpu_worker.backends.sim import SimBackend
from transport.memory.limits import MemoryRateLimiter

pytestmark = [pytest.mark.timeout(120), pytest.mark.timing]

BUDGET = 256
HEAVY_TEXT = "h" * 996
"""250 tokens with the index in front: alone in its batch."""
CALL_MS = 50.0
HEAVY_PER_S = 30.0
LIGHT_PER_S = 60.0
FOR_S = 6.0
TIMEOUT_MS = 10_000


@asynccontextmanager
async def serving() -> AsyncIterator[httpx.AsyncClient]:
    """An embedded deployment with a token budget, wired as ``batchwire up`` wires it, telling clients
    apart by ``X-Client-Id``."""
    policy = FlushPolicy.named("work-conserving", max_batch_tokens=BUDGET)
    settings = EmbeddedSettings(
        shared=SharedSettings(models=("sim",)), batcher=BatcherSettings(policy=policy), workers_per_model=1
    )
    runtime = EmbeddedRuntime(settings, lambda model, index: SimBackend(latency_ms=CALL_MS), estimated)
    # A rate limit far above what either client sends tells the two clients apart for their fair shares.
    gateway_settings = GatewaySettings(
        models=("sim",),
        max_batch_tokens=BUDGET,
        rate_limit_per_s=10_000,
        trust_client_id=True,
        default_timeout_ms=TIMEOUT_MS,  # the OpenAI routes' deadline
    )
    gateway = Gateway(
        gateway_settings,
        runtime.producer,
        runtime.store,
        queue_depth=runtime.queue_depth,
        credits=runtime.credits,
        limiter=MemoryRateLimiter(gateway_settings.rate_limit_per_s, gateway_settings.rate_limit_burst_tokens),
        count_tokens=estimated,
    )
    await runtime.start()
    await gateway.start()
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(gateway, runtime)), base_url="http://bw", timeout=30
    )
    try:
        yield client
    finally:
        await client.aclose()
        await gateway.close()
        await runtime.close()


async def _paced(rate_per_s: float, send: Callable[[int], Awaitable[httpx.Response]]) -> list[httpx.Response]:
    started = time.monotonic()
    sent: list[asyncio.Task[httpx.Response]] = []
    while time.monotonic() - started < FOR_S:
        sent.append(asyncio.create_task(send(len(sent))))
        await asyncio.sleep(max(0.0, started + len(sent) / rate_per_s - time.monotonic()))  # pacing, not a wait
    return list(await asyncio.gather(*sent))


async def _task(client: httpx.AsyncClient, text: str) -> httpx.Response:
    body = {"input": text, "timeout_ms": TIMEOUT_MS}
    return await client.post("/v1/tasks", json=body, headers={CLIENT_ID_HEADER: "heavy"})


async def _completion(client: httpx.AsyncClient, text: str) -> httpx.Response:
    """A request of several inputs, whose tokens are counted together (``Gateway.charge``)."""
    body = {"model": "sim", "prompt": [text, text[::-1]]}
    return await client.post("/v1/completions", json=body, headers={CLIENT_ID_HEADER: "heavy"})


@pytest.mark.parametrize("send", [_task, _completion], ids=["task", "openai"])
async def test_a_client_of_long_inputs_does_not_lock_out_a_client_of_short_ones(
    send: Callable[[httpx.AsyncClient, str], Awaitable[httpx.Response]],
) -> None:
    async with serving() as client:
        first = await client.post("/v1/inference", json={"input": "up"})  # the worker states its rate
        assert first.status_code == 200, first.text

        async def heavy(n: int) -> httpx.Response:
            return await send(client, f"{n:04d}{HEAVY_TEXT}")

        async def light(n: int) -> httpx.Response:
            body = {"input": f"light-{n}", "timeout_ms": TIMEOUT_MS}
            return await client.post("/v1/inference", json=body, headers={CLIENT_ID_HEADER: "light"})

        heavies, lights = await asyncio.gather(_paced(HEAVY_PER_S, heavy), _paced(LIGHT_PER_S, light))

    waits = sorted(response.elapsed.total_seconds() for response in lights if response.status_code == 200)
    light_p99_s = waits[int(len(waits) * 0.99)] if waits else None
    light_codes = Counter(response.status_code for response in lights)
    refusals = Counter(response.json()["error"]["message"][:60] for response in lights if response.status_code != 200)
    heavy_codes = Counter(response.status_code for response in heavies)
    assert light_codes[200] >= 0.95 * len(lights), (
        f"the light client is answered: {light_codes} (p99 {light_p99_s} s), {refusals.most_common(2)}; "
        f"heavy: {heavy_codes}"
    )
    heavy_refused = [r.json()["error"]["message"] for r in heavies if r.status_code == 503]
    assert any("above its fair share" in message for message in heavy_refused), (
        f"the heavy client is the one held to its share: {heavy_codes}, {heavy_refused[:2]}"
    )
    assert any("tokens/s" in message for message in heavy_refused), heavy_refused[:2]
