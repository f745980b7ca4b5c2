"""An append-only JSON-lines record of every batch a worker ran: for audits and the test suite.

Times are ``time.monotonic()``, one clock for every process on a Linux host, so runs of several
worker processes can be checked for overlap.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence


class BatchJournal:
    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(
        self,
        worker_id: str,
        batch_id: str,
        task_ids: Sequence[str],
        start_s: float,
        end_s: float,
        outcome: str,
        delivery: int = 1,
    ) -> None:
        """One backend call; ``delivery`` counts how often its batch was delivered (2+: it came back)."""
        line = json.dumps(
            {
                "worker": worker_id,
                "pid": os.getpid(),
                "batch_id": batch_id,
                "size": len(task_ids),
                "task_ids": list(task_ids),
                "start": start_s,
                "end": end_s,
                "outcome": outcome,
                "delivery": delivery,
            }
        )
        os.write(self._fd, (line + "\n").encode())  # one write per line: O_APPEND keeps lines whole

    def close(self) -> None:
        os.close(self._fd)
