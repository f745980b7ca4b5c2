"""A lone redis-server and a task store on it (``tests.support.lone_redis``), for the replica-wait tests;
a backend thread of its own for the tests that drive ``BackendCalls``."""

from collections.abc import AsyncIterator

import pytest

from gpu_worker.runner import BackendRunner
from tests.support.lone_redis import primary, store  # noqa: F401 (pytest finds fixtures by name)


@pytest.fixture
async def runner() -> AsyncIterator[BackendRunner]:
    made = BackendRunner("test")
    yield made
    made.close()
