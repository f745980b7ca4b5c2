"""Session-wide infrastructure: one real Kafka broker and Redis server for the whole run.

Which infrastructure (local processes, testcontainers, or external) is chosen by
``infra.select.provide_infra``; each test gets its own namespace (topics and Redis keys), so tests
never see each other's traffic. Under pytest-xdist, ``--shared-stack`` starts one local stack in the
controlling process and hands its addresses to every worker as the external infrastructure, so the
workers share one Kafka and one Redis instead of starting one each.

The tiers (see the Makefile): ``--no-servers`` runs the tests that need neither Kafka nor Redis, and
a test that asks for them there fails, naming the mark it lacks.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from schemas.wire import Names

_SHARED_STACK = pytest.StashKey[Any]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shared-stack",
        action="store_true",
        help="start one local Kafka and Redis in this process for every xdist worker to share",
    )
    parser.addoption(
        "--no-servers", action="store_true", help="the check tier: a test that asks for Kafka or Redis fails"
    )


def pytest_configure(config: pytest.Config) -> None:
    from infra.select import EXTERNAL_KAFKA_ENV, EXTERNAL_REDIS_ENV

    is_worker = hasattr(config, "workerinput")
    if not config.getoption("shared_stack") or is_worker or os.environ.get(EXTERNAL_KAFKA_ENV):
        return
    from infra.local_stack import LocalStack

    stack = LocalStack()
    stack.start()
    config.stash[_SHARED_STACK] = stack
    # The workers start after this and inherit the environment: to them the stack is external.
    os.environ[EXTERNAL_KAFKA_ENV] = stack.kafka_bootstrap
    os.environ[EXTERNAL_REDIS_ENV] = stack.redis_url


def pytest_unconfigure(config: pytest.Config) -> None:
    stack = config.stash.get(_SHARED_STACK, None)
    if stack is not None:
        stack.close()


SERVER_FIXTURES = {"infra", "redis_url", "kafka_bootstrap", "local_stack"}
"""Fixtures that hand a test real servers: a test that takes one is marked ``kafka``."""
HF_TESTS = Path(__file__).parent / "backends"
"""The tests that import torch (the hf extra) as they are collected: the Makefile's tiers ignore the
folder where they do not run it, so that no other tier pays for importing torch."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks ``kafka`` every test that takes real servers or runs in the Kafka or Redis mode, and
    ``hf`` every test of ``HF_TESTS``."""
    for item in items:
        if HF_TESTS in item.path.parents:
            item.add_marker(pytest.mark.hf)
        callspec = getattr(item, "callspec", None)
        modes = {str(value) for value in callspec.params.values()} if callspec is not None else set()
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())) or modes & {"kafka", "redis"}:
            item.add_marker(pytest.mark.kafka)


@pytest.fixture(scope="session")
def infra(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.config.getoption("no_servers"):
        pytest.fail("this test uses Kafka and Redis, which the check tier (--no-servers) has not: mark it kafka")
    from infra.select import provide_infra

    with provide_infra() as provided:
        yield provided


@pytest.fixture
def names() -> Names:
    """A fresh namespace: unique topic names and Redis key prefixes for one test."""
    return Names(namespace=f"t{uuid.uuid4().hex[:10]}")
