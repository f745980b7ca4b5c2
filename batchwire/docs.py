"""Keeps the README's configuration table equal to the CLI: ``python -m batchwire.docs``."""

from __future__ import annotations

import sys
from pathlib import Path

from batchwire.cli import config_table

START = "<!-- config:start -->"
END = "<!-- config:end -->"


def with_table(readme: str) -> str:
    head, _, rest = readme.partition(START)
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{config_table()}\n{END}{tail}"


def main() -> int:
    path = Path(__file__).resolve().parent.parent / "README.md"
    path.write_text(with_table(path.read_text()))
    print(f"configuration table written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
