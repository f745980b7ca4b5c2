"""The token budget on an embedded deployment: an input over it gets 413, one the tokenizer cannot read
gets 400, every other request of the same moment is answered, and no batch a worker ran exceeds it;
counting a long input holds up no other request, and a request that a cheaper check refuses (the rate
limit, the queue) is refused before its input is counted."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from batcher.policy import FlushPolicy
from batcher.settings import BatcherSettings
from batcher.tokens import estimated
from batchwire.embedded import EmbeddedRuntime, EmbeddedSettings
from batchwire.settings import SharedSettings
from gateway.admission.validation import LONG_INPUT_CHARS
from gateway.edge.app import create_app
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from gpu_worker.backends.sim import SimBackend
from tests.support.gateway_rig import RigFactory, error_of
from transport.memory.limits import MemoryRateLimiter

pytestmark = pytest.mark.timeout(60)

BUDGET = 16
"""Tokens per batch: with the estimate (4 UTF-8 bytes a token), inputs up to 64 bytes."""


class Recording(SimBackend):
    """The sim backend, keeping each batch's inputs."""

    def __init__(self) -> None:
        super().__init__(latency_ms=20)
        self.batches: list[list[str]] = []

    def batchstring(self, inputs: list[str]) -> list[str]:
        self.batches.append(list(inputs))
        return super().batchstring(inputs)


def count(text: str) -> int:
    """The estimate, except for an input that a real tokenizer could not read."""
    if "\x00" in text:
        raise ValueError("the tokenizer cannot read a NUL")
    return estimated(text)


@asynccontextmanager
async def serving(
    backend: Recording, counter: Callable[[str], int], budget: int = BUDGET
) -> AsyncIterator[httpx.AsyncClient]:
    """An embedded deployment whose gateway and batcher count tokens with ``counter``."""
    policy = FlushPolicy.named("work-conserving", max_batch_tokens=budget)
    settings = EmbeddedSettings(
        shared=SharedSettings(models=("sim",)), batcher=BatcherSettings(policy=policy), workers_per_model=1
    )
    runtime = EmbeddedRuntime(settings, lambda model, index: backend, counter)
    gateway = Gateway(
        GatewaySettings(models=("sim",), max_batch_tokens=budget), runtime.producer, runtime.store, count_tokens=counter
    )
    await runtime.start()
    await gateway.start()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gateway, runtime)), base_url="http://bw")
    try:
        yield client
    finally:
        await client.aclose()
        await gateway.close()
        await runtime.close()


@pytest.fixture
async def served() -> AsyncIterator[tuple[httpx.AsyncClient, Recording]]:
    backend = Recording()
    async with serving(backend, count) as client:
        yield client, backend


async def test_over_the_budget_is_413_unreadable_is_400_and_the_rest_are_answered(
    served: tuple[httpx.AsyncClient, Recording],
) -> None:
    client, backend = served
    inputs = ["a" * (1 + 5 * n % 64) for n in range(40)] + ["x" * 65, "bad\x00input"]
    responses = await asyncio.gather(*(client.post("/v1/inference", json={"input": text}) for text in inputs))
    by_input = dict(zip(inputs, responses, strict=True))
    over, unreadable = by_input.pop("x" * 65), by_input.pop("bad\x00input")
    assert over.status_code == 413 and over.json()["error"]["code"] == "input_over_token_budget", over.text
    assert "17 tokens" in over.json()["error"]["message"] and "BATCHWIRE_MAX_BATCH_TOKENS" in over.text
    assert unreadable.status_code == 400 and unreadable.json()["error"]["code"] == "untokenizable_input"
    for text, response in by_input.items():
        assert response.status_code == 200, response.text
        assert response.json()["output"] == text[::-1]
    ran = [text for batch in backend.batches for text in batch]
    assert sorted(ran) == sorted(by_input), "each answered input ran once; the refused ones never ran"
    for batch in backend.batches:
        assert max(map(estimated, batch)) * len(batch) <= BUDGET, [len(text) for text in batch]
    assert max(map(len, backend.batches)) > 1, "short inputs still share batches"


class HeldCount:
    """The estimate, but the ``hold``-th count of a long input waits for ``release``: a tokenizer at work
    on a long text, the GIL released (as ``batcher.tokens``' counter does), first in the gateway, then in
    the batcher."""

    def __init__(self, hold: int) -> None:
        self.hold = hold
        self.long_counts = 0
        self.holding = threading.Event()
        self.release = threading.Event()

    def __call__(self, text: str) -> int:
        if len(text) >= LONG_INPUT_CHARS:
            self.long_counts += 1
            if self.long_counts == self.hold:
                self.holding.set()
                self.release.wait(30)
        return estimated(text)


