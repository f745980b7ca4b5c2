"""The role supervisor: a crashed loop ends the process non-zero, a stuck shutdown cannot hang it, and a
start that fails part-way closes what started."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time

import pytest

from batchwire.cli import _run, build_parser
from batchwire.supervise import Parts, supervise
from gpu_worker.backends.base import BackendError


async def test_a_crashed_loop_makes_the_process_exit_non_zero() -> None:
    failed = asyncio.Event()
    closed: list[bool] = []

    async def start() -> None:
        asyncio.get_running_loop().call_later(0.05, failed.set)

    async def close() -> None:
        closed.append(True)

    assert await supervise(start, close, failed, failure_code=lambda: 75) == 75
    assert closed == [True], "the services are closed before exiting"


async def test_a_shutdown_that_hangs_is_cut_short() -> None:
    failed = asyncio.Event()

    async def start() -> None:
        failed.set()

    async def close() -> None:
        await asyncio.Event().wait()  # a broker that never answers

    started = time.monotonic()
    assert await supervise(start, close, failed, close_timeout_s=0.2) == 1
    assert time.monotonic() - started < 2


class Part:
    def __init__(self, name: str, log: list[str], fails: bool = False) -> None:
        self.name, self.log, self.fails = name, log, fails

    async def start(self) -> None:
        if self.fails:
            raise RuntimeError(f"{self.name} did not start")
        self.log.append(f"start {self.name}")

    async def close(self) -> None:
        self.log.append(f"close {self.name}")


async def test_a_start_that_fails_part_way_closes_what_started_in_reverse_and_raises() -> None:
    log: list[str] = []
    parts = Parts(Part("store", log), Part("fleet", log), Part("worker", log, fails=True), Part("after", log))
    with pytest.raises(RuntimeError, match="worker did not start"):
        await supervise(parts.start, parts.close, asyncio.Event())
    assert log == ["start store", "start fleet", "close fleet", "close store"], log


async def test_parts_close_in_reverse_once() -> None:
    log: list[str] = []
    parts = Parts(Part("a", log), Part("b", log))
    await parts.start()
    await parts.close()
    await parts.close()
    assert log == ["start a", "start b", "close b", "close a"], log


def test_a_model_that_does_not_load_at_a_roles_start_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def worker(args: argparse.Namespace) -> int:
        raise BackendError("the tokenizer in /models/x has no vocabulary")

    parser = build_parser()
    assert _run(parser.parse_args(["worker"]), worker, parser) == 2
    err = capsys.readouterr().err
    assert err == "batchwire worker: the model did not load: the tokenizer in /models/x has no vocabulary\n", err


class ClosesBadly(Part):
    async def close(self) -> None:
        self.log.append(f"close {self.name} failed")
        raise ConnectionError(f"{self.name}: connection reset")


async def test_a_close_that_fails_after_a_failed_start_hides_neither_the_start_error_nor_the_other_closes() -> None:
    log: list[str] = []
    parts = Parts(Part("store", log), ClosesBadly("fleet", log), Part("worker", log, fails=True))
    with pytest.raises(RuntimeError, match="worker did not start"):
        await supervise(parts.start, parts.close, asyncio.Event())
    assert log == ["start store", "start fleet", "close fleet failed", "close store"], log


class Loads(Part):
    """A part whose start takes minutes (a model loading), until it is cancelled."""

    def __init__(self, name: str, log: list[str], begun: asyncio.Event) -> None:
        super().__init__(name, log)
        self.begun = begun

    async def start(self) -> None:
        self.log.append(f"start {self.name} begun")
        self.begun.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.log.append(f"start {self.name} cut")
            raise


async def test_a_sigterm_during_the_start_exits_0_at_once_closing_what_started_and_starting_nothing_more() -> None:
    """A worker stopped while its model loads (a rolling restart, a scale-down of a replica still starting)
    neither waits out the load nor then joins its group, takes batches and leaves again."""
    log: list[str] = []
    begun = asyncio.Event()
    parts = Parts(Part("store", log), Loads("worker", log, begun), Part("after", log))
    loop = asyncio.get_running_loop()

    async def signalled() -> None:
        await begun.wait()
        os.kill(os.getpid(), signal.SIGTERM)

    sender = asyncio.create_task(signalled())
    started = time.monotonic()
    try:
        async with asyncio.timeout(10):
            code = await supervise(parts.start, parts.close, asyncio.Event())
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await sender
    took = time.monotonic() - started
    assert code == 0 and took < 3, f"a signal while starting exits 0 at once, got {code} after {took:.1f} s"
    assert log == ["start store", "start worker begun", "start worker cut", "close store"], log
