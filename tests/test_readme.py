"""The README's first screen, its links, and the configuration table in docs/operations.md stay true."""

from __future__ import annotations

import re
from pathlib import Path

from batchwire.docs import OPERATIONS, START, with_table

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def test_the_configuration_table_matches_the_cli() -> None:
    text = OPERATIONS.read_text()
    assert START in text, "docs/operations.md lacks the configuration table's markers"
    assert with_table(text) == text, "docs/operations.md's configuration table is stale: run `make docs`"


def test_first_screen_has_the_two_commands_and_the_three_delivery_modes() -> None:
    first_screen = README.read_text().split("## Architecture")[0]
    for needle in ("make run", "make test", "/v1/inference", "/v1/tasks", "/v1/result/", "/events"):
        assert needle in first_screen, f"README's first screen lacks {needle!r}"
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in ci, ".ci/run must run the README's test command"


def test_the_readme_is_short_and_its_links_resolve() -> None:
    text = README.read_text()
    lines = text.count("\n")
    assert lines <= 150, f"README has {lines} lines; the rest belongs in docs/ (at most 150)"
    for doc in ("docs/architecture.md", "docs/operations.md", "docs/performance.md"):
        assert f"]({doc})" in text, f"README does not link {doc}"
    for root, name in [(ROOT, "README.md"), *((ROOT / "docs", p.name) for p in (ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", (root / name).read_text()):
            assert (root / target).exists(), f"{name} links {target}, which does not exist"
