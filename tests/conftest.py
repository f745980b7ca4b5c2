"""Session-wide infrastructure: one real Kafka broker and Redis server for the whole run.

Which infrastructure (local processes, testcontainers, or external) is chosen by
``infra.select.provide_infra``; each test gets its own namespace (topics and Redis keys), so tests
never see each other's traffic. ``make test`` runs pytest under ``tests.with_stack``, so every
pytest process (the xdist workers included) shares one Kafka and one Redis as external ones.

The tiers (see the Makefile): ``--no-servers`` runs the tests that need neither Kafka nor Redis, and
a test that asks for them there fails, naming the mark it lacks.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from schemas.wire import Names


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--no-servers", action="store_true", help="the check tier: a test that asks for Kafka or Redis fails"
    )


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
