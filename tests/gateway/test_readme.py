"""The README's error table is the gateway's ERROR_TABLE: same codes, same statuses, same words."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.errors import ERROR_TABLE

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_error_table_matches_the_code() -> None:
    text = README.read_text()
    section = text.split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_0-9]+)` \| (\d{3}) \| (.+) \|$", section, flags=re.MULTILINE)
    documented = {code: (int(status), when) for code, status, when in rows}
    missing = sorted(set(ERROR_TABLE) - set(documented))
    extra = sorted(set(documented) - set(ERROR_TABLE))
    differ = sorted(code for code in set(documented) & set(ERROR_TABLE) if documented[code] != ERROR_TABLE[code])
    assert documented == ERROR_TABLE, f"README lacks {missing}, has extra {extra}, differs on {differ}"
