"""The fleet in Redis: one hash, ``<ns>:fleet``, of member name to its last heartbeat (JSON).

A process writes its beats with one ``HSET`` a second. Readers drop members whose last beat is older
than ``FORGET_AFTER_S`` (``HDEL``), and so does each writer once every ``FORGET_AFTER_S``, so the hash
holds the processes of the last minute or two, whatever died, even while nobody reads the fleet: each
process start adds a member. Redis 7.0 has no per-field expiry, and a key per member would cost a
``SCAN`` per read. Each beat also sets the hash to expire ``FLEET_KEY_TTL_S`` later: past then every member
in it would be forgotten anyway, and a deployment whose processes all stopped leaves no key behind.

Beats are stored in Redis's clock (``TIME``) and read back in the reader's: a beat's age is then right
between hosts whose clocks disagree (a host seconds behind would show its members gone, a minute behind
have them dropped at every read). Each process measures how far its clock is from Redis's at start and
once every ``FORGET_AFTER_S``, and warns when it is ``SKEW_WARN_MS`` or more beyond what the read's round
trip leaves unknown: credits and deadlines cross hosts in the writer's wall-clock time, which nothing
corrects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from schemas.heartbeat import FORGET_AFTER_S, Beat, decode_beat
from schemas.wire import Names
from transport.ports import TransportError
from transport.redis.pools import REDIS_ERRORS, KeyedClient, PoolOptions, translate
from transport.redis.sentinel import PrimaryFollower

log = logging.getLogger(__name__)

SKEW_WARN_MS = 1000
"""A clock this far from Redis's is told (WARNING): a credit is stamped with its worker's clock and claimed
by a batcher's, a deadline set by a gateway's and read by a batcher's and a worker's."""

FLEET_KEY_TTL_S = 2 * FORGET_AFTER_S
"""How long the hash outlives the last beat written to it: longer than any member in it is kept."""

# KEYS[1] the fleet hash. ARGV[1] its TTL in ms, then field, value pairs. One command: a beat and the
# expiry that goes with it land together.
_BEAT = """
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
"""

FLEET_POOL = PoolOptions(max_connections=2, socket_timeout_s=1.0, pool_timeout_s=1.0)
"""A beat a second and the fleet views' reads: a slow Redis delays a heartbeat, never a request."""


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class RedisFleet:
    """``Fleet`` over one Redis hash."""

    def __init__(
        self,
        redis_url: str,
        names: Names,
        *,
        pool: PoolOptions = FLEET_POOL,
        follower: PrimaryFollower | None = None,
        wall_ms: Callable[[], int] = _wall_ms,
    ) -> None:
        """``follower``: behind Sentinel, the one the process's pools share (``follower_of``). ``wall_ms``:
        this host's clock, the one beats are stamped with and read in."""
        self.names = names
        self._commands = KeyedClient(redis_url, pool, follower=follower)
        self._client = self._commands.redis
        self._beat = self._client.register_script(_BEAT)
        self._wall_ms = wall_ms
        self._ahead_ms = 0
        """How far this host's clock is ahead of Redis's (negative: behind)."""
        self._prune_at_s = 0.0
        """When this writer next drops the forgotten members (monotonic): at its first beat, then once
        every ``FORGET_AFTER_S``."""

    async def start(self) -> None:
        await self._commands.start()
        with contextlib.suppress(TransportError):  # the first pruning measures it again
            await self._measure_clock()

    async def _measure_clock(self) -> None:
        before = self._wall_ms()
        try:
            seconds, micros = await self._client.time()
        except REDIS_ERRORS as err:
            raise translate("reading Redis's clock", err) from err
        after = self._wall_ms()
        self._ahead_ms = ahead_ms = (before + after) // 2 - (seconds * 1000 + micros // 1000)
        # Redis read its clock somewhere in the round trip: a stall in it (a busy loop) is no skew.
        if abs(ahead_ms) - (after - before) // 2 >= SKEW_WARN_MS:
            log.warning(
                "this host's clock is %.1f s %s Redis's: credits and deadlines cross hosts by their wall clocks, so "
                "a batcher's host ahead of a worker's by a credit's lifetime (--credit-ttl-s) drops all its credits, "
                "and requests expire early or late by the difference; synchronise the hosts' clocks (NTP)",
                abs(ahead_ms) / 1000,
                "ahead of" if ahead_ms > 0 else "behind",
            )

    async def close(self) -> None:
        await self._commands.close()

    async def beat(self, beats: Sequence[Beat]) -> None:
        if not beats:
            return
        ahead_ms = self._ahead_ms
        fields: list[str | bytes] = []
        for beat in beats:
            fields += (beat.key, dataclasses.replace(beat, at_ms=beat.at_ms - ahead_ms).encode())
        try:
            await self._beat(keys=[self.names.fleet], args=[round(FLEET_KEY_TTL_S * 1000), *fields])
        except REDIS_ERRORS as err:
            raise translate("storing a heartbeat", err) from err
        if (now_s := time.monotonic()) >= self._prune_at_s:
            self._prune_at_s = now_s + FORGET_AFTER_S
            with contextlib.suppress(TransportError):  # the beat is stored; the next pruning drops them
                await self._measure_clock()
                await self.members()

    async def members(self) -> list[Beat]:
        try:
            raw = await self._client.hgetall(self.names.fleet)
        except REDIS_ERRORS as err:
            raise translate("reading the fleet", err) from err
        ahead_ms = self._ahead_ms
        now_ms = self._wall_ms() - ahead_ms  # Redis's clock, which the beats are stored in
        members: list[Beat] = []
        forgotten: list[bytes | str] = []
        for key, value in raw.items():
            beat = decode_beat(value)
            if beat is None or beat.forgotten(now_ms):
                forgotten.append(key)
            else:
                members.append(dataclasses.replace(beat, at_ms=beat.at_ms + ahead_ms) if ahead_ms else beat)
        if forgotten:
            try:
                await self._client.hdel(self.names.fleet, *forgotten)
            except REDIS_ERRORS as err:
                raise translate("dropping forgotten fleet members", err) from err
        return members
