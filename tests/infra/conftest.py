"""A LocalStack of its own for the infra tests: they restart and kill services on purpose."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from infra.local_stack import LocalStack
from infra.select import FORCE_ENV


@pytest.fixture(scope="module")
def local_stack() -> Iterator[LocalStack]:
    forced = os.environ.get(FORCE_ENV, "local").strip().lower() or "local"
    if forced != "local":
        # Nothing is skipped: a run that cannot start the local stack reports these tests as failed.
        pytest.fail(f"{FORCE_ENV}={forced}: the infra tests need the local stack (java and redis-server)")
    with LocalStack() as stack:
        yield stack
