"""The error table in docs/operations.md is the gateway's ERROR_TABLE: same codes, statuses, words."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.errors import ERROR_TABLE

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def test_the_documented_error_table_matches_the_code() -> None:
    text = OPERATIONS.read_text()
    section = text.split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_0-9]+)` \| (\d{3}) \| (.+) \|$", section, flags=re.MULTILINE)
    documented = {code: (int(status), when) for code, status, when in rows}
    missing = sorted(set(ERROR_TABLE) - set(documented))
    extra = sorted(set(documented) - set(ERROR_TABLE))
    differ = sorted(code for code in set(documented) & set(ERROR_TABLE) if documented[code] != ERROR_TABLE[code])
    assert documented == ERROR_TABLE, f"docs/operations.md lacks {missing}, has extra {extra}, differs on {differ}"
