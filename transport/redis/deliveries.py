"""``DeliveryLog`` over Redis: one small hash per batch that came back, expiring on its own.

``<ns>:deliveries:<batch_id>`` holds ``n`` (deliveries so far), ``inflight`` (JSON list of the
task ids in flight right now, written before each backend call of a redelivered batch), ``note``
(why the last holder gave up) and ``call_s`` (the call time it expected then; empty: none), ``back``
(the last holder handed it back alive: no strikes; a mark or a note deletes it), ``s:<task_id>``
(strikes), and per receipt of the batch by a worker the answers it got: ``d:<receipt>`` (its
delivery number) and ``a:<receipt>`` (its suspects, JSON). A call retried after its reply was lost
(the connection dropped once the script ran) finds its answer there and changes nothing. The first
delivery of a batch costs one round trip (a script) and a committed batch one more (DEL); the rest
happens only for batches that came back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from schemas.wire import Names
from transport.deliveries import Suspects
from transport.redis.pools import REDIS_ERRORS, KeyedClient, PoolOptions, translate
from transport.redis.sentinel import PrimaryFollower

# KEYS[1] the batch's hash. ARGV[1] ttl ms, ARGV[2] the receipt. Returns the receipt's delivery number.
_BEGIN = """
local counted = redis.call('HGET', KEYS[1], 'd:' .. ARGV[2])
if counted then return tonumber(counted) end
local n = redis.call('HINCRBY', KEYS[1], 'n', 1)
redis.call('HSET', KEYS[1], 'd:' .. ARGV[2], n)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return n
"""

# KEYS[1] the batch's hash. ARGV[1] ttl ms, ARGV[2] the receipt, ARGV[3..] the task ids still to run.
# Returns {marked 0/1, note or '', handed back 0/1, call s or '', id1, strikes1, id2, strikes2, ...}: the receipt's
# first answer.
_SUSPECTS = """
local answered = redis.call('HGET', KEYS[1], 'a:' .. ARGV[2])
if answered then return cjson.decode(answered) end
local raw = redis.call('HGET', KEYS[1], 'inflight')
local note = redis.call('HGET', KEYS[1], 'note')
local call = redis.call('HGET', KEYS[1], 'call_s')
local back = redis.call('HGET', KEYS[1], 'back')
redis.call('HDEL', KEYS[1], 'inflight', 'note', 'call_s', 'back')
local given = {}
for i = 3, #ARGV do given[ARGV[i]] = true end
local suspects = {}
if back then  -- handed back alive: nothing is suspect
elseif raw then
  for _, id in ipairs(cjson.decode(raw)) do
    if given[id] then table.insert(suspects, id) end
  end
else
  for i = 3, #ARGV do table.insert(suspects, ARGV[i]) end
end
local out = {raw and 1 or 0, note or '', back and 1 or 0, call or ''}
for _, id in ipairs(suspects) do
  table.insert(out, id)
  table.insert(out, redis.call('HINCRBY', KEYS[1], 's:' .. id, 1))
end
redis.call('HSET', KEYS[1], 'a:' .. ARGV[2], cjson.encode(out))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return out
"""

# KEYS[1] the batch's hash. ARGV[1] ttl ms, ARGV[2] the receipt. Returns 1 if the hand-back is recorded:
# the receipt's delivery is the latest, and the first, or one that read the death before it.
_HAND_BACK = """
local counted = redis.call('HGET', KEYS[1], 'd:' .. ARGV[2])
if not counted or counted ~= redis.call('HGET', KEYS[1], 'n') then return 0 end
if counted ~= '1' and redis.call('HEXISTS', KEYS[1], 'a:' .. ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'back', 1)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""

# KEYS[1] the batch's hash. ARGV[1] ttl ms, ARGV[2..] fields and their values. A mark or a note undoes a
# hand-back (the batch still runs here, or hung). One command, not a MULTI: a cluster client resends a
# pipeline whose answer timed out, and this is sent once.
_RECORD = """
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('HDEL', KEYS[1], 'back')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
"""


DELIVERIES_TTL_S = 3600.0
"""How long a batch's delivery record outlives its last change (a committed batch's is deleted)."""

DELIVERIES_POOL = PoolOptions(max_connections=4)  # one batch at a time per worker


class RedisDeliveryLog:
    def __init__(
        self,
        redis_url: str,
        names: Names,
        *,
        ttl_s: float = DELIVERIES_TTL_S,
        pool: PoolOptions = DELIVERIES_POOL,
        follower: PrimaryFollower | None = None,
    ) -> None:
        """``follower``: behind Sentinel, the one the process's pools share (``follower_of``)."""
        self.names = names
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._commands = KeyedClient(redis_url, pool, follower=follower)
        self._client = self._commands.redis
        self._begin = self._client.register_script(_BEGIN)
        self._suspects = self._client.register_script(_SUSPECTS)
        self._hand_back = self._client.register_script(_HAND_BACK)
        self._record = self._client.register_script(_RECORD)

    async def start(self) -> None:
        await self._commands.start()

    async def close(self) -> None:
        await self._commands.close()

    async def begin(self, batch_id: str, receipt: str) -> int:
        key = self.names.delivery_record(batch_id)
        try:
            count = await self._begin(keys=[key], args=[self.ttl_ms, receipt])
        except REDIS_ERRORS as err:
            raise translate(f"counting a delivery of batch {batch_id}", err) from err
        return int(count)

    async def suspects(self, batch_id: str, task_ids: Sequence[str], receipt: str) -> Suspects:
        key = self.names.delivery_record(batch_id)
        try:
            reply: list[Any] = await self._suspects(keys=[key], args=[self.ttl_ms, receipt, *task_ids])
        except REDIS_ERRORS as err:
            raise translate(f"reading what was in flight of batch {batch_id}", err) from err
        marked, note, back, call, rest = int(reply[0]), _text(reply[1]), int(reply[2]), _text(reply[3]), reply[4:]
        strikes = {_text(rest[i]): int(rest[i + 1]) for i in range(0, len(rest), 2)}
        return Suspects(
            frozenset(strikes),
            strikes,
            marked=bool(marked),
            note=note or None,
            call_s=float(call) if call else None,
            handed_back=bool(back),
        )

    async def mark(self, batch_id: str, task_ids: Sequence[str]) -> None:
        await self._hset(batch_id, "marking tasks in flight", "inflight", json.dumps(list(task_ids)))

    async def note(self, batch_id: str, text: str, call_s: float | None = None) -> None:
        call = "" if call_s is None else repr(call_s)  # an empty field reads as none
        await self._hset(batch_id, "noting why a worker gave up", "note", text, "call_s", call)

    async def hand_back(self, batch_id: str, receipt: str) -> bool:
        key = self.names.delivery_record(batch_id)
        try:
            recorded = await self._hand_back(keys=[key], args=[self.ttl_ms, receipt])
        except REDIS_ERRORS as err:
            raise translate(f"recording the hand-back of batch {batch_id}", err) from err
        return bool(recorded)

    async def finish(self, batch_id: str) -> None:
        try:
            await self._client.delete(self.names.delivery_record(batch_id))
        except REDIS_ERRORS as err:
            raise translate(f"forgetting batch {batch_id}", err) from err

    async def _hset(self, batch_id: str, action: str, *fields: str) -> None:
        """Sets ``fields`` (name, value, name, value...) of the batch's record."""
        key = self.names.delivery_record(batch_id)
        try:
            await self._record(keys=[key], args=[self.ttl_ms, *fields])
        except REDIS_ERRORS as err:
            raise translate(f"{action} of batch {batch_id}", err) from err


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
