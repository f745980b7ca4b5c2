"""Pipeline: the loop and the backend calls it starts share one TaskGroup."""

from __future__ import annotations

import asyncio

import pytest

from gpu_worker.calls import GroupResult
from gpu_worker.pipeline import Pipeline
from gpu_worker.runner import BackendRunner


async def test_a_failing_call_cancels_the_loop_and_the_calls_behind_it() -> None:
    runner = BackendRunner("test")
    pipeline = Pipeline(runner)
    cancelled: list[str] = []

    async def waits(name: str) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(name)
            raise

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("the call failed")

    async def loop() -> None:
        pipeline.start("b1", GroupResult(), 1, fails())
        pipeline.start("b1", GroupResult(), 1, waits("queued call"))
        await waits("loop")

    with pytest.raises(ExceptionGroup) as raised:
        await asyncio.wait_for(pipeline.run(loop), 5)
    runner.close()
    assert [str(err) for err in raised.value.exceptions] == ["the call failed"]
    assert sorted(cancelled) == ["loop", "queued call"], f"both stop, got {cancelled}"
    assert pipeline.empty


async def test_run_ends_once_the_calls_the_loop_started_have_ended() -> None:
    runner = BackendRunner("test")
    pipeline = Pipeline(runner)
    release = asyncio.Event()
    ended: list[str] = []

    async def call() -> None:
        await release.wait()
        ended.append("call")

    async def loop() -> None:
        with pipeline.handling():
            pipeline.start("b1", GroupResult(), 1, call())
        ended.append("loop")

    running = asyncio.ensure_future(pipeline.run(loop))
    await asyncio.sleep(0.01)
    assert ended == ["loop"] and not running.done() and not pipeline.empty
    drained = asyncio.ensure_future(pipeline.drained())
    await asyncio.sleep(0.01)
    assert not drained.done(), "a call in flight: not drained"
    release.set()
    await asyncio.wait_for(asyncio.gather(running, drained), 5)
    runner.close()
    assert ended == ["loop", "call"] and pipeline.empty


async def test_a_call_started_as_the_group_shuts_down_is_closed_not_left_unawaited() -> None:
    """A failed call aborts the group; the loop, still running its cleanup, may start another (the batch
    behind). The group refuses it: the coroutine must be closed there, or Python warns that it was never
    awaited, a task no one owns."""
    runner = BackendRunner("test")
    pipeline = Pipeline(runner)
    refused: list[str] = []
    late = None

    async def fails() -> None:
        raise RuntimeError("the call failed")

    async def answers() -> None:
        return None

    async def loop() -> None:
        nonlocal late
        pipeline.start("b1", GroupResult(), 1, fails())
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            late = answers()
            try:
                pipeline.start("b2", GroupResult(), 1, late)
            except RuntimeError as err:
                refused.append(str(err))
            raise

    with pytest.raises(ExceptionGroup):
        await asyncio.wait_for(pipeline.run(loop), 5)
    runner.close()
    assert refused and "shutting down" in refused[0], refused
    assert late is not None and late.cr_frame is None, "the refused call's coroutine was left open"
