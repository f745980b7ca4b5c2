"""Redis commands per request: the difference of two INFO counts, the bench's own INFO left out."""

from __future__ import annotations

import uuid

import pytest
import redis

from batchwire.bench.redis_info import bytes_per_request, counts, per_request
from transport.redis.pools import sync_client
from transport.redis.sentinel import check_sentinels, is_sentinel_url


def test_commands_between_two_counts_are_divided_by_the_answers() -> None:
    start = {"hset": 10, "publish": 5, "info": 1}
    end = {"hset": 310, "publish": 205, "info": 3, "evalsha": 100}
    got = per_request(start, end, answers=100)
    assert got["total"] == 600
    assert got["per_request"] == 6.0
    assert got["by_command"] == {"hset": 3.0, "publish": 2.0, "evalsha": 1.0}


def test_no_answers_gives_no_ratio() -> None:
    assert per_request({}, {"get": 4}, answers=0)["per_request"] is None


def test_the_memory_a_request_leaves_is_the_growth_per_answer() -> None:
    assert bytes_per_request(1_000_000, 1_500_000, answers=400) == 1250.0
    assert bytes_per_request(1_000_000, 900_000, answers=400) is None, "memory freed in the window: no figure"
    assert bytes_per_request(1_000_000, 1_500_000, answers=0) is None


@pytest.mark.kafka
@pytest.mark.parametrize("kind", ["redis_url", "redis_sentinel", "redis_cluster"])
async def test_counts_read_a_lone_redis_one_behind_sentinel_and_a_cluster(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """The stack's URL is a Sentinel one with --redis-replicas and a cluster one with --redis-cluster: redis-py's
    from_url raised a bare ValueError for both as the first window opened."""
    url = str(request.getfixturevalue("infra").redis_url if kind == "redis_url" else request.getfixturevalue(kind))
    key = f"bench-counts-{uuid.uuid4().hex}"
    if is_sentinel_url(url):
        host, port = check_sentinels(url)
        writer: redis.Redis | redis.RedisCluster = redis.Redis(host=host, port=port)
    else:
        writer = sync_client(url, timeout_s=2.0)
    try:
        before = await counts(url)
        assert before is not None, f"{url} could not be read"
        for _ in range(7):
            writer.incrby(key, 1)
        after = await counts(url)
        writer.delete(key)
    finally:
        writer.close()
    assert after is not None, f"{url} could not be read the second time"
    ran = per_request(before[0], after[0], answers=1)["by_command"]
    assert ran.get("incrby", 0) >= 7, f"expected the 7 INCRBYs among the commands run, got {ran}"
    assert after[1] > 0, "used_memory should be read"


async def test_a_redis_that_cannot_be_read_gives_no_counts() -> None:
    assert await counts("redis://127.0.0.1:1/0") is None
    assert await counts("redis://127.0.0.1:port/0") is None, "a URL redis-py cannot take"