@pytest.mark.parametrize("hold", [1, 2], ids=["gateway", "batcher"])
async def test_while_a_long_input_is_counted_the_loop_serves_others(hold: int) -> None:
    """The gateway's count of a long input (the first) or the batcher's (the second) runs on a thread: the
    event loop meanwhile answers the health probe and, while the gateway counts, a short request (while the
    batcher counts, the short one waits for the batcher's next read, behind the long one)."""
    counter = HeldCount(hold)
    async with serving(Recording(), counter, budget=10_000) as client:
        long_input = "l" * LONG_INPUT_CHARS
        long = asyncio.create_task(client.post("/v1/inference", json={"input": long_input}))
        assert await asyncio.to_thread(counter.holding.wait, 10), "the long input's count began"
        try:
            async with asyncio.timeout(10):
                health = await client.get("/healthz")
                short = asyncio.create_task(client.post("/v1/inference", json={"input": "short"}))
                if hold == 1:
                    answered = await short
                    assert answered.status_code == 200 and answered.json()["output"] == "trohs", answered.text
            assert health.status_code == 200, health.text
            assert not counter.release.is_set() and not long.done(), "all of that while the count was held"
        finally:
            counter.release.set()
        answer = await long
        assert answer.status_code == 200 and answer.json()["output"] == long_input[::-1], answer.text
        assert (await short).status_code == 200


class HeldLongCounts:
    """The estimate, but every count of a long input by the gateway (those holding ``tag``) waits for
    ``release``: a tokenizer slow over the long texts a flood sends."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.began = 0
        self.first = asyncio.Event()
        self.release = threading.Event()
        self._loop = asyncio.get_running_loop()

    def __call__(self, text: str) -> int:
        if text.startswith(self.tag):
            self.began += 1
            self._loop.call_soon_threadsafe(self.first.set)
            self.release.wait(30)
        return estimated(text)


FLOODED = 40
"""More long inputs at once than the event loop's default executor has threads (at most 32)."""


async def test_a_flood_of_long_inputs_being_counted_holds_up_no_other_request() -> None:
    """The gateway counts long inputs on a thread of its own: while every one of a flood's counts waits,
    the embedded batcher's and workers' hops to the default executor still run, so a short request is
    answered; the flood's inputs are counted one at a time and answered once the counts go on."""
    counter = HeldLongCounts("flood")
    async with serving(Recording(), counter, budget=10_000) as client:
        flood = [f"flood{n:03d}".ljust(LONG_INPUT_CHARS, "l") for n in range(FLOODED)]
        sent = [asyncio.create_task(client.post("/v1/tasks", json={"input": text})) for text in flood]
        try:
            async with asyncio.timeout(10):
                await counter.first.wait()
                short = await client.post("/v1/inference", json={"input": "short"})
            assert short.status_code == 200 and short.json()["output"] == "trohs", short.text
            assert counter.began == 1, f"one count at a time, on the gateway's thread: {counter.began} began"
        finally:
            counter.release.set()
        accepted = await asyncio.gather(*sent)
        assert [response.status_code for response in accepted] == [202] * FLOODED


async def test_the_inputs_of_a_charged_list_are_counted_once() -> None:
    """With admission on, ``Gateway.charge`` checks a list's inputs against the budget before their
    submits (an OpenAI request of several): each submit does not count its input again."""
    counted: list[str] = []

    def gateway_count(text: str) -> int:
        counted.append(text)
        return estimated(text)

    settings = EmbeddedSettings(
        shared=SharedSettings(models=("sim",)),
        batcher=BatcherSettings(policy=FlushPolicy.named("work-conserving", max_batch_tokens=10_000)),
        workers_per_model=1,
    )
    runtime = EmbeddedRuntime(settings, lambda model, index: Recording(), estimated)
    gateway = Gateway(
        GatewaySettings(models=("sim",), max_batch_tokens=10_000),
        runtime.producer,
        runtime.store,
        queue_depth=runtime.queue_depth,
        count_tokens=gateway_count,
    )
    await runtime.start()
    await gateway.start()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gateway, runtime)), base_url="http://bw")
    try:
        inputs = ["one", "two", "l" * LONG_INPUT_CHARS]
        answer = await client.post("/v1/completions", json={"model": "sim", "prompt": inputs, "max_tokens": 16})
        assert answer.status_code == 200, answer.text
    finally:
        await client.aclose()
        await gateway.close()
        await runtime.close()
    assert sorted(counted) == sorted(inputs), f"each input counted once by the gateway: {len(counted)} counts"


