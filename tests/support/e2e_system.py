"""The system the e2e pipeline tests run against, and its batch journal."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.processes import Cluster


@dataclass
class System:
    """The system under test: embedded in one process, or a multi-process cluster over Kafka and Redis."""

    kind: str
    urls: list[str]
    journal_path: Path
    cluster: Cluster | None = None

    def journal(self) -> list[dict[str, Any]]:
        if not self.journal_path.exists():
            return []
        return [json.loads(line) for line in self.journal_path.read_text().splitlines() if line.strip()]
