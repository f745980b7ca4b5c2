"""Keeps the configuration table in docs/operations.md equal to the CLI: ``python -m batchwire.docs``."""

from __future__ import annotations

import sys
from pathlib import Path

from batchwire.cli import config_table

START = "<!-- config:start -->"
END = "<!-- config:end -->"
OPERATIONS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"


def with_table(doc: str) -> str:
    """``doc`` with the text between the config markers replaced by the CLI's current table."""
    head, _, rest = doc.partition(START)
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{config_table()}\n{END}{tail}"


def main() -> int:
    OPERATIONS.write_text(with_table(OPERATIONS.read_text()))
    print(f"configuration table written to {OPERATIONS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