class Counting:
    """The estimate, keeping each input the gateway counted."""

    def __init__(self) -> None:
        self.counted: list[str] = []

    def __call__(self, text: str) -> int:
        self.counted.append(text)
        return estimated(text)


LONG = "l" * LONG_INPUT_CHARS
"""Counted on the budget's thread."""


def _limited(burst: int) -> dict[str, object]:
    """A rate limit whose bucket holds ``burst`` tokens, the next one 100 s away, per X-Client-Id."""
    return {
        "limiter": MemoryRateLimiter(0.01, burst),
        "rate_limit_per_s": 0.01,
        "rate_limit_burst": burst,
        "trust_client_id": True,
    }


async def test_a_request_over_its_rate_limit_is_refused_before_its_inputs_are_counted(make_rig: RigFactory) -> None:
    """Refused 429 as before, and uncounted: a client over its limit cannot make the gateway tokenize
    (one input, or an OpenAI request of several), even an input over the budget (429, not 413)."""
    counter = Counting()
    rig = await make_rig(count_tokens=counter, max_batch_tokens=10_000, **_limited(2))
    await rig.worker()
    flooder = {"X-Client-Id": "flooder"}
    admitted = [f"first{LONG}", f"second{LONG}"]
    first = await rig.client.post("/v1/completions", json={"model": "sim", "prompt": admitted}, headers=flooder)
    assert first.status_code == 200, first.text  # the client's two tokens, for 100 s

    refused = [
        await rig.client.post("/v1/tasks", json={"input": f"task{LONG}"}, headers=flooder),
        await rig.client.post("/v1/inference", json={"input": f"inference{LONG}"}, headers=flooder),
        await rig.client.post("/v1/inference", json={"input": "o" * 50_000}, headers=flooder),  # over the budget
        await rig.client.post("/v1/completions", json={"model": "sim", "prompt": [f"a{LONG}"]}, headers=flooder),
        await rig.client.post(
            "/v1/completions", json={"model": "sim", "prompt": [f"b{LONG}"], "stream": True}, headers=flooder
        ),
    ]

    assert len(counter.counted) == len(admitted), (
        f"only the admitted inputs are counted: {len(counter.counted)} counts, of "
        f"{[text[:10] for text in counter.counted]}"
    )
    assert [r.status_code for r in refused] == [429] * len(refused), [r.text for r in refused]
    assert all(error_of(r)["code"] == "rate_limited" for r in refused)
    other = await rig.client.post("/v1/tasks", json={"input": f"other{LONG}"}, headers={"X-Client-Id": "other"})
    assert other.status_code == 202 and counter.counted[-1] == f"other{LONG}", other.text


async def test_a_request_the_queue_refuses_is_refused_before_its_input_is_counted(make_rig: RigFactory) -> None:
    counter = Counting()
    rig = await make_rig(count_tokens=counter, max_batch_tokens=10_000, queue_depth="bus", max_queue_depth=1)
    assert (await rig.client.post("/v1/tasks", json={"input": f"queued{LONG}"})).status_code == 202  # no worker
    refused = await rig.client.post("/v1/tasks", json={"input": f"refused{LONG}"})
    assert refused.status_code == 503 and error_of(refused)["code"] == "overloaded", refused.text
    assert counter.counted == [f"queued{LONG}"], f"{len(counter.counted)} counts: the refused input was counted"


async def test_a_request_refused_for_its_token_count_keeps_its_rate_limit_tokens(make_rig: RigFactory) -> None:
    """Counted once its tokens are taken, an input over the budget (413) or unreadable (400) gives them
    back, one request or an OpenAI request of several: refused for its input, a request takes none."""
    rig = await make_rig(count_tokens=count, max_batch_tokens=10_000, **_limited(2))
    over = "o" * 50_000
    refused = [
        await rig.client.post("/v1/tasks", json={"input": over}),
        await rig.client.post("/v1/inference", json={"input": "bad\x00input"}),
        await rig.client.post("/v1/completions", json={"model": "sim", "prompt": ["fine", over]}),
    ]
    assert [r.status_code for r in refused] == [413, 400, 413], [r.text for r in refused]
    statuses = [(await rig.client.post("/v1/tasks", json={"input": f"t{n}"})).status_code for n in range(3)]
    assert statuses == [202, 202, 429], "the refused requests took none of the bucket's two tokens"
