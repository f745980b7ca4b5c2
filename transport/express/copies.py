"""Express copies over Redis beside the Kafka records: faster hops at light load, Kafka stays the record.

This module holds the Redis side; ``express_batches`` and ``express_requests`` the transports that
send and read both copies.

Batches (batcher -> worker) and, at light load, requests (gateway -> batcher) take both ways.

Batches: a batch reaches its idle worker over Redis while Kafka takes the durable copy.

Over Kafka a batch crosses the broker (produce, append, the worker's parked fetch), a slower hop
than a push to a Redis list that the worker's BLPOP waits on. At low load that hop is a visible
part of every request's latency, so the batcher sends each batch both ways (first to the list of
the worker whose credit it spends, then to Kafka) and the worker runs whichever copy comes first:

* Kafka stays the record. The batcher commits its requests only once Kafka took the batch, and the
  worker commits a batch it ran from the express list only at its Kafka copy's offset, after the
  results are stored (a copy that is late is not waited for long: any later commit covers it).
* Each batch runs once: copies are matched by batch id, and the second to come is dropped.
* The express list only speeds things up. A worker clears its list when it starts (what an earlier
  run of it held comes again from Kafka), entries expire, and when Redis is slow Kafka's copy wins.
* If Kafka refuses a batch, the batcher takes the express copy back; if the worker took it already
  it runs it, so the batcher sends that same batch to Kafka until it lands rather than hand its
  items to another worker as well.
* A worker starts an express batch's call before it writes anything (``gpu_worker.worker``), so
  the push does, in one script, what the worker's admission would have done first: it counts the
  batch's delivery (``redis_deliveries``: an input that kills the worker at once has been counted,
  and its Kafka copy comes again as a redelivery), and it pushes nothing when one of the tasks has
  ended (cancelled or expired while it waited), leaving that batch to Kafka's copy, whose tasks the
  worker admits before it runs them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError

from schemas.wire import Names
from transport.ports import TransportError
from transport.redis.deliveries import DELIVERIES_TTL_S, deliveries_key
from transport.redis.lua import TERMINAL_RANK
from transport.redis.pools import CommandClient, PoolOptions, blocking_pool, translate

EXPRESS_POOL = PoolOptions(max_connections=4)
POPPERS = 2
"""BLPOPs a worker keeps armed at once (``ExpressBatchConsumer``), each on a connection of its own."""

# KEYS[1] the worker's express list, KEYS[2] the batch's delivery record, KEYS[3..] its tasks' hashes.
# ARGV[1] the encoded batch, ARGV[2] the list's ttl ms, ARGV[3] the record's ttl ms, ARGV[4] the
# lowest terminal rank. Returns 1 when pushed (and the delivery counted), 0 when a task had ended.
_PUSH = """
local terminal = tonumber(ARGV[4])
for i = 3, #KEYS do
  local rank = tonumber(redis.call('HGET', KEYS[i], 'rank'))
  if rank ~= nil and rank >= terminal then
    return 0
  end
end
redis.call('HINCRBY', KEYS[2], 'n', 1)
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


class RedisExpress:
    """The express lists: one Redis list per worker, pushed by batchers and popped by that worker."""

    def __init__(
        self,
        redis_url: str,
        names: Names,
        *,
        ttl_s: float = 30.0,
        deliveries_ttl_s: float = DELIVERIES_TTL_S,
        pool: PoolOptions = EXPRESS_POOL,
    ) -> None:
        self.names = names
        self.ttl_ms = int(ttl_s * 1000)
        self.deliveries_ttl_ms = int(deliveries_ttl_s * 1000)
        """How long a pushed batch's delivery record lives (the workers' ``RedisDeliveryLog`` ttl)."""
        self.pool = pool
        self._commands = CommandClient(redis_url, pool)
        self._push = self._commands.redis.register_script(_PUSH)
        self._blocking_pool = blocking_pool(redis_url, POPPERS, pool)
        self._blocking = Redis(connection_pool=self._blocking_pool)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        await self._commands.close()
        await self._blocking.aclose()
        await self._blocking_pool.disconnect()

    async def push(self, worker_id: str, data: bytes, batch_id: str, task_ids: Sequence[str]) -> bool:
        """Pushes a batch to its worker's list and counts that delivery of it, in one atomic step,
        unless one of its tasks has ended (cancelled or expired while it waited): then nothing is
        pushed and False comes back (Kafka's copy, admitted before it runs, carries it)."""
        key = self.names.express_list(worker_id)
        keys = [key, deliveries_key(self.names, batch_id), *(self.names.task_key(task) for task in task_ids)]
        args: list[bytes | int] = [data, self.ttl_ms, self.deliveries_ttl_ms, TERMINAL_RANK]
        try:
            return bool(await self._push(keys=keys, args=args))
        except RedisError as err:
            raise translate(f"pushing an express batch to {key}", err) from err

    async def publish(self, partition: int, data: bytes) -> None:
        """Publishes an express copy of a request to the batcher that owns its partition."""
        channel = self.names.express_channel(partition)
        try:
            await self._commands.redis.publish(channel, data)
        except RedisError as err:
            raise translate(f"publishing an express request to {channel}", err) from err

    async def retract(self, worker_id: str, data: bytes) -> bool:
        """Takes a pushed batch back; False when its worker popped it already."""
        key = self.names.express_list(worker_id)
        try:
            return bool(await self._commands.redis.lrem(key, 1, data))  # type: ignore[arg-type]
        except RedisError as err:
            raise translate(f"taking an express batch back from {key}", err) from err

    async def clear(self, worker_id: str) -> None:
        key = self.names.express_list(worker_id)
        try:
            await self._commands.redis.delete(key)
        except RedisError as err:
            raise translate(f"clearing {key}", err) from err

    async def pop(self, worker_id: str, timeout_s: float) -> bytes | None:
        key = self.names.express_list(worker_id)
        try:
            async with asyncio.timeout(timeout_s + self.pool.socket_timeout_s):
                popped = await self._blocking.blpop([key], timeout=timeout_s)
        except TimeoutError as err:
            raise TransportError(f"BLPOP {key} got no answer within {timeout_s:.1f} s: is Redis reachable?") from err
        except RedisError as err:
            raise translate(f"popping an express batch from {key}", err) from err
        if popped is None:
            return None
        value = popped[1]
        return value if isinstance(value, bytes) else value.encode()
