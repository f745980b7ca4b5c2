"""Imports point one way and sit at the top of their modules."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("batchwire", "gateway", "batcher", "gpu_worker", "transport", "telemetry", "schemas", "infra")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

OPTIONAL = (
    "aiohttp",
    "torch",
    "transformers",
    "tokenizers",
    "docker",
    "batchwire.bench",
    "gpu_worker.backends.hf",
    "gpu_worker.backends.hf_load",
    "infra.docker_stack",
    "opentelemetry.sdk",
    "opentelemetry.exporter",
)
"""Modules that may be imported inside a function: heavy, or in an extra the core install lacks."""


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(cwd / "pyproject.toml")],
        cwd=cwd,
        env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_layers_are_kept() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, f"an import points up a layer (pyproject's importlinter contract):\n{result.stdout}"


def test_an_import_from_a_service_into_the_composition_root_breaks_the_contract(tmp_path: Path) -> None:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "gateway" / "upward.py").write_text("from batchwire import roles\n")
    (tmp_path / "schemas" / "upward.py").write_text("import transport.ports\n")

    result = _lint_imports(tmp_path)

    assert result.returncode != 0, f"lint-imports passed imports that point up:\n{result.stdout}"
    assert "gateway.upward" in result.stdout and "schemas.upward" in result.stdout, result.stdout


def _imports_inside_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for inner in ast.walk(node):
            names: list[str] = []
            if isinstance(inner, ast.Import):
                names = [alias.name for alias in inner.names]
            elif isinstance(inner, ast.ImportFrom) and inner.module and inner.level == 0:
                names = [inner.module]
            found += [
                f"{path.relative_to(ROOT)}:{inner.lineno} imports {name}"
                for name in names
                if not any(name == o or name.startswith(o + ".") for o in OPTIONAL)
            ]
    return found


def test_imports_sit_at_the_top_of_modules() -> None:
    found = [
        hit
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for hit in _imports_inside_functions(path)
    ]
    assert not found, (
        "imports inside functions (move them to the top; only heavy optional ones may stay):\n" + "\n".join(found)
    )
