"""Idle workers' credits in Redis: one sorted set per model, scored by when each worker frees.

BZPOPMIN hands each credit to exactly one claimer (Redis pops atomically): the one whose worker is
idle longest, or frees soonest (a busy worker offers its next credit a little before its call
ends, scored at that end), and waiting claimers are served in arrival order, like the in-memory
pool.

Cancellation: a claim runs in a task owned by the pool and the caller awaits it shielded. If the
caller is cancelled while BZPOPMIN is in flight, it finishes and a credit it pops goes back with
its score. Only ``close()``, or a Redis that answers past the claim's grace, cuts a BZPOPMIN short,
and a credit popped in that instant is lost; workers re-offer their credit periodically, so a lost
credit idles its worker at most until the credit expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from schemas.codec import CodecError, decode_credit, encode_credit
from schemas.records import Credit
from schemas.wire import Names
from transport.cancelling import cancel_and_wait
from transport.ports import TransportError
from transport.redis.pools import REDIS_ERRORS, KeyedClient, PoolOptions, translate
from transport.redis.sentinel import PrimaryFollower

log = logging.getLogger(__name__)

# Redis reads a BZPOPMIN timeout of 0 as "forever"; shorter waits are rounded up to this.
_MIN_BLOCK_S = 0.001


# KEYS[1] the model's credit set. ARGV[1] the credit, ARGV[2] its score, ARGV[3] the most credits kept (the
# longest idle dropped), ARGV[4] how long the set is to live at least (ms). One command, not a pipeline: a
# cluster client resends a pipeline whose answer timed out, and an offer landing again after a batcher claimed
# it would put the claimed credit back.
_OFFER = """
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -tonumber(ARGV[3]) - 1)
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[4]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
"""

SET_OUTLIVES_MS = 60_000
"""How long a model's credit set outlives the credits offered to it: workers killed while idle never withdraw
theirs, and a set that no worker offers to any more then goes, instead of holding credits no claim can use."""


def _now_ms() -> int:
    # Credits carry wall-clock expiry (they cross processes), so this compares wall time on purpose.
    return int(time.time() * 1000)


@dataclass(slots=True)
class _Claim:
    abandoned: bool = False


CREDITS_POOL = PoolOptions(max_connections=8)  # offers, withdrawals and non-blocking pops


class RedisCreditPool:
    """``CreditPool`` over Redis sorted sets (``names.credit_queue(model)``) of Avro-encoded credits.

    ``max_claimers`` connections are reserved for blocking claims (one per concurrently claiming
    batcher loop, typically one per model); more concurrent claims wait for a connection within
    their own timeout. Each set is capped at ``max_credits`` (the longest idle dropped), so credits
    re-offered for a model nobody claims cannot grow it without bound.
    """

    def __init__(
        self,
        redis_url: str,
        names: Names,
        *,
        pool: PoolOptions = CREDITS_POOL,
        max_claimers: int = 16,
        claim_grace_s: float = 2.0,
        max_credits: int = 10_000,
        follower: PrimaryFollower | None = None,
    ) -> None:
        """``follower``: behind Sentinel, the one the process's pools share (``follower_of``)."""
        self.names = names
        self.claim_grace_s = claim_grace_s
        self.max_credits = max_credits
        self._commands = KeyedClient(redis_url, pool, follower=follower)
        self._claimers = KeyedClient(
            redis_url, dataclasses.replace(pool, max_connections=max_claimers), blocking=True, follower=follower
        )
        self._client = self._commands.redis
        self._blocking = self._claimers.redis
        self._offer = self._client.register_script(_OFFER)
        self._claims: set[asyncio.Task[Credit | None]] = set()
        self._closed = False

    async def start(self) -> None:
        self._closed = False
        await self._commands.start()
        await self._claimers.start()

    async def close(self) -> None:
        """Cancels claims in flight (see the module docstring), then closes every connection."""
        self._closed = True
        await asyncio.gather(*(cancel_and_wait(claim) for claim in list(self._claims)))
        await self._commands.close()
        await self._claimers.close()

    async def offer(self, credit: Credit, *, after_ms: int = 0) -> None:
        try:
            await self._add(credit, max(credit.idle_from_ms, after_ms))
        except REDIS_ERRORS as err:
            raise translate(f"offering credit {credit.worker_id}/{credit.seq} for {credit.model}", err) from err

    async def _add(self, credit: Credit, score: int) -> None:
        """Adds ``credit`` to its model's set, which then lives until a while after the credit expires."""
        lives_ms = max(0, credit.expires_at_ms - _now_ms()) + SET_OUTLIVES_MS
        await self._offer(
            keys=[self.names.credit_queue(credit.model)],
            args=[encode_credit(credit), score, self.max_credits, lives_ms],
        )

    async def withdraw(self, credit: Credit) -> None:
        try:
            await self._client.zrem(self.names.credit_queue(credit.model), encode_credit(credit))
        except REDIS_ERRORS as err:
            raise translate(f"withdrawing credit {credit.worker_id}/{credit.seq} for {credit.model}", err) from err

    async def idle(self, model: str) -> int:
        """Credits waiting in the set, expired ones included until a claim drops them."""
        try:
            return int(await self._client.zcard(self.names.credit_queue(model)))
        except REDIS_ERRORS as err:
            raise translate(f"counting credits for {model}", err) from err

    async def offered(self, model: str) -> list[Credit]:
        """Credits waiting in the set (undecodable members skipped), read without claiming them."""
        try:
            members = await self._client.zrange(self.names.credit_queue(model), 0, -1)
        except REDIS_ERRORS as err:
            raise translate(f"reading credits for {model}", err) from err
        credits = []
        for member in members:
            with contextlib.suppress(CodecError):
                credits.append(decode_credit(_as_bytes(member)))
        return credits

    async def claim(self, model: str, timeout_s: float) -> Credit | None:
        """The oldest unexpired credit, waiting up to ``timeout_s`` for one; expired credits are dropped."""
        if self._closed:
            raise TransportError("credit pool is closed")
        state = _Claim()
        task = asyncio.create_task(self._claim(model, timeout_s, state), name=f"claim-credit-{model}")
        self._claims.add(task)
        task.add_done_callback(functools.partial(self._claim_done, state))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            state.abandoned = True  # the task hands back a credit it pops from now on
            if task.done() and not task.cancelled() and task.exception() is None:
                credit = task.result()
                if credit is not None:  # popped in the same instant we were cancelled
                    self._spawn_hand_back(credit)
            raise

    def _claim_done(self, state: _Claim, task: asyncio.Task[Credit | None]) -> None:
        self._claims.discard(task)
        if state.abandoned and not task.cancelled() and task.exception() is not None:
            # Its caller is gone (cancelled), so nobody else will report this failure.
            log.warning("a cancelled caller's credit claim failed afterwards: %r", task.exception())

    def _spawn_hand_back(self, credit: Credit) -> None:
        async def hand_back() -> Credit | None:
            await self._hand_back(credit)
            return None

        task = asyncio.create_task(hand_back(), name=f"hand-back-credit-{credit.model}")
        self._claims.add(task)
        task.add_done_callback(functools.partial(self._claim_done, _Claim(abandoned=True)))

    async def _hand_back(self, credit: Credit) -> None:
        try:
            await self._add(credit, credit.idle_from_ms)
        except REDIS_ERRORS as err:
            log.warning("could not hand back credit %s/%s for %s: %s", credit.worker_id, credit.seq, credit.model, err)

    async def _claim(self, model: str, timeout_s: float, state: _Claim) -> Credit | None:
        key = self.names.credit_queue(model)
        deadline = time.monotonic() + timeout_s
        while True:
            raw = await self._pop(key, deadline - time.monotonic())
            if raw is None:
                return None
            try:
                credit = decode_credit(raw)
            except CodecError as err:
                log.warning("dropped an undecodable credit from %s: %s", key, err)
                continue
            if credit.expires_at_ms <= _now_ms():
                continue  # its worker re-offers a fresh one if it is still idle
            if state.abandoned:
                await self._hand_back(credit)
                return None
            return credit

    async def _pop(self, key: str, remaining_s: float) -> bytes | None:
        """One credit's bytes: BZPOPMIN while time remains, else one last non-blocking ZPOPMIN."""
        try:
            if remaining_s <= 0:
                got = await self._answer(self._blocking.zpopmin(key), key, self.claim_grace_s)
                return _as_bytes(got[0][0]) if got else None  # [(member, score)]
            blocking = self._blocking.bzpopmin([key], timeout=max(remaining_s, _MIN_BLOCK_S))
            popped = await self._answer(blocking, key, remaining_s + self.claim_grace_s)
        except REDIS_ERRORS as err:
            raise translate(f"claiming a credit from {key}", err) from err
        return None if popped is None else _as_bytes(popped[1])  # (key, member, score)

    async def _answer(self, pop: Awaitable[Any], key: str, wait_s: float) -> Any:
        """``pop``'s answer (a claimer's connection has no read timeout), run in a task of its own and waited
        for rather than cut off at its deadline: behind an event loop held up past the deadline (a GC pause,
        a starved process), Redis's answer is read in the turn the deadline fires, and the task takes it
        first. Cut off in that turn (``asyncio.timeout``, a command connection's socket timeout), the credit
        Redis popped would be lost, and its worker idle until it offers the next."""
        popping = asyncio.ensure_future(pop)
        try:
            await asyncio.wait({popping}, timeout=wait_s)
        except asyncio.CancelledError:  # the pool closes: the pop ends with the claim
            await cancel_and_wait(popping)
            raise
        if not popping.done():
            await cancel_and_wait(popping)
            raise TransportError(
                f"popping a credit from {key} got no answer within {wait_s:.1f} s: Redis is unreachable, or more "
                "claims run at once than max_claimers connections"
            )
        return popping.result()


def _as_bytes(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise TransportError(f"expected a credit's bytes from Redis, got {value!r}")
