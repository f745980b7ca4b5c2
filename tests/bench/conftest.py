from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.fake_inference_server import Behaviour, FakeServer


@pytest.fixture
def behaviour() -> Behaviour:
    return Behaviour()


@pytest.fixture
def fake(behaviour: Behaviour) -> Iterator[FakeServer]:
    server = FakeServer(behaviour).start()
    try:
        yield server
    finally:
        server.stop()
