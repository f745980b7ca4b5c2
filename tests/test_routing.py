"""The request partitioner: each model in its own partitions, round robin, ``run`` requests at a time."""

from __future__ import annotations

import pytest

from transport.routing import Partitioner


def test_requests_go_round_robin_over_their_models_partitions() -> None:
    partitioner = Partitioner(["alpha", "beta"], 8)
    assert list(partitioner.partitions_for("alpha")) == [0, 1, 2, 3]
    assert [partitioner.choose("beta") for _ in range(8)] == [4, 5, 6, 7, 4, 5, 6, 7]


def test_a_run_sends_consecutive_requests_to_one_partition() -> None:
    partitioner = Partitioner(["alpha", "beta"], 8, run=3)
    chosen = [partitioner.choose("alpha") for _ in range(15)]
    assert chosen == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 0, 0, 0]


def test_a_run_is_at_least_one_request() -> None:
    with pytest.raises(ValueError, match="run"):
        Partitioner(["alpha"], 4, run=0)
