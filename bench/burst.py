"""A burst of synchronous requests against a running deployment: how many were answered, refused
and answered 504, and how many of the 504s were computed anyway (their stored result says
``completed``). Issue 44's claim is that an admitted request is answered within its deadline and
that nothing is computed for a caller already told 504.

    .venv/bin/batchwire up --workers 2 &           # or a Kafka deployment
    .venv/bin/python bench/burst.py --url http://127.0.0.1:8000 --requests 5000 --timeout-ms 500

The requests are spread evenly over ``--within-s`` (open loop); on a small machine the client falls
behind, and ``sent over`` says how long the sending took. Each burst prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter

import aiohttp


async def burst(url: str, requests: int, within_s: float, timeout_ms: int, model: str | None) -> dict[str, object]:
    codes: Counter[str] = Counter()
    late: list[str] = []
    answered_ms: list[float] = []
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=9)
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def one(n: int) -> None:
            await asyncio.sleep(n * within_s / requests)  # the schedule, not a wait for anything
            body: dict[str, object] = {"input": f"burst-{n}", "timeout_ms": timeout_ms}
            if model is not None:
                body["model"] = model
            try:
                async with session.post("/v1/inference", json=body) as response:
                    payload = await response.json(content_type=None)
                    codes[str(response.status)] += 1
            except (aiohttp.ClientError, TimeoutError) as err:
                codes[type(err).__name__] += 1
                return
            if response.status == 200:
                answered_ms.append(payload["latency_ms"])
            elif response.status == 504:
                late.append(payload["error"]["task_id"])

        started = time.monotonic()
        await asyncio.gather(*(one(n) for n in range(requests)))
        sent_over_s = time.monotonic() - started
        # A 504's task may still be running: its end is read once every call in flight could have ended.
        await asyncio.sleep(2 * timeout_ms / 1000)
        ended: Counter[str] = Counter()
        for task_id in late:
            async with session.get(f"/v1/result/{task_id}") as response:
                ended[(await response.json(content_type=None)).get("status", "?")] += 1
    return {
        "requests": requests,
        "sent_over_s": round(sent_over_s, 2),
        "codes": dict(codes),
        "late_then": dict(ended),
        "computed_after_504": ended["completed"],
        "slowest_answer_ms": max(answered_ms, default=None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--within-s", type=float, default=1.0)
    parser.add_argument("--timeout-ms", type=int, default=500)
    parser.add_argument("--model", default=None)
    parser.add_argument("--bursts", type=int, default=1, help="bursts in a row, each after the last one's ends")
    args = parser.parse_args()
    for _ in range(args.bursts):
        result = asyncio.run(burst(args.url, args.requests, args.within_s, args.timeout_ms, args.model))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
