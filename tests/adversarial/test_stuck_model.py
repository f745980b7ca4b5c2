"""A model whose every worker hangs: its requests end ``expired`` at their deadline, wherever they
wait, it is named in ``/readyz`` and refused at once, and the healthy model is unharmed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis

from schemas.wire import Names
from tests.support.adversarial_rig import ONE_PER_CALL, Service, ServiceFactory, unharmed
from tests.support.eventually import eventually_sync

pytestmark = [pytest.mark.slow, pytest.mark.timing]

HANG = "HANG"
FLAGS = {"BATCHWIRE_MODELS": "sim,blocked", "BATCHWIRE_SIM_HANG_ON": HANG, "BATCHWIRE_HANG_MIN_S": "120"}
TASKS = 100
TIMEOUT_MS = 2000


def _start(request: pytest.FixtureRequest, mode: str) -> Service:
    """Two sim workers and two workers for ``blocked``, every worker hanging on an input holding HANG."""
    factory: ServiceFactory = request.getfixturevalue(f"{mode}_service_factory")
    if mode == "embedded":
        flags = [item for name, value in FLAGS.items() for item in (f"--{name[10:].lower().replace('_', '-')}", value)]
        return factory(*flags)
    service = factory(extra_env=FLAGS)
    assert service.cluster is not None
    for index in (2, 3):
        service.cluster.worker(index, "--model", "blocked")
    client = redis.Redis.from_url(service.cluster.redis_url)
    credits = Names(service.cluster.namespace).credit_queue("blocked")
    eventually_sync(
        lambda: client.zcard(credits) >= 2, "the blocked model's two workers to offer credits", timeout_s=60
    )
    client.close()
    return service


def _hang_every_worker(url: str) -> None:
    """One hanging input per worker of ``blocked``, each running before the next is sent."""
    with httpx.Client(base_url=url, timeout=10) as client:
        for n in range(2):
            task_id = client.post("/v1/tasks", json={"input": f"{HANG}-{n}", "model": "blocked"}).json()["task_id"]
            eventually_sync(
                lambda task_id=task_id: client.get(f"/v1/result/{task_id}").json()["status"] == "running",
                f"hanging input {n} to run",
                timeout_s=30,
            )


async def _flood_and_follow(
    url: str, ended: dict[str, tuple[str, float]], refused: list[float], events: list[str]
) -> None:
    """Sends TASKS requests for the blocked model and long-polls each accepted one until it ends."""
    # Room for every long-poll and the stream at once: a request waiting for the client's own pool
    # would be timed as if the service were slow.
    limits = httpx.Limits(max_connections=TASKS + 50)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

        async def one(n: int) -> None:
            sent = time.monotonic()
            response = await client.post(
                "/v1/tasks", json={"input": f"waits-{n}", "model": "blocked", "timeout_ms": TIMEOUT_MS}
            )
            if response.status_code == 503:  # the stall was seen: refused at once, nothing queued
                assert response.json()["error"]["code"] == "overloaded", response.text
                refused.append(time.monotonic() - sent)
                return
            assert response.status_code == 202, response.text
            task_id = response.json()["task_id"]
            state: dict[str, Any] = {"status": "queued"}
            while state["status"] in ("queued", "batched"):
                state = (await client.get(f"/v1/result/{task_id}", params={"wait": 5})).json()
            ended[task_id] = (state["status"], time.monotonic() - sent)

        async def stream() -> None:
            task_id = (
                await client.post("/v1/tasks", json={"input": "streamed", "model": "blocked", "timeout_ms": TIMEOUT_MS})
            ).json()["task_id"]
            async with client.stream("GET", f"/v1/result/{task_id}/events") as response:
                async for line in response.aiter_lines():
                    if line.startswith("event:"):
                        events.append(line.split(":", 1)[1].strip())

        async def paced(n: int) -> None:  # a steady stream over a second, as many clients would send
            await asyncio.sleep(n / TASKS)
            await one(n)

        await asyncio.gather(stream(), *(paced(n) for n in range(TASKS)))


@pytest.mark.parametrize("mode", ["embedded", "kafka"])
def test_a_stuck_model_ends_its_requests_on_time_and_hurts_no_other(request: pytest.FixtureRequest, mode: str) -> None:
    service = _start(request, mode)
    _hang_every_worker(service.url)
    ended: dict[str, tuple[str, float]] = {}
    refused: list[float] = []
    events: list[str] = []
    attack: Callable[[], None] = lambda: asyncio.run(  # noqa: E731
        _flood_and_follow(service.url, ended, refused, events)
    )
    # The harm guarded against, the healthy model's requests waiting behind the hung workers or their
    # dispatch, costs a call (100 ms) or more: the rig's slack is three quarters of a call. The probe keeps to one
    # request per call here: the flood's own batches share the cores, and a faster probe meets them more.
    harm = unharmed(service, attack, **ONE_PER_CALL)

    assert len(ended) + len(refused) == TASKS, harm
    assert len(ended) >= 20, f"the first requests (before the stall shows) are accepted: {len(ended)}"
    # Refused, not held until the deadline. The times are the client's: it shares the cores with the
    # service, and while it follows a hundred long-polls its own lag delays the requests it accepts as
    # much as those refused, so the bound is half the deadline (batchwire bench measures the refusal).
    assert not refused or sorted(refused)[len(refused) // 2] < TIMEOUT_MS / 2000, f"refusals come at once: {refused}"
    statuses = {status for status, _ in ended.values()}
    assert statuses == {"expired"}, f"every waiting request ends expired, got {statuses}"
    slowest_s = max(seconds for _, seconds in ended.values())
    assert slowest_s <= TIMEOUT_MS / 1000 + 1.0, f"the last one ended {slowest_s:.2f} s after it was sent"
    assert events and events[-1] == "expired", f"the event stream ends with the expiry, got {events}"

    with httpx.Client(base_url=service.url, timeout=10) as client:
        eventually_sync(
            lambda: client.get("/readyz").json().get("models", {}).get("blocked") == "stalled",
            "/readyz to name the stalled model",
            timeout_s=30,
        )
        ready = client.get("/readyz")
        assert ready.status_code == 200, f"one stalled model leaves the gateway ready: {ready.text}"
        assert ready.json()["models"] == {"sim": "serving", "blocked": "stalled"}
        started = time.monotonic()
        late = client.post("/v1/inference", json={"input": "x", "model": "blocked"})
        assert late.status_code == 503 and late.json()["error"]["code"] == "overloaded", late.text
        assert "blocked" in late.json()["error"]["message"] and late.headers["retry-after"]
        assert time.monotonic() - started < 0.5, "refused at once"
        answered = client.post("/v1/inference", json={"input": "abc"})
        assert answered.status_code == 200 and answered.json()["output"] == "cba"
    _kill_the_hung(service)


def _kill_the_hung(service: Service) -> None:
    """Ends the processes whose backend hangs by construction: stopped with SIGTERM, each would wait
    out its drain timeout for a call that never returns before the teardown kills it anyway."""
    hung = (
        [service.proc]
        if service.cluster is None
        else [proc for proc in service.cluster.procs if proc.name in ("worker2", "worker3")]
    )
    for proc in hung:
        proc.kill9()
