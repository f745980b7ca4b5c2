"""``max_output_bytes``: a result over the cap fails its task with ``output_too_large``; the others
of its batch are stored as usual."""

from __future__ import annotations

import pytest

from gpu_worker.calls import OUTPUT_TOO_LARGE, oversize
from gpu_worker.settings import WorkerSettings
from schemas.records import TaskStatus
from tests.support.worker_rig import run_batch


async def test_an_output_over_the_cap_fails_alone() -> None:
    settings = WorkerSettings(worker_id="w1", max_output_bytes=10)
    ended, backend = await run_batch(["small", "far too long for it"], settings=settings)

    assert (ended["t0"].status, ended["t0"].output) == (TaskStatus.COMPLETED, "SMALL")
    big = ended["t1"]
    assert (big.status, big.output, big.error_code) == (TaskStatus.FAILED, None, OUTPUT_TOO_LARGE)
    assert "19 bytes" in (big.error_message or "") and "BATCHWIRE_MAX_OUTPUT_BYTES" in (big.error_message or "")
    assert backend.calls == [2], "computed once: the cap is on what is stored"


@pytest.mark.parametrize(
    ("output", "limit", "too_large"),
    [
        ("a" * 10, 10, False),
        ("a" * 11, 10, True),
        ("é" * 5, 10, False),  # 10 bytes in UTF-8
        ("é" * 6, 10, True),
        ("😀" * 3, 10, True),  # 12 bytes
        ("a" * 10**6, 0, False),  # 0: no limit
    ],
)
def test_the_cap_counts_utf8_bytes(output: str, limit: int, too_large: bool) -> None:
    assert (oversize(output, limit) is not None) is too_large


def test_a_negative_cap_is_refused_naming_the_variable() -> None:
    with pytest.raises(ValueError, match="BATCHWIRE_MAX_OUTPUT_BYTES"):
        WorkerSettings(max_output_bytes=-1)
