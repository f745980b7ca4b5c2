"""What a process's metrics read before anything writes them."""

from __future__ import annotations

import subprocess
import sys


def test_the_request_topic_lag_reads_nan_until_a_reader_sets_it() -> None:
    """A gateway without the queue-depth reader (``--max-queue-depth 0``, admit-by-wait off) never sets it:
    0 there would read as an empty queue. A fresh interpreter: this one's tests may have set it."""
    shown = subprocess.run(
        [
            sys.executable,
            "-c",
            "from telemetry.metrics import REGISTRY; print(REGISTRY.get_sample_value('batchwire_request_topic_lag'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert shown.stdout.strip() == "nan", shown
