"""The Kafka gateway's transports, started and closed with the app, and their readiness."""

from __future__ import annotations

import asyncio
from typing import Any

from batchwire.fleet import Heartbeats
from batchwire.settings import SharedSettings
from batchwire.supervise import Parts
from gateway.health import Down, Ready, probe
from gateway.settings import REQUEST_RUN, GatewaySettings
from transport.kafka.lag import KafkaQueueDepth
from transport.kafka.producers import KafkaRequestProducer
from transport.ports import RequestProducer
from transport.redis.cache import RedisResultCache
from transport.redis.credits import RedisCreditPool
from transport.redis.fleet import RedisFleet
from transport.redis.limits import RedisRateLimiter
from transport.redis.pools import follower_of, redacted
from transport.redis.sentinel import is_sentinel_url, master_state
from transport.redis.store import RedisTaskStore
from transport.routing import Partitioner

REFUSAL_WATCH_S = 0.5
"""How often a gateway asks whether Redis refuses writes: a synchronous submit waits for an answer that
such a Redis cannot store, so it is refused at once instead (``transport.redis.write_refusal``)."""
KAFKA_READY_S = 1.0
"""The request producer's own bound on a readiness probe and on its breaker's probes: no answer within it
is down."""
KAFKA_PROBE_SLACK_S = 0.15
"""How much longer /readyz waits for that probe than its own bound: the probe must end by itself, so that
its finding reaches the breaker (cut short, a frozen broker's probe would leave submits waiting on it)."""


class GatewayTransports:
    """The gateway's Kafka producer, Redis store, queue-depth reader, credit reader and rate limiter,
    as the app's lifecycle.

    The queue-depth reader (request topic lag, refreshed in the background) exists only when
    ``max_queue_depth`` or ``admit_by_wait`` is on, the Redis rate limiter only when ``rate_limit_per_s`` is,
    the result cache (in the task store's Redis) only when ``cache_ttl_s`` is, the credit reader (the
    rates the workers state, for admission) only when ``admit_by_wait`` is.
    """

    def __init__(self, shared: SharedSettings, settings: GatewaySettings) -> None:
        self.shared = shared
        bootstrap = shared.require_kafka()
        redis_url = shared.require_redis()
        partitioner = Partitioner(shared.models, shared.request_partitions, run=REQUEST_RUN)
        self.producer: RequestProducer = KafkaRequestProducer(
            bootstrap, shared.names, partitioner, linger_ms=settings.request_linger_ms, ready_timeout_s=KAFKA_READY_S
        )
        follower = follower_of(redis_url)  # one for every pool: the Sentinels are asked once a round
        self.store = RedisTaskStore(
            redis_url, shared.names, ttl_s=shared.result_ttl_s, refusal_watch_s=REFUSAL_WATCH_S, follower=follower
        )
        self.redis_url = redis_url
        self.ready_timeout_s = settings.ready_timeout_s
        self.queue_depth: KafkaQueueDepth | None = None
        self.credits: RedisCreditPool | None = None  # read only, for the rates the workers state
        if settings.admit_by_wait:
            self.credits = RedisCreditPool(redis_url, shared.names, max_claimers=1, follower=follower)
        if settings.max_queue_depth > 0 or settings.admit_by_wait:
            self.queue_depth = KafkaQueueDepth(
                bootstrap,
                shared.names,
                shared.request_partitions,
                models=shared.models,
                count_batches=True,
            )
        self.limiter: RedisRateLimiter | None = None
        if settings.rate_limit_per_s > 0:
            self.limiter = RedisRateLimiter(
                redis_url,
                shared.names,
                settings.rate_limit_per_s,
                settings.rate_limit_burst_tokens,
                follower=follower,
            )

        self.cache: RedisResultCache | None = None
        if settings.cache_ttl_s > 0:
            self.cache = RedisResultCache(redis_url, shared.names, follower=follower)
        self.fleet = RedisFleet(redis_url, shared.names, follower=follower)
        self.heartbeats: Heartbeats | None = None
        """Set by the composition root (it builds the gateway's beat); started last, closed first."""
        self._parts = Parts()

    async def start(self) -> None:
        """The parts in order, the heartbeats last; ``close`` closes those that started, in reverse."""
        parts = (
            self.store,
            self.cache,
            self.producer,
            self.queue_depth,
            self.credits,
            self.limiter,
            self.fleet,
            self.heartbeats,
        )
        self._parts = Parts(*(part for part in parts if part is not None))
        await self._parts.start()

    async def close(self) -> None:
        await self._parts.close()

    async def ready(self) -> dict[str, Any]:
        """Each part's readiness (``gateway.health.Ready``), each probed once, Kafka and Redis side by side
        (a frozen broker's probe takes its full second): Redis says whether it is failing over."""
        # Within the route's bound on the whole (``ready_timeout_s``): half for the probes (Kafka's a little
        # more, so that its own bound ends it), four tenths for the Sentinels, asked only when Redis is down.
        probe_s = self.ready_timeout_s * 0.5
        kafka_s = max(probe_s, KAFKA_READY_S + KAFKA_PROBE_SLACK_S)
        kafka, store = await asyncio.gather(
            probe(self.producer.ready(), kafka_s, "kafka"), probe(self.store.ready(), probe_s, "redis")
        )
        redis_ready = await redis_readiness(store, self.redis_url, timeout_s=self.ready_timeout_s * 0.4)
        checks: dict[str, Ready] = {
            "kafka": kafka
            or Down("down", "the request topic's leader does not answer (its broker is down, frozen or replaced)"),
            "redis": redis_ready,
        }
        if self.queue_depth is not None:
            checks["queue_depth"] = self.queue_depth.alive
        return checks


async def redis_readiness(ready: bool, redis_url: str, timeout_s: float) -> Ready:
    """The task store's readiness; when it is down behind Sentinel, whether the Sentinels are failing
    it over (asked only then, so a ready Redis costs no extra round trip)."""
    if ready:
        return True
    if not is_sentinel_url(redis_url):
        return Down("down", f"Redis at {redacted(redis_url)} does not answer, or the change feed is reconnecting")
    try:
        async with asyncio.timeout(timeout_s):
            master = await master_state(redis_url, timeout_s / 2)
    except TimeoutError:
        return Down("down", f"Redis does not answer, nor do the Sentinels within {timeout_s} s")
    return Down("failing over" if master.failing_over else "down", master.reason)
