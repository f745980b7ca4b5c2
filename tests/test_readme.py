"""The README's first screen, its links (to files and to sections), the configuration and metrics tables in
docs/operations.md, and the BATCHWIRE_* variables the user docs name stay true."""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from batchwire.cli import TOOLS, build_parser, config_table, role_flags, tool_parser
from batchwire.docs import OPERATIONS, START, with_table
from batchwire.settings import stack_env_path
from telemetry import metrics

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


USER_DOCS = [
    README,
    *(ROOT / "docs" / name for name in ("openai.md", "cache.md", "priority.md", "tracing.md", "operations.md")),
]


def _help_texts() -> str:
    """Every command's --help, the tools' included (their parsers live in their own modules)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parsers = [sub.choices[name] for name in sub.choices if name not in TOOLS]
    for name in TOOLS:
        tool = tool_parser(name)
        parsers.extend(next(a for a in tool._actions if isinstance(a, argparse._SubParsersAction)).choices.values())
    return " ".join(" ".join(p.format_help().split()) for p in parsers)


def test_help_reads_as_plain_text() -> None:
    """Docstrings become help texts: their reST literals must not reach the terminal."""
    texts = _help_texts() + " " + build_parser().format_help()
    assert "``" not in texts, f"a --help shows reST markup: {texts[max(0, texts.find('``') - 80) :][:200]}"


NOT_FLAGS = {"BATCHWIRE_STACK_ENV": stack_env_path}
"""Variables the docs may name that no flag reads, each with what reads it."""


def test_every_variable_the_docs_name_is_a_flags() -> None:
    helps = _help_texts()
    for variable, reader in NOT_FLAGS.items():
        assert variable in inspect.getsource(reader), f"{reader.__name__} no longer reads {variable}"
    for doc in USER_DOCS:
        for variable in sorted(set(re.findall(r"BATCHWIRE_[A-Z0-9_]*[A-Z0-9]", doc.read_text())) - NOT_FLAGS.keys()):
            assert f"[{variable};" in helps or f"[{variable}]" in helps, (
                f"{doc.name} names {variable}, no flag reads it"
            )


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors of ``doc``'s headings (lower case, punctuation dropped, spaces as hyphens)."""
    prose = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)
    return {
        re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        for title in re.findall(r"^#+ (.+)$", prose, flags=re.MULTILINE)
    }


def test_the_docs_links_to_a_section_find_it() -> None:
    for doc in [README, *(ROOT / "docs").glob("*.md")]:
        for path, anchor in re.findall(r"\]\(([^)#:\s]*)#([^)\s]+)\)", doc.read_text()):
            target = doc.parent / path if path else doc
            assert anchor in _anchors(target), f"{doc.name} links {path}#{anchor}, a section {target.name} lacks"


def _documented_metrics() -> dict[str, tuple[str, set[str]]]:
    """docs/operations.md's metrics table: each metric's type and labels, as its rows name them."""
    section = OPERATIONS.read_text().split("\n## Metrics\n")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `(batchwire_\w+)(?:\{([\w,]*)\})?` \| (\w+) \|", section, flags=re.MULTILINE)
    return {name: (kind, set(filter(None, labels.split(",")))) for name, labels, kind in rows}


def test_the_metrics_table_names_every_metric_with_its_type_and_labels() -> None:
    exported: dict[str, tuple[str, set[str]]] = {}
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase):
            (family,) = metric.describe()
            name = family.name + "_total" if family.type == "counter" else family.name
            exported[name] = (family.type, set(metric._labelnames))
    documented = _documented_metrics()
    assert documented.keys() == exported.keys(), (
        f"docs/operations.md's metrics table lacks {sorted(exported.keys() - documented.keys())}, "
        f"names {sorted(documented.keys() - exported.keys())} that no role exports"
    )
    differ = {name: (documented[name], exported[name]) for name in exported if documented[name] != exported[name]}
    assert not differ, f"documented (type, labels) differ from the exported ones: {differ}"


def test_the_metrics_table_names_the_roles_that_serve_each_metric() -> None:
    section = OPERATIONS.read_text().split("\n## Metrics\n")[1].split("\n## ")[0]
    documented = dict(re.findall(r"^\| `(batchwire_\w+?)(?:\{[\w,]*\})?` \| \w+ \| ([\w, ]+) \|", section, flags=re.M))
    served: dict[str, list[str]] = {}
    for role, registry in metrics.EXPORTS_BY_ROLE.items():
        for family in registry.collect():
            name = family.name + "_total" if family.type == "counter" else family.name
            served.setdefault(name, []).append(role)
    exported = {name: "every role" if len(roles) == 3 else ", ".join(roles) for name, roles in served.items()}
    differ = {
        name: (documented.get(name), exported.get(name))
        for name in documented.keys() | exported.keys()
        if documented.get(name) != exported.get(name)
    }
    assert not differ, f"docs/operations.md's role column (doc, served by) differs from telemetry.metrics: {differ}"


def test_the_configuration_table_gives_each_command_its_flags_own_meaning() -> None:
    table = config_table()
    for command, flag, help_text in role_flags():
        row = next(line for line in table.splitlines() if line.startswith(f"| `{flag}` |"))
        meaning = help_text.rpartition(" [")[0]
        assert meaning in row, f"the table's {flag} row lacks what it means to `batchwire {command}`: {meaning!r}"
