"""``batchwire up`` servers for the client's tests, one per module that asks: the client meets the real
gateway, batcher and sim worker, over real sockets."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.processes import embedded

OPERATOR_KEY = "client-tests-operator-key"
"""The refusing server's one key: an operator's, so a test may read its /metrics too."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Two sim workers, 100 ms a call: quick answers, and batches that 500 concurrent calls share."""
    proc, url = embedded(tmp_path_factory.mktemp("server"), 2, 100.0)
    yield url
    proc.stop()


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One sim worker, a second a call: a task submitted while it computes stays queued for a while,
    so its event stream has states to show (``tests.client.test_calls.occupy``). Its long-polls wait at
    most 0.3 s, shorter than the client asks: the client polls again until the task ends."""
    proc, url = embedded(tmp_path_factory.mktemp("slow"), 1, 1000.0, "--max-poll-wait-s", "0.3")
    yield url
    proc.stop()


@pytest.fixture(scope="module")
def short_streams_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One sim worker, three seconds a call, and event streams the server ends after 0.2 s
    (``--sse-max-s``): a task submitted while it computes waits through several streams that end with
    nothing new."""
    proc, url = embedded(tmp_path_factory.mktemp("short-streams"), 1, 3000.0, "--sse-max-s", "0.2")
    yield url
    proc.stop()


@pytest.fixture(scope="module")
def refusing_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Holds one request at a time (``--max-inflight 1``: a second gets 503 with Retry-After) and
    takes only ``OPERATOR_KEY``; one sim worker, a second a call."""
    flags = ("--max-inflight", "1", "--api-keys", f"operator {OPERATOR_KEY}")
    proc, url = embedded(tmp_path_factory.mktemp("refusing"), 1, 1000.0, *flags)
    yield url
    proc.stop()
