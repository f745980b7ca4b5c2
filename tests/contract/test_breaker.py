"""The circuit breaker: opens on a failure, refuses while open, probes in the background, closes on a success."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from tests.support.eventually import eventually
from transport.breaker import CircuitBreaker


class Dependency:
    """A probe target: ``up`` says what the probe answers; ``hang`` makes the probe never answer."""

    def __init__(self) -> None:
        self.up = False
        self.hang = False
        self.raises = False
        self.probes = 0
        self.probed = asyncio.Event()

    async def probe(self) -> bool:
        self.probes += 1
        self.probed.set()
        if self.raises:
            raise RuntimeError("a bug in the probe")
        if self.hang:
            await asyncio.Event().wait()
        return self.up

    async def next_probe(self) -> None:
        self.probed.clear()
        await asyncio.wait_for(self.probed.wait(), 5)


@pytest.fixture
async def dependency() -> Dependency:
    return Dependency()


@pytest.fixture
async def breaker(dependency: Dependency) -> AsyncIterator[CircuitBreaker]:
    breaker = CircuitBreaker("the test bus", dependency.probe, retry_s=0.02, probe_timeout_s=0.2)
    yield breaker
    await breaker.close()


def probing() -> bool:
    return any("breaker-probe" in task.get_name() for task in asyncio.all_tasks())


async def test_a_failure_opens_it_and_a_successful_probe_closes_it(
    breaker: CircuitBreaker, dependency: Dependency
) -> None:
    assert not breaker.open and breaker.reason == ""
    breaker.failed("a send failed: connection refused")
    assert breaker.open, "open at once: the next caller must not try"
    assert "connection refused" in breaker.reason and "down for" in breaker.reason, breaker.reason
    await dependency.next_probe()
    assert breaker.open, "a probe that found it down keeps it open"
    dependency.up = True
    await dependency.next_probe()  # the breaker acts on a probe's answer before anyone else runs
    assert not breaker.open, "a probe that reaches the dependency closes the breaker"
    assert breaker.opened == 1
    assert not probing(), "probing stops once closed"


async def test_failures_while_open_keep_one_probe(breaker: CircuitBreaker, dependency: Dependency) -> None:
    for n in range(50):
        breaker.failed(f"failure {n}")
    await dependency.next_probe()
    await dependency.next_probe()
    assert breaker.opened == 1
    assert "failure 49" in breaker.reason, "the latest failure is reported"
    probes = [task for task in asyncio.all_tasks() if "breaker-probe" in task.get_name()]
    assert len(probes) == 1, f"one probe at a time, found {len(probes)}"


async def test_a_failure_in_the_turn_a_probe_closed_it_probes_again() -> None:
    """A send that fails in the loop turn the probe reached the dependency (both woken by one
    connection event) opens the breaker before the ended probe's done callback has run."""
    dependency = Dependency()
    fail_with_the_probe = True

    async def probe() -> bool:
        nonlocal fail_with_the_probe
        up = await dependency.probe()
        if up and fail_with_the_probe:
            fail_with_the_probe = False
            asyncio.get_running_loop().call_soon(breaker.failed, "a send failed in the same turn")
        return up

    breaker = CircuitBreaker("the test bus", probe, retry_s=0.02, probe_timeout_s=0.2)
    try:
        breaker.failed("the first failure")
        dependency.up = True
        await eventually(lambda: not fail_with_the_probe, "a probe to reach the dependency")
        await dependency.next_probe()  # a new probe: without it, nothing would ever close the breaker
        await eventually(lambda: not breaker.open, "the breaker to close")
    finally:
        await breaker.close()


async def test_a_success_reported_from_outside_closes_it(breaker: CircuitBreaker) -> None:
    breaker.failed("a readiness probe found no connected leader")
    breaker.succeeded()
    assert not breaker.open


async def test_a_hanging_probe_is_bounded_and_counts_as_down(breaker: CircuitBreaker, dependency: Dependency) -> None:
    dependency.hang = True
    breaker.failed("timeout")
    await dependency.next_probe()
    await dependency.next_probe()  # the first one gave up after probe_timeout_s, and a second began
    assert breaker.open
    dependency.hang = False
    dependency.up = True
    await dependency.next_probe()  # the one after the hanging one gave up
    assert not breaker.open, "the breaker closes once a probe answers"


async def test_a_probe_that_raises_counts_as_down_and_probing_goes_on(
    breaker: CircuitBreaker, dependency: Dependency
) -> None:
    dependency.raises = True
    breaker.failed("timeout")
    await dependency.next_probe()
    await dependency.next_probe()
    assert breaker.open
    dependency.raises = False
    dependency.up = True
    await dependency.next_probe()
    assert not breaker.open, "probing goes on after a probe raised"


async def test_suspect_probes_once_and_opens_only_if_down(breaker: CircuitBreaker, dependency: Dependency) -> None:
    dependency.up = True
    breaker.suspect()
    await dependency.next_probe()
    assert not breaker.open, "a suspicion the probe disproves does not open the breaker"
    assert not probing(), "one probe, then no more"
    dependency.up = False
    breaker.suspect()
    await dependency.next_probe()
    assert breaker.open, "a suspicion the probe confirms opens the breaker"
    assert probing(), "and probing goes on until the dependency answers"


async def test_close_cancels_the_probe_and_later_failures_start_none(
    breaker: CircuitBreaker, dependency: Dependency
) -> None:
    dependency.hang = True
    breaker.failed("timeout")
    await dependency.next_probe()
    await breaker.close()
    assert not probing(), "close() ends the probe"
    breaker.failed("after close")
    breaker.suspect()
    assert not probing(), "no probe after close()"


def test_bad_timings_are_refused() -> None:
    async def probe() -> bool:
        return True

    with pytest.raises(ValueError, match="retry_s"):
        CircuitBreaker("x", probe, retry_s=0)


async def test_a_call_begun_before_the_breaker_closed_does_not_reopen_it_by_failing_late(
    dependency: Dependency,
) -> None:
    now = [0.0]
    breaker = CircuitBreaker("the test bus", dependency.probe, retry_s=0.02, probe_timeout_s=0.2, clock=lambda: now[0])
    try:
        breaker.failed("a send failed: connection refused")
        dependency.up = True
        now[0] = 10.0
        await dependency.next_probe()
        assert not breaker.open, "the dependency is back: a probe closed the breaker"
        breaker.failed("a send begun in the outage timed out", started_at=5.0)
        assert not breaker.open, "a call from before the close says nothing of the dependency since"
        breaker.failed("a send failed: connection refused", started_at=10.5)
        assert breaker.open, "a call begun after the close that fails opens it"
    finally:
        await breaker.close()


async def test_a_stall_of_the_event_loop_during_a_probe_does_not_open_it() -> None:
    """A probe whose answer came while the loop was blocked (a CPU-starved process) finds the dependency
    up: the stall is the gateway's, not the dependency's. The stall is the fault under test."""
    started = asyncio.Event()

    async def answers_at_once() -> bool:
        started.set()
        await asyncio.sleep(0.01)
        return True

    breaker = CircuitBreaker("the test bus", answers_at_once, retry_s=0.02, probe_timeout_s=0.2)
    try:
        breaker.suspect()
        async with asyncio.timeout(5):
            await started.wait()
        time.sleep(0.5)  # noqa: ASYNC251  # the stall under test: the loop blocked past the probe's timeout
        await eventually(lambda: not probing(), "the probe to end")
        assert breaker.opened == 0, "a probe answered in 10 ms opened the breaker: the loop's stall counted"
        assert not breaker.open
    finally:
        await breaker.close()
