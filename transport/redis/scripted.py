"""A pipeline that runs a Lua script by its SHA in one round trip, loading the script only when Redis lacks it.

redis-py's pipeline asks ``SCRIPT EXISTS`` before every execute of a pipeline that holds a
registered script: a second round trip, on the path of every answer that waits for a Redis replica
(``RedisTaskStore.apply_replicated``). Here the pipeline sends ``EVALSHA`` straight away; a
``NOSCRIPT`` reply (a fresh primary after a failover, or ``SCRIPT FLUSH``) loads the script and
sends the pipeline once more. Every command of such a pipeline must be safe to repeat.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

Call = tuple[list[str], list[Any]]
"""One call of a script: its keys and its arguments."""


async def replies_of(
    client: Redis, script: AsyncScript, calls: Sequence[Call], then: Callable[[Pipeline], None]
) -> list[Any]:
    """The replies of one pipeline (no transaction): ``script`` once per call, with its keys and
    arguments (a call without keys is not run), then the commands ``then`` queues. Each error reply
    is in its place, for a caller that uses the replies that came before it raises (``raise_first``)."""
    replies = await _run(client, script, calls, then)
    if any(isinstance(reply, NoScriptError) for reply in replies):
        await client.script_load(script.script)
        replies = await _run(client, script, calls, then)
    return replies


def raise_first(replies: Sequence[Any]) -> None:
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply


async def _run(
    client: Redis, script: AsyncScript, calls: Sequence[Call], then: Callable[[Pipeline], None]
) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for keys, args in calls:
        if keys:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
    then(pipe)
    replies: list[Any] = await pipe.execute(raise_on_error=False)
    return replies
