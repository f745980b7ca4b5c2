"""A frozen Kafka broker (SIGSTOP: its connections stay open, nothing answers, as in a long GC pause or
a partition) is seen as down: ``/readyz`` turns 503 and synchronous submits are refused 503
``unavailable`` at once within a few seconds, instead of each waiting out its deadline; once the broker
runs again (SIGCONT) the gateway is ready and answers without a restart.

Over a PRIVATE broker and Redis (``LocalStack``): freezing them never disturbs other tests.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from infra.local_stack import LocalStack
from tests.support.processes import Cluster, private_cluster

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(240)]

TIMEOUT_MS = 4000
"""Shorter than the produce timeout (5 s): a submit's deadline passes before its send fails."""
REFUSED_WITHIN_S = 1.5
"""A refusal this quick did not wait on the bus."""
SEEN_DOWN_WITHIN_S = 5.0
"""How long after the freeze the gateway may take to find the bus down (bounded waits of 1 s to 2 s)."""


@pytest.fixture
def cluster(private_stack: LocalStack, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    yield from private_cluster(request, private_stack, tmp_path, workers=1, sim_latency_ms=10)


@dataclass(frozen=True)
class Outcome:
    sent_s: float
    """Seconds after the freeze."""
    status: int
    code: str | None
    took_s: float


async def submit(client: httpx.AsyncClient, url: str, text: str) -> tuple[int, str | None, float]:
    """(status, error code, seconds taken) of one synchronous submit."""
    started = time.monotonic()
    response = await client.post(f"{url}/v1/inference", json={"input": text, "timeout_ms": TIMEOUT_MS})
    took_s = time.monotonic() - started
    if response.status_code == 200:
        assert response.json()["output"] == text[::-1], f"answer for {text!r}: {response.text}"
        return 200, None, took_s
    return response.status_code, response.json().get("error", {}).get("code"), took_s


@asynccontextmanager
async def frozen(private_stack: LocalStack, cluster: Cluster, client: httpx.AsyncClient) -> AsyncIterator[float]:
    """The broker stopped (SIGSTOP) for the block, whose value is when; then resumed (SIGCONT, always),
    and the gateway ready and answering again within a bound."""
    url = cluster.gateway_urls[0]
    pid = private_stack.kafka.pid
    assert pid is not None, "the private broker runs"
    assert (await submit(client, url, "before"))[0] == 200, "the stack answers before the freeze"
    assert (await client.get(f"{url}/readyz")).status_code == 200, "ready before the freeze"
    os.kill(pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed_at = time.monotonic()
    ready: list[int] = []
    answered: list[tuple[int, str | None, float]] = []
    while True:
        ready.append((await client.get(f"{url}/readyz")).status_code)
        if ready[-1] == 200:
            answered.append(await submit(client, url, f"after-{len(answered)}"))
            if answered[-1][0] == 200:
                break
        assert time.monotonic() - resumed_at < 60, (
            f"ready and answering within 60 s of SIGCONT; /readyz {ready[-5:]}, submits {answered[-5:]}"
        )
        await asyncio.sleep(0.1)  # sampling rate of the readiness reads
    for proc in cluster.procs:
        assert proc.alive(), f"{proc.name} died while the broker was frozen:\n{proc.tail()}"


async def test_readyz_turns_503_while_the_broker_is_frozen_and_the_next_submit_is_refused_at_once(
    private_stack: LocalStack, cluster: Cluster
) -> None:
    """No send during the freeze before the submit: the /readyz probe alone found the bus down, and the
    submit after it does not wait on the bus (its bound would cut the probe short before it told the breaker)."""
    url = cluster.gateway_urls[0]
    async with httpx.AsyncClient(timeout=30) as client, frozen(private_stack, cluster, client) as frozen_at:
        seen: list[tuple[float, int]] = []
        while not seen or seen[-1][1] != 503:
            status = (await client.get(f"{url}/readyz")).status_code
            seen.append((round(time.monotonic() - frozen_at, 1), status))
            assert seen[-1][0] < SEEN_DOWN_WITHIN_S + 5, (
                f"/readyz turns 503 within {SEEN_DOWN_WITHIN_S} s of the freeze; got (s after, status) {seen}"
            )
            await asyncio.sleep(0.1)  # sampling rate of the readiness reads
        status, code, took_s = await submit(client, url, "after-readyz")
    assert seen[-1][0] < SEEN_DOWN_WITHIN_S, f"/readyz turned 503 too late: (s after, status) {seen}"
    assert (status, code) == (503, "unavailable") and took_s < REFUSED_WITHIN_S, (
        f"a submit after /readyz found the broker frozen ({seen[-1]}) is refused 503 unavailable within "
        f"{REFUSED_WITHIN_S} s; got {status} {code} after {took_s:.1f} s"
    )


async def test_submits_are_refused_at_once_while_the_broker_is_frozen(
    private_stack: LocalStack, cluster: Cluster
) -> None:
    """No /readyz read during the freeze: the sends themselves find the bus down."""
    url = cluster.gateway_urls[0]
    async with httpx.AsyncClient(timeout=30) as client, frozen(private_stack, cluster, client) as frozen_at:
        outcomes: list[Outcome] = []

        async def one(n: int) -> None:
            sent_s = time.monotonic() - frozen_at
            status, code, took_s = await submit(client, url, f"frozen-{n}")
            outcomes.append(Outcome(round(sent_s, 1), status, code, round(took_s, 1)))

        async with asyncio.TaskGroup() as submits:
            for n in range(40):
                submits.create_task(one(n))
                await asyncio.sleep(0.25)  # pacing the submits over 10 s, not synchronisation
    late = [o for o in outcomes if o.sent_s >= SEEN_DOWN_WITHIN_S]
    assert late, "submits were sent after the bound"
    slow = [o for o in late if not (o.status == 503 and o.code == "unavailable" and o.took_s < REFUSED_WITHIN_S)]
    assert not slow, (
        f"every submit sent {SEEN_DOWN_WITHIN_S} s or more after the freeze is refused 503 unavailable within "
        f"{REFUSED_WITHIN_S} s; these were not: {slow}"
    )
    unclear = [o for o in outcomes if (o.status, o.code) not in ((503, "unavailable"), (504, "deadline_exceeded"))]
    assert not unclear, f"a submit while frozen is refused or ends at its deadline, got {unclear}"
