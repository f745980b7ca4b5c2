"""A LocalStack of its own for the infra tests: they restart and kill services on purpose."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from infra.select import FORCE_ENV
from infra.stack import LocalStack


@pytest.fixture(scope="module")
def local_stack() -> Iterator[LocalStack]:
    forced = os.environ.get(FORCE_ENV, "local").strip().lower() or "local"
    if forced != "local":
        # The run asked for other infrastructure; don't fail for lack of java or redis-server.
        pytest.skip(f"{FORCE_ENV}={forced}: the local stack is not used in this run")
    with LocalStack() as stack:
        yield stack
