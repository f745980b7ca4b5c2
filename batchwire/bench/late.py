"""What became of the tasks whose callers were answered 504: computed anyway, or not.

A 504 tells a caller its deadline passed; a task the service computes after that bought GPU time
for an answer nobody receives. Once the load has ended, each such task's state is read back from
``GET /v1/result/<task_id>`` at the origin that answered the 504.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Sequence

import aiohttp
from yarl import URL

COMPLETED = "completed"
#: Statuses of a task that has not ended yet: it may still be computed after it was read.
UNENDED = frozenset({"queued", "batched", "running"})
#: Long-poll per read: a task still waiting somewhere gets this long to end before its state is taken.
READ_WAIT_S = 5.0
READ_CONCURRENCY = 32


def result_url(url: URL, task_id: str, wait_s: float) -> URL:
    """``/v1/result/<task_id>`` at the origin of the inference URL that answered."""
    return url.origin().with_path(f"/v1/result/{task_id}").with_query(wait=f"{wait_s:g}")


async def read_back(
    tasks: Sequence[tuple[URL, str]], *, wait_s: float = READ_WAIT_S, concurrency: int = READ_CONCURRENCY
) -> Counter[str]:
    """Each task's status after the run (``completed``, ``expired``, ...), counted; a read that
    fails counts as ``http_<status>`` or ``unreadable``."""
    statuses: Counter[str] = Counter()
    if not tasks:
        return statuses
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=wait_s + 10.0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout) as session:

        async def one(url: URL, task_id: str) -> None:
            async with gate:
                statuses[await _status(session, result_url(url, task_id, wait_s))] += 1

        await asyncio.gather(*(one(url, task_id) for url, task_id in tasks))
    return statuses


async def _status(session: aiohttp.ClientSession, url: URL) -> str:
    try:
        async with session.get(url) as response:
            if response.status != 200:
                return f"http_{response.status}"
            document = json.loads(await response.read())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return "unreadable"
    status = document.get("status") if isinstance(document, dict) else None
    return status if isinstance(status, str) else "unreadable"
