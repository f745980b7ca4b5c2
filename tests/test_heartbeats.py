"""``Heartbeats``: a beat each period from start to close, through a store that fails for a while."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import pytest

from batchwire.fleet import LAST_BEAT_S, Heartbeats
from schemas.heartbeat import Beat
from telemetry.heartbeat import Window
from tests.support.eventually import eventually
from transport.memory.fleet import MemoryFleet
from transport.ports import TransportError


def beat(window: Window) -> Beat:
    now_ms = int(time.time() * 1000)
    return Beat("worker", "w1", "h", 1, "0", ("sim",), "idle", now_ms, 1.0, figures={"window_s": window.interval_s})


class FlakyFleet(MemoryFleet):
    """Refuses the first ``failures`` beats, as a store that is down would."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        self.stored = 0

    async def beat(self, beats: Sequence[Beat]) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise TransportError("storing a heartbeat failed: connection refused")
        self.stored += 1
        await super().beat(beats)


async def test_beats_land_each_period_after_the_store_comes_back_and_stop_at_close() -> None:
    fleet = FlakyFleet(failures=3)
    heartbeats = Heartbeats(fleet, lambda window: [beat(window)], interval_s=0.01)
    await heartbeats.start()
    await eventually(lambda: fleet.stored >= 3, "beats to land once the store takes them")
    await heartbeats.close()
    stopped_at = fleet.stored
    members = await fleet.members()
    assert [(member.role, member.id) for member in members] == [("worker", "w1")]
    assert 0 < members[0].figures["window_s"] < 1.0, "each beat's window is the period since the last read"
    await asyncio.sleep(0.05)  # five periods with nothing running: no beat may land after close
    assert fleet.stored == stopped_at


async def test_a_fault_in_building_a_beat_is_survived() -> None:
    fleet = MemoryFleet()
    calls = 0

    def beats(window: Window) -> list[Beat]:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise KeyError("a figure that is not there")
        return [beat(window)]

    heartbeats = Heartbeats(fleet, beats, interval_s=0.01)
    await heartbeats.start()
    try:
        await eventually(lambda: calls >= 4, "the loop to go on after a faulty beat")
    finally:
        await heartbeats.close()
    assert [(member.role, member.id) for member in await fleet.members()] == [("worker", "w1")]


async def test_the_first_beat_goes_at_start_without_rates_and_beat_soon_sends_the_next_at_once() -> None:
    fleet = FlakyFleet(failures=0)
    windows: list[float] = []

    def beats(window: Window) -> list[Beat]:
        windows.append(window.interval_s)
        return [beat(window)]

    heartbeats = Heartbeats(fleet, beats, interval_s=3600.0)
    await heartbeats.start()
    try:
        await eventually(lambda: fleet.stored == 1, "the first beat, a period sooner than the period")
        heartbeats.beat_soon()
        await eventually(lambda: fleet.stored == 2, "the beat beat_soon asked for")
    finally:
        await heartbeats.close()
    assert windows[0] < 1e-6, f"the first beat's window has no length (no rates over no time): {windows}"
    assert windows[1] < 1e-6, f"nor has the one asked for at once (no rates over a sliver of a period): {windows}"


def stateful(state: list[str]) -> Callable[[Window], list[Beat]]:
    """Beats in the state ``state[0]`` holds when each is built."""

    def beats(window: Window) -> list[Beat]:
        now_ms = int(time.time() * 1000)
        return [Beat("worker", "w1", "h", 1, "0", ("sim",), state[0], now_ms, 1.0)]

    return beats


@pytest.mark.parametrize(
    ("at_close", "shown"),
    [
        ("draining", "stopped"),
        ("idle", "stopped"),
        ("hung", "hung"),
        ("failed", "failed"),
        ("starting", "failed"),  # its start did not finish: the role never came up
    ],
)
async def test_close_sends_a_last_beat_saying_how_the_member_stopped(at_close: str, shown: str) -> None:
    fleet = FlakyFleet(failures=0)
    state = ["busy"]
    heartbeats = Heartbeats(fleet, stateful(state), interval_s=3600.0)
    await heartbeats.start()
    await eventually(lambda: fleet.stored == 1, "the first beat")
    state[0] = at_close
    await heartbeats.close()
    assert fleet.stored == 2, "one last beat at close"
    [member] = await fleet.members()
    assert (member.state, member.final) == (shown, True), member
    assert not member.live(member.at_ms), "a member's last beat is not live, however fresh"


class StuckFleet(MemoryFleet):
    """A store that takes the first beat, then never answers, as one behind a dropped network does."""

    def __init__(self) -> None:
        super().__init__()
        self.stored = 0

    async def beat(self, beats: Sequence[Beat]) -> None:
        if self.stored:
            await asyncio.Event().wait()
        self.stored += 1
        await super().beat(beats)


async def test_the_last_beat_waits_at_most_a_short_bound_for_the_store() -> None:
    fleet = StuckFleet()
    heartbeats = Heartbeats(fleet, stateful(["idle"]), interval_s=3600.0)
    await heartbeats.start()
    await eventually(lambda: fleet.stored == 1, "the first beat")
    async with asyncio.timeout(LAST_BEAT_S + 5):  # generous: the bound is LAST_BEAT_S
        await heartbeats.close()
    [member] = await fleet.members()
    assert not member.final, "the last beat never landed: the first one is all the store has"


async def test_a_heartbeat_never_started_sends_no_last_beat() -> None:
    """A role whose parts failed before its heartbeats started was never shown; nothing is sent for it."""
    fleet = FlakyFleet(failures=0)
    await Heartbeats(fleet, stateful(["idle"])).close()
    assert fleet.stored == 0 and await fleet.members() == []
