"""The fleet's contract, in memory, over the real Redis and over a Redis Cluster: each member's last beat,
forgotten after a minute."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio import Redis

from schemas.heartbeat import FORGET_AFTER_S, Beat
from schemas.wire import Names
from transport.memory.fleet import MemoryFleet
from transport.ports import Fleet
from transport.redis.fleet import RedisFleet

pytestmark = pytest.mark.timeout(60)


def beat(
    role: str,
    member_id: str,
    *,
    age_s: float = 0.0,
    state: str = "idle",
    rate: float = 0.0,
    pid: int = 7,
    final: bool = False,
) -> Beat:
    return Beat(
        role=role,
        id=member_id,
        host="h",
        pid=pid,
        version="0.1.0",
        models=("sim",),
        state=state,
        at_ms=int((time.time() - age_s) * 1000),
        interval_s=1.0,
        figures={"batches_per_s": rate},
        breakdowns={"flushes_per_s": {"full": rate}},
        per_model={"sim": {"queue_depth": 3.0}},
        final=final,
    )


@pytest.fixture
async def fleet(keyed_url: str | None, names: Names) -> AsyncIterator[Fleet]:
    made: Fleet = RedisFleet(keyed_url, names) if keyed_url is not None else MemoryFleet()
    await made.start()
    yield made
    await made.close()


async def test_each_member_keeps_its_last_beat_and_nothing_else(fleet: Fleet) -> None:
    await fleet.beat([beat("gateway", "g1"), beat("worker", "w1", rate=1.0)])
    await fleet.beat([beat("worker", "w1", state="busy", rate=9.5)])
    members = {(member.role, member.id): member for member in await fleet.members()}
    assert set(members) == {("gateway", "g1"), ("worker", "w1")}
    assert members["worker", "w1"].state == "busy"
    assert members["worker", "w1"].figures == {"batches_per_s": 9.5}
    assert members["worker", "w1"].breakdowns == {"flushes_per_s": {"full": 9.5}}
    assert members["worker", "w1"].per_model == {"sim": {"queue_depth": 3.0}}


async def test_a_role_and_an_id_name_a_member_together(fleet: Fleet) -> None:
    await fleet.beat([beat("batcher", "x"), beat("worker", "x")])
    assert sorted((member.role, member.id) for member in await fleet.members()) == [("batcher", "x"), ("worker", "x")]


async def test_two_processes_given_one_id_are_two_members(fleet: Fleet) -> None:
    await fleet.beat([beat("worker", "w1", pid=7)])
    await fleet.beat([beat("worker", "w1", pid=8)])
    await fleet.beat([beat("worker", "w1", pid=7, state="busy")])
    members = {member.pid: member.state for member in await fleet.members()}
    assert members == {7: "busy", 8: "idle"}, "each process keeps its own last beat; neither overwrites the other"


async def test_a_member_silent_for_a_minute_is_forgotten_and_a_recent_one_kept(fleet: Fleet) -> None:
    await fleet.beat([beat("worker", "dead", age_s=FORGET_AFTER_S + 5), beat("worker", "gone", age_s=10)])
    members = {member.id: member for member in await fleet.members()}
    assert set(members) == {"gone"}, "only the one past FORGET_AFTER_S is dropped"
    now_ms = int(time.time() * 1000)
    assert not members["gone"].live(now_ms), "ten seconds without a beat is gone, not idle"
    assert await fleet.members() == [members["gone"]]


async def test_no_beats_is_an_empty_fleet(fleet: Fleet) -> None:
    await fleet.beat([])
    assert await fleet.members() == []


@pytest.mark.kafka
async def test_a_field_that_is_no_beat_is_skipped_and_dropped(redis_url: str, names: Names) -> None:
    fleet = RedisFleet(redis_url, names)
    redis = Redis.from_url(redis_url)
    try:
        await redis.hset(names.fleet, mapping={"worker:broken": b"{not json", "worker:old": b'{"role": "worker"}'})
        await fleet.beat([beat("worker", "w1")])
        assert [member.id for member in await fleet.members()] == ["w1"]
        assert await redis.hkeys(names.fleet) == [b"worker:w1@h:7"], "what no reader can use is deleted"
    finally:
        await redis.aclose()
        await fleet.close()


async def test_the_fleet_hash_expires_once_no_process_beats_any_more(redis_url: str, names: Names) -> None:
    """Each beat keeps the hash alive a while past the point where every member in it would be forgotten: a
    deployment whose processes all stopped (a namespace taken down, a test's prefix) leaves no key behind."""
    fleet = RedisFleet(redis_url, names)
    redis = Redis.from_url(redis_url)
    try:
        await fleet.beat([beat("worker", "w1")])
        ttl_ms = await redis.pttl(names.fleet)
        assert FORGET_AFTER_S * 1000 < ttl_ms <= 3 * FORGET_AFTER_S * 1000, (
            f"the fleet hash's TTL is {ttl_ms} ms; expected one past FORGET_AFTER_S ({FORGET_AFTER_S} s), within a few "
            "times it (-1: it is never dropped once nobody beats)"
        )
    finally:
        await redis.aclose()
        await fleet.close()


async def test_a_later_releases_beat_with_figures_this_reader_cannot_read_is_listed_and_kept(
    redis_url: str, names: Names
) -> None:
    """A figure that is no number (a name, a null, a map of its own), in a beat of a release later than
    the reader's, is left out of what the reader shows; the beat itself is read, and stays in the fleet:
    dropped, the later member vanished from an earlier release's status, and was deleted from the hash
    that every process reads."""
    fleet = RedisFleet(redis_url, names)
    redis = Redis.from_url(redis_url)
    later = json.loads(beat("worker", "w2").encode())
    later["figures"] |= {"gpu": "H100", "p99_ms": None}
    later["breakdowns"]["latency_ms"] = {"p50": {"sim": 3.0}}
    later["breakdowns"]["shards"] = ["a", "b"]
    later["per_model"]["sim"]["latency"] = {"p50": 3.0}
    try:
        await redis.hset(names.fleet, mapping={"worker:w2@h:7": json.dumps(later)})
        members = await fleet.members()
        assert [member.id for member in members] == ["w2"], f"the later beat was not read: {members}"
        (member,) = members
        assert member.figures == {"batches_per_s": 0.0}, member.figures
        assert member.breakdowns == {"flushes_per_s": {"full": 0.0}}, member.breakdowns
        assert member.per_model == {"sim": {"queue_depth": 3.0}}, member.per_model
        assert await redis.hkeys(names.fleet) == [b"worker:w2@h:7"], "a later release's beat was deleted"
    finally:
        await redis.aclose()
        await fleet.close()


async def test_a_last_beat_is_kept_as_last_and_forgotten_a_minute_after_it_as_any_other(fleet: Fleet) -> None:
    """A member's last beat says so through the store, and expires as every beat does."""
    await fleet.beat([beat("worker", "w1", state="stopped", final=True, age_s=30), beat("worker", "w2", state="busy")])
    await fleet.beat([beat("worker", "w3", state="stopped", final=True, age_s=FORGET_AFTER_S + 5)])
    members = {member.id: member for member in await fleet.members()}
    assert set(members) == {"w1", "w2"}, "the last beat past FORGET_AFTER_S is dropped"
    assert (members["w1"].state, members["w1"].final, members["w2"].final) == ("stopped", True, False)


@pytest.mark.kafka
async def test_a_writer_drops_the_members_forgotten_while_nobody_reads_the_fleet(redis_url: str, names: Names) -> None:
    """Each process start adds a member (its pid is in its name), and only readers of the fleet dropped
    the dead ones: with nobody reading ``/v1/fleet``, the hash grew with every restart."""
    redis = Redis.from_url(redis_url)
    dead = [beat("worker", f"w{pid}", pid=pid, age_s=FORGET_AFTER_S + 5) for pid in range(50)]
    await redis.hset(names.fleet, mapping={member.key: member.encode() for member in dead})
    fleet = RedisFleet(redis_url, names)
    await fleet.start()
    try:
        await fleet.beat([beat("gateway", "g1")])
        await fleet.beat([beat("gateway", "g1")])
        fields = await redis.hkeys(names.fleet)
        assert fields == [beat("gateway", "g1").key.encode()], f"expected the live member alone, got {len(fields)}"
    finally:
        await redis.aclose()
        await fleet.close()


@pytest.mark.kafka
async def test_hosts_whose_clocks_disagree_see_each_others_beats_at_their_true_age(
    redis_url: str, names: Names
) -> None:
    """Beats cross hosts: a worker host 70 s behind and a gateway host 10 s ahead of Redis still see a beat
    just sent as just sent (by the hosts' own clocks it would be 80 s old: dropped as forgotten)."""

    def clock(skew_s: float) -> Callable[[], int]:
        return lambda: int((time.time() + skew_s) * 1000)

    behind, ahead = clock(-70.0), clock(10.0)
    writer = RedisFleet(redis_url, names, wall_ms=behind)
    reader = RedisFleet(redis_url, names, wall_ms=ahead)
    await writer.start()
    await reader.start()
    try:
        sent = beat("worker", "w1")
        await writer.beat([dataclasses.replace(sent, at_ms=behind())])
        members = await reader.members()
        assert [member.id for member in members] == ["w1"], "a beat just sent is not forgotten"
        age_s = (ahead() - members[0].at_ms) / 1000
        assert members[0].live(ahead()) and abs(age_s) < 2.0, f"a beat just sent reads {age_s:.1f} s old"
    finally:
        await writer.close()
        await reader.close()


@pytest.mark.kafka
@pytest.mark.parametrize(("skew_s", "warned"), [(6.0, True), (-6.0, True), (0.0, False)])
async def test_a_host_whose_clock_is_far_from_redis_says_so(
    redis_url: str, names: Names, caplog: pytest.LogCaptureFixture, skew_s: float, warned: bool
) -> None:
    """Credits and deadlines cross hosts in wall-clock time: a batcher host seconds ahead of a worker's
    drops every credit it offers. Beats measure each host against Redis's clock, so the skew is told."""
    writer = RedisFleet(redis_url, names, wall_ms=lambda: int((time.time() + skew_s) * 1000))
    with caplog.at_level("WARNING", logger="transport.redis.fleet"):
        await writer.start()
        await writer.close()
    told = [record.getMessage() for record in caplog.records if record.name == "transport.redis.fleet"]
    if warned:
        assert len(told) == 1 and f"{abs(skew_s):.1f} s" in told[0] and "NTP" in told[0], told
    else:
        assert told == [], told


@pytest.mark.kafka
async def test_a_host_whose_loop_stalled_while_reading_redis_clock_is_not_told_its_clock_is_off(
    redis_url: str, names: Names, caplog: pytest.LogCaptureFixture
) -> None:
    """A synchronised clock read around a stall (a loop busy loading a model as Redis's answer waits) is
    only known to be within half the round trip of Redis's: that is no skew to report."""
    reads = 0

    def stalled_wall_ms() -> int:  # the second read, after Redis answered, comes 3 s late
        nonlocal reads
        reads += 1
        return int((time.time() + (3.0 if reads == 2 else 0.0)) * 1000)

    writer = RedisFleet(redis_url, names, wall_ms=stalled_wall_ms)
    with caplog.at_level("WARNING", logger="transport.redis.fleet"):
        await writer.start()
        await writer.close()
    told = [record.getMessage() for record in caplog.records if record.name == "transport.redis.fleet"]
    assert told == [], f"a clock in step with Redis's was reported off: {told}"
