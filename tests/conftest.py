"""Session-wide infrastructure: one real Kafka broker and Redis server for the whole run.

Which infrastructure (local processes, testcontainers, or external) is chosen by
``infra.select.provide_infra``; each test gets its own namespace (topics and Redis keys), so tests
never see each other's traffic.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from schemas.wire import Names


@pytest.fixture(scope="session")
def infra() -> Iterator[Any]:
    from infra.select import provide_infra

    with provide_infra() as provided:
        yield provided


@pytest.fixture
def names() -> Names:
    """A fresh namespace: unique topic names and Redis key prefixes for one test."""
    return Names(namespace=f"t{uuid.uuid4().hex[:10]}")
