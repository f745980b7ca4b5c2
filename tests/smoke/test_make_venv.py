"""``make run``'s virtual environment, as a first run can leave it: a ``.venv`` that does not work is made again.

Each case runs the Makefile in a scratch directory whose ``.venv`` is in one state and asks ``make`` for
the environment alone (``make venv``), or, with ``-n``, for what ``make run`` would do.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE_PYTHON = Path(sys.base_prefix) / "bin" / "python3"  # the interpreter that runs uv, as `make` does


def _make(
    where: Path, *targets: str, python: Path = BASE_PYTHON, path: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``make <targets>`` in ``where`` with the project's Makefile, ``PYTHON`` set to ``python`` (and ``PATH``
    to ``path`` when given)."""
    env = {**os.environ, "PYTHON": str(python), **({"PATH": path} if path is not None else {})}
    return subprocess.run(
        ["make", "--no-print-directory", "-f", str(ROOT / "Makefile"), "-C", str(where), *targets],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def _interrupted_while_made(venv: Path) -> None:
    """A ``make`` stopped as uv made the environment: its folders, no interpreter."""
    (venv / "lib" / "python3.11" / "site-packages").mkdir(parents=True)


def _interpreter_gone(venv: Path) -> None:
    """The Python that made it removed since (an upgrade): its interpreter a dangling link."""
    subprocess.run([str(BASE_PYTHON), "-m", "uv", "venv", "-q", str(venv)], check=True, timeout=60)
    (venv / "bin" / "python").unlink()
    (venv / "bin" / "python").symlink_to("/nonexistent/python3")


def _too_old(venv: Path) -> None:
    """Made by a Python older than pyproject.toml's requires-python (>=3.11)."""
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\nexec {BASE_PYTHON} -c 'import sys; sys.exit(1)'\n")  # as 3.10 answers the check
    python.chmod(0o755)


@pytest.mark.parametrize("leave", [_interrupted_while_made, _interpreter_gone, _too_old])
def test_a_venv_that_does_not_work_is_made_again(tmp_path: Path, leave: Callable[[Path], None]) -> None:
    leave(tmp_path / ".venv")
    done = _make(tmp_path, "venv")
    assert done.returncode == 0, done.stderr
    assert "making it again" in done.stdout, done.stdout
    runs = subprocess.run(
        [str(tmp_path / ".venv" / "bin" / "python"), "-c", "import sys; print(sys.version_info >= (3, 11))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert runs.stdout.strip() == "True", (runs.stdout, runs.stderr)


def test_a_working_venv_is_kept(tmp_path: Path) -> None:
    subprocess.run([str(BASE_PYTHON), "-m", "uv", "venv", "-q", str(tmp_path / ".venv")], check=True, timeout=60)
    kept = tmp_path / ".venv" / "kept"
    kept.touch()
    done = _make(tmp_path, "venv")
    assert done.returncode == 0, done.stderr
    assert kept.exists() and done.stdout == "", done.stdout


@pytest.mark.parametrize(("interpreter_gone", "installs"), [(True, True), (False, False)])
def test_make_run_installs_again_when_the_venv_it_installed_into_stopped_working(
    tmp_path: Path, interpreter_gone: bool, installs: bool
) -> None:
    """The install stamps outlive the interpreter: ``make run`` must not start a ``batchwire`` that cannot run."""
    for name in ("pyproject.toml", "constraints.txt"):
        (tmp_path / name).touch()
    subprocess.run([str(BASE_PYTHON), "-m", "uv", "venv", "-q", str(tmp_path / ".venv")], check=True, timeout=60)
    (tmp_path / ".venv" / ".core-stamp").touch()
    if interpreter_gone:
        (tmp_path / ".venv" / "bin" / "python").unlink()
        (tmp_path / ".venv" / "bin" / "python").symlink_to("/nonexistent/python3")
    planned = _make(tmp_path, "-n", "run")
    assert planned.returncode == 0, planned.stderr
    assert ("-c constraints.txt -e ." in planned.stdout) is installs, planned.stdout


def _bare_python(where: Path) -> Path:
    """A Python with neither uv nor pip, as a system Python meets ``make`` (pip absent, or refusing: PEP 668)."""
    subprocess.run([str(BASE_PYTHON), "-m", "uv", "venv", "-q", str(where)], check=True, timeout=60)
    return where / "bin" / "python"


def test_uv_on_the_path_serves_a_python_without_it(tmp_path: Path) -> None:
    """uv from its own installer is on PATH, not in PYTHON: ``make`` uses it instead of asking pip for another."""
    python = _bare_python(tmp_path / "system")
    tools = tmp_path / "tools"
    tools.mkdir()
    found = subprocess.run(
        [str(BASE_PYTHON), "-c", "import uv; print(uv.find_uv_bin())"], capture_output=True, text=True, timeout=60
    )
    (tools / "uv").symlink_to(found.stdout.strip())
    project = tmp_path / "project"
    project.mkdir()
    done = _make(project, "venv", python=python, path=f"{tools}:/usr/bin:/bin")
    assert done.returncode == 0, done.stderr
    assert (project / ".venv" / "bin" / "python").exists(), done.stdout


def test_no_uv_to_be_had_says_how_to_get_one(tmp_path: Path) -> None:
    python = _bare_python(tmp_path / "system")
    project = tmp_path / "project"
    project.mkdir()
    done = _make(project, "venv", python=python, path="/usr/bin:/bin")
    assert done.returncode != 0, done.stdout
    assert "could not install uv" in done.stderr and "docs.astral.sh/uv" in done.stderr, done.stderr
