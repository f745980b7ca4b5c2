"""Retrying transport calls while Kafka or Redis is away: one policy for every role's loops."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from transport.ports import TransportError

T = TypeVar("T")


class Retrying(Protocol):
    """A role's ``retry`` with its log, name and limits bound: ``await retrying("storing results", op)``."""

    def __call__(self, what: str, op: Callable[[], Awaitable[T]], /) -> Awaitable[T]: ...


def backoff_s(tries: int, max_s: float, first_s: float = 0.1) -> float:
    """The pause after the ``tries``-th failure in a row: ``first_s``, doubling with each failure, at most
    ``max_s``; the doubling stops after the tenth, so that no count of failures overflows it."""
    return min(max_s, first_s * 2.0 ** min(tries - 1, 9))


def told(failures: int) -> bool:
    """Whether the ``failures``-th failure in a row is logged: the first and every 20th, so an outage
    logs little."""
    return failures == 1 or failures % 20 == 0


async def pause(log: logging.Logger, who: str, what: str, err: TransportError, failures: int, max_s: float) -> None:
    """Logs the first failure and every 20th (``told``), then backs off exponentially (``backoff_s``)."""
    if told(failures):
        log.warning("%s: %s failed (%d tries so far): %s; retrying", who, what, failures, err)
    await asyncio.sleep(backoff_s(failures, max_s))


async def retry(
    log: logging.Logger,
    who: str,
    what: str,
    op: Callable[[], Awaitable[T]],
    max_pause_s: float,
    give_up: Callable[[], bool] = lambda: False,
) -> T:
    """``op`` until it works; raises an error that retrying cannot fix, or any once ``give_up()`` holds."""
    failures = 0
    while True:
        try:
            result = await op()
        except TransportError as err:
            if not err.retriable or give_up():
                raise
            failures += 1
            await pause(log, who, what, err, failures, max_pause_s)
            continue
        if failures:
            log.info("%s: %s works again after %d failed tries", who, what, failures)
        return result
