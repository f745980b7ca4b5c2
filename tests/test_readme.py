"""The README's first screen and its configuration table stay true."""

from __future__ import annotations

from pathlib import Path

from batchwire.docs import with_table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_configuration_table_matches_the_cli() -> None:
    text = README.read_text()
    assert with_table(text) == text, "README's configuration table is stale: run `make docs`"


def test_first_screen_has_the_two_commands_and_the_three_delivery_modes() -> None:
    first_screen = README.read_text().split("## Architecture")[0]
    for needle in ("make run", "make test", "/v1/inference", "/v1/tasks", "/v1/result/", "/events"):
        assert needle in first_screen, f"README's first screen lacks {needle!r}"
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in ci, ".ci/run must run the README's test command"
