"""One API key's flood does not make another key's requests wait behind it (issue 43, item 7).

A real ``batchwire up`` with API keys and one worker of 5 inputs per 100 ms call (50 requests/s).
Key A floods async tasks at three times that; key C sends synchronous requests with a 5 s deadline
beside it. Without fair shares, A's tasks fill the queue up to what their own deadlines allow, and
C's requests wait behind them, past their deadline (or are refused as the queue's wait passes it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.support.adversarial_rig import ServiceFactory
from tests.support.eventually import eventually_sync

pytestmark = [pytest.mark.slow, pytest.mark.timing]  # a 3x flood beside a deadline: run alone

FLOOD_KEY = "tenant-a-0123456789abcdef"
QUIET_KEY = "tenant-c-0123456789abcdef"
FLOOD_PER_S = 150.0
QUIET_PER_S = 4.0
FOR_S = 6.0
QUIET_TIMEOUT_MS = 5_000


async def _paced(
    client: httpx.AsyncClient, rate_per_s: float, send: object, for_s: float = FOR_S
) -> list[httpx.Response]:
    started = time.monotonic()
    tasks = []
    n = 0
    while time.monotonic() - started < for_s:
        tasks.append(asyncio.create_task(send(client, n)))  # type: ignore[operator]
        n += 1
        await asyncio.sleep(max(0.0, started + n / rate_per_s - time.monotonic()))  # pacing, not synchronization
    return list(await asyncio.gather(*tasks))


async def _both(url: str, quiet_after_s: float) -> tuple[list[httpx.Response], list[httpx.Response]]:
    async def flood(client: httpx.AsyncClient, n: int) -> httpx.Response:
        return await client.post(
            "/v1/tasks", json={"input": f"flood-{n}"}, headers={"Authorization": f"Bearer {FLOOD_KEY}"}
        )

    async def quiet(client: httpx.AsyncClient, n: int) -> httpx.Response:
        body = {"input": f"quiet-{n}", "timeout_ms": QUIET_TIMEOUT_MS}
        return await client.post("/v1/inference", json=body, headers={"Authorization": f"Bearer {QUIET_KEY}"})

    # httpcore checks every connection its pool keeps whenever a request starts or ends: idle ones
    # dropped after 2 s keep the two clients' CPU for their requests.
    limits = httpx.Limits(max_connections=400, keepalive_expiry=2.0)
    async with (
        httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as a,
        httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as c,
    ):

        async def later() -> list[httpx.Response]:
            await asyncio.sleep(quiet_after_s)  # pacing: the flood has this head start, not synchronization
            return await _paced(c, QUIET_PER_S, quiet)

        flooded, quieted = await asyncio.gather(_paced(a, FLOOD_PER_S, flood, quiet_after_s + FOR_S), later())
    return flooded, quieted


@pytest.mark.parametrize("quiet_after_s", [0.0, 4.0], ids=["together", "flood first"])
def test_a_key_flooding_a_model_leaves_another_key_answered_in_time(
    embedded_service_factory: ServiceFactory, tmp_path: Path, quiet_after_s: float
) -> None:
    """Flood first: alone, key A still queues no faster than the model drains, so key C, coming 4 s
    later with a shorter deadline, finds about a second of work ahead of it, not the 8 s that A's
    30 s deadlines would allow (C, refused, would never count as sending, and A never be held)."""
    keys = tmp_path / "api-keys"
    keys.write_text(f"{FLOOD_KEY}\n{QUIET_KEY}\n")
    service = embedded_service_factory("--api-keys-file", str(keys), "--max-batch", "5", workers=1)
    eventually_sync(  # answered once, so the worker states its rate, as on any service that has been running
        lambda: (
            httpx.post(
                f"{service.url}/v1/inference", json={"input": "up"}, headers={"Authorization": f"Bearer {QUIET_KEY}"}
            ).status_code
            == 200
        ),
        "the worker to answer",
        timeout_s=60,
    )
    flooded, quieted = asyncio.run(_both(service.url, quiet_after_s))

    quiet = Counter(response.status_code for response in quieted)
    assert quiet == {200: len(quieted)}, f"key C is answered within its {QUIET_TIMEOUT_MS} ms deadline: {quiet}"
    wrong = [r for r in quieted if r.json()["output"] != json.loads(r.request.content)["input"][::-1]]
    assert not wrong, f"answers that are not their own input's: {[r.text for r in wrong[:3]]}"
    flood = Counter(response.status_code for response in flooded)
    refused = [r.json()["error"]["message"] for r in flooded if r.status_code == 503]
    assert flood[202] > 0 and refused, f"key A is admitted to its share and refused past it: {flood}"
    assert any("above its fair share" in message for message in refused), refused[:3]
