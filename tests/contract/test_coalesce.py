"""Coalescer: calls made while one is on its way go together; each caller gets its own result."""

from __future__ import annotations

import asyncio

import pytest

from transport.coalesce import Coalescer
from transport.ports import TransportError


class Recorder:
    def __init__(self, fail_on: str | None = None) -> None:
        self.batches: list[list[str]] = []
        self.fail_on = fail_on
        self.release = asyncio.Event()
        self.release.set()
        self.flushing = asyncio.Event()

    async def flush(self, items: list[str]) -> list[str]:
        self.batches.append(items)
        self.flushing.set()
        await self.release.wait()
        if self.fail_on in items:
            raise TransportError("boom")
        return [item.upper() for item in items]


async def in_flight(recorder: Recorder, items: tuple[str, ...]) -> tuple[Coalescer[str, str], list[asyncio.Task[str]]]:
    """Calls ``items`` with the recorder holding their flush open (it flushes once released)."""
    recorder.release.clear()
    coalesce: Coalescer[str, str] = Coalescer(recorder.flush)
    tasks = [asyncio.create_task(coalesce(x)) for x in items]
    await recorder.flushing.wait()
    return coalesce, tasks


async def test_calls_made_together_share_one_flush_and_get_their_own_results() -> None:
    recorder = Recorder()
    coalesce: Coalescer[str, str] = Coalescer(recorder.flush)

    results = await asyncio.gather(*(coalesce(x) for x in ("a", "b", "c")))

    assert results == ["A", "B", "C"]
    assert recorder.batches == [["a", "b", "c"]]


async def test_calls_made_during_a_flush_go_in_the_next_one() -> None:
    recorder = Recorder()
    coalesce, (first,) = await in_flight(recorder, ("a",))
    later = [asyncio.create_task(coalesce(x)) for x in ("b", "c")]
    recorder.release.set()

    assert await first == "A"
    assert [await task for task in later] == ["B", "C"]
    assert recorder.batches == [["a"], ["b", "c"]]


async def test_a_failing_flush_fails_its_own_callers_only() -> None:
    recorder = Recorder(fail_on="bad")
    coalesce, doomed = await in_flight(recorder, ("ok1", "bad"))
    fine = asyncio.create_task(coalesce("ok2"))
    recorder.release.set()

    for task in doomed:
        with pytest.raises(TransportError, match="boom"):
            await task
    assert await fine == "OK2"


async def test_close_fails_the_calls_still_waiting() -> None:
    coalesce, (waiting,) = await in_flight(Recorder(), ("a",))

    await coalesce.close(TransportError("closed"))
    with pytest.raises(TransportError, match="closed"):
        await waiting
