"""The fleet in Redis: one hash, ``<ns>:fleet``, of member name to its last heartbeat (JSON).

A process writes its beats with one ``HSET`` a second. Readers drop members whose last beat is older
than ``FORGET_AFTER_S`` (``HDEL``), and so does each writer once every ``FORGET_AFTER_S``, so the hash
holds the processes of the last minute or two, whatever died, even while nobody reads the fleet: each
process start adds a member. Redis 7.0 has no per-field expiry, and a key per member would cost a
``SCAN`` per read.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

from schemas.heartbeat import FORGET_AFTER_S, Beat, decode_beat
from schemas.wire import Names
from transport.ports import TransportError
from transport.redis.pools import REDIS_ERRORS, KeyedClient, PoolOptions, translate
from transport.redis.sentinel import PrimaryFollower

FLEET_POOL = PoolOptions(max_connections=2, socket_timeout_s=1.0, pool_timeout_s=1.0)
"""A beat a second and the fleet views' reads: a slow Redis delays a heartbeat, never a request."""


class RedisFleet:
    """``Fleet`` over one Redis hash."""

    def __init__(
        self, redis_url: str, names: Names, *, pool: PoolOptions = FLEET_POOL, follower: PrimaryFollower | None = None
    ) -> None:
        """``follower``: behind Sentinel, the one the process's pools share (``follower_of``)."""
        self.names = names
        self._commands = KeyedClient(redis_url, pool, follower=follower)
        self._client = self._commands.redis
        self._prune_at_s = 0.0
        """When this writer next drops the forgotten members (monotonic): at its first beat, then once
        every ``FORGET_AFTER_S``."""

    async def start(self) -> None:
        await self._commands.start()

    async def close(self) -> None:
        await self._commands.close()

    async def beat(self, beats: Sequence[Beat]) -> None:
        if not beats:
            return
        try:
            await self._client.hset(self.names.fleet, mapping={beat.key: beat.encode() for beat in beats})
        except REDIS_ERRORS as err:
            raise translate("storing a heartbeat", err) from err
        if (now_s := time.monotonic()) >= self._prune_at_s:
            self._prune_at_s = now_s + FORGET_AFTER_S
            with contextlib.suppress(TransportError):  # the beat is stored; the next pruning drops them
                await self.members()

    async def members(self) -> list[Beat]:
        try:
            raw = await self._client.hgetall(self.names.fleet)
        except REDIS_ERRORS as err:
            raise translate("reading the fleet", err) from err
        now_ms = int(time.time() * 1000)  # beats carry wall time: they cross processes and hosts
        members: list[Beat] = []
        forgotten: list[bytes | str] = []
        for key, value in raw.items():
            beat = decode_beat(value)
            if beat is None or beat.forgotten(now_ms):
                forgotten.append(key)
            else:
                members.append(beat)
        if forgotten:
            try:
                await self._client.hdel(self.names.fleet, *forgotten)
            except REDIS_ERRORS as err:
                raise translate("dropping forgotten fleet members", err) from err
        return members
