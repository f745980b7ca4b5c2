"""Is a Kafka broker really serving? Asked the way our services will ask: through aiokafka."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from aiokafka.admin import AIOKafkaAdminClient  # type: ignore[import-untyped, unused-ignore]
from aiokafka.errors import KafkaError  # type: ignore[import-untyped, unused-ignore]

from infra.aio import run_blocking

_POLL_INTERVAL_S = 0.1


async def kafka_serves(bootstrap: str, *, request_timeout_s: float = 5.0) -> bool:
    """One check: metadata answers and every partition, internal ones included, has a leader.

    Listing topics alone is not enough after a restart: the broker answers metadata while its
    partitions still have no leader, and a producer started then fails its first sends.
    """
    if not await _tcp_accepts(bootstrap):
        # Cheap, and spares aiokafka's connection-error log lines while the JVM boots.
        return False
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap,
        request_timeout_ms=int(request_timeout_s * 1000),
        client_id="batchwire-infra-probe",
    )
    try:
        await admin.start()
        names = await admin.list_topics()
        if not names:
            return True
        topics = await admin.describe_topics(list(names))
    except (TimeoutError, KafkaError, OSError):
        return False
    finally:
        await admin.close()
    return all(_topic_is_led(topic) for topic in topics)


def wait_for_kafka(
    bootstrap: str,
    *,
    timeout_s: float,
    still_running: Callable[[], bool] = lambda: True,
) -> bool:
    """Poll `kafka_serves` until it holds (True), the deadline passes or the process dies (False)."""
    deadline = time.monotonic() + timeout_s

    async def poll() -> bool:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not still_running():
                return False
            if await kafka_serves(bootstrap, request_timeout_s=min(3.0, max(remaining, 0.5))):
                return True
            await asyncio.sleep(_POLL_INTERVAL_S)

    return run_blocking(poll)


async def _tcp_accepts(bootstrap: str, timeout_s: float = 1.0) -> bool:
    host, _, port = bootstrap.rpartition(":")
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host, int(port))
    except (TimeoutError, OSError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


def _topic_is_led(topic: dict[str, object]) -> bool:
    if topic.get("error_code") != 0:
        return False
    partitions = topic.get("partitions")
    if not isinstance(partitions, list) or not partitions:
        return False
    return all(
        isinstance(part, dict) and part.get("error_code") == 0 and _as_int(part.get("leader")) >= 0
        for part in partitions
    )


def _as_int(value: object) -> int:
    return value if isinstance(value, int) else -1
