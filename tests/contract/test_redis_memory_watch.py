"""When a Redis refuses writes for memory, as ``INFO memory`` shows it (``transport.redis.memory``)."""

from __future__ import annotations

import pytest

from transport.redis.memory import refusal

MIB = 1024 * 1024


def info(used: int, limit: int, policy: str = "noeviction", not_counted: int = 0) -> dict[str, object]:
    return {
        "used_memory": used,
        "maxmemory": limit,
        "maxmemory_policy": policy,
        "mem_not_counted_for_evict": not_counted,
    }


def test_over_maxmemory_without_eviction_is_a_refusal_that_says_what_to_change() -> None:
    message = refusal(info(70 * MIB, 64 * MIB))
    assert message is not None
    assert "result store is full" in message and "70.0 MiB" in message and "64.0 MiB" in message
    assert "--redis-maxmemory" in message and "Retry-After" in message


@pytest.mark.parametrize(
    "memory",
    [
        info(64 * MIB, 64 * MIB),  # at the bound: Redis refuses only over it
        info(70 * MIB, 0),  # no bound
        info(70 * MIB, 64 * MIB, policy="allkeys-lru"),  # it evicts to make room
        info(70 * MIB, 64 * MIB, not_counted=8 * MIB),  # replication and AOF buffers do not count
    ],
)
def test_room_or_eviction_is_no_refusal(memory: dict[str, object]) -> None:
    assert refusal(memory) is None
