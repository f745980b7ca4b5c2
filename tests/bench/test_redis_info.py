"""Redis commands per request: the difference of two INFO counts, the bench's own INFO left out."""

from __future__ import annotations

from batchwire.bench.redis_info import bytes_per_request, per_request


def test_commands_between_two_counts_are_divided_by_the_answers() -> None:
    start = {"hset": 10, "publish": 5, "info": 1}
    end = {"hset": 310, "publish": 205, "info": 3, "evalsha": 100}
    got = per_request(start, end, answers=100)
    assert got["total"] == 600
    assert got["per_request"] == 6.0
    assert got["by_command"] == {"hset": 3.0, "publish": 2.0, "evalsha": 1.0}


def test_no_answers_gives_no_ratio() -> None:
    assert per_request({}, {"get": 4}, answers=0)["per_request"] is None


def test_the_memory_a_request_leaves_is_the_growth_per_answer() -> None:
    assert bytes_per_request(1_000_000, 1_500_000, answers=400) == 1250.0
    assert bytes_per_request(1_000_000, 900_000, answers=400) is None, "memory freed in the window: no figure"
    assert bytes_per_request(1_000_000, 1_500_000, answers=0) is None
