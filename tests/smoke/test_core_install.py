"""A newcomer's first command, as they meet it: the core install (no extras), then the README's curls.

Each case builds a fresh virtual environment with ``infra/install.sh`` (the script the Dockerfile
runs), once at the newest versions pyproject.toml allows and once at its declared floors
(``--resolution lowest-direct``), and runs the installed ``batchwire`` in it: every command's
``--help``, ``batchwire up``, and the README's first-screen shell blocks against it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from infra.ports import free_port
from tests.support.eventually import eventually_sync

ROOT = Path(__file__).resolve().parents[2]
EXTRAS_ONLY = ("aiohttp", "yarl", "hdrh", "matplotlib", "psutil", "torch", "transformers", "opentelemetry.sdk")
"""Modules of the optional extras: none may be installed by the core."""
TOOLS = (
    "batchwire.bench",
    "batchwire.capacity",
    "batchwire.stack_command",
    "infra.stack",
    "infra.cluster_stack",
    "infra.local_stack",
    "infra.kafka_server",
    "infra.redis_server",
    "infra.select",
)
"""The tools' modules: reachable only through the command that runs each."""


@dataclass(frozen=True)
class CoreInstall:
    venv: Path

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        env = {"PATH": f"{self.venv / 'bin'}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}
        return subprocess.run(args, capture_output=True, text=True, env=env, cwd=self.venv, timeout=timeout)

    def python(self, code: str) -> subprocess.CompletedProcess[str]:
        return self.run(str(self.venv / "bin" / "python"), "-c", code)


@pytest.fixture(scope="module", params=["highest", "lowest-direct"])
def core(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CoreInstall:
    venv = tmp_path_factory.mktemp(f"core-{request.param}") / "venv"
    base_python = Path(sys.base_prefix) / "bin" / "python3"  # the interpreter that runs uv, as `make` does
    env = {**os.environ, "BATCHWIRE_RESOLUTION": request.param, "PYTHON": str(base_python)}
    done = subprocess.run(
        ["sh", str(ROOT / "infra" / "install.sh"), str(venv)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return CoreInstall(venv)


def test_the_core_installs_no_extra(core: CoreInstall) -> None:
    probe = f"import importlib.util as u; print([m for m in {EXTRAS_ONLY!r} if u.find_spec(m)])"
    done = core.python(probe)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"the core install brought extras' modules: {done.stdout}"


def test_every_command_answers_help(core: CoreInstall) -> None:
    listed = core.python("from batchwire import cli; print(' '.join([*cli.HANDLERS, *cli.TOOLS]))")
    assert listed.returncode == 0, listed.stderr
    commands = listed.stdout.split()
    assert {"up", "gateway", "batcher", "worker", "stack", "bench", "plan"} <= set(commands), commands
    top = core.run("batchwire", "--help")
    assert top.returncode == 0 and all(command in top.stdout for command in commands), top.stderr
    with ThreadPoolExecutor(4) as pool:  # a second each, most of it the interpreter's start
        answers = pool.map(lambda command: core.run("batchwire", command, "--help"), commands)
        helps = dict(zip(commands, answers, strict=True))
    for command, done in helps.items():
        assert done.returncode == 0 and "usage: batchwire" in done.stdout, f"{command} --help: {done.stderr}"


def test_the_roles_reach_no_tool(core: CoreInstall) -> None:
    probe = (
        "import sys\n"
        "from batchwire import cli, embedded, roles\n"
        "cli.build_parser().parse_args(['up'])\n"
        f"print(sorted(m for m in sys.modules if m.startswith({TOOLS!r})))\n"
    )
    done = core.python(probe)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"batchwire up imports tools: {done.stdout}"


def test_the_tools_run_on_the_core(core: CoreInstall, tmp_path: Path) -> None:
    """A tool's module loads only when its command runs: one run of each kind, past ``--help``."""
    status = core.run("batchwire", "stack", "status", "--state-dir", str(tmp_path / "stack"))
    assert "kafka: none yet" in status.stdout, (status.stdout, status.stderr)
    curve = ROOT / "bench" / "results" / "capacity" / "sim-100ms-32.json"
    plan = core.run("batchwire", "plan", "--rate", "100", "--p99-ms", "500", "--curve", str(curve))
    assert plan.returncode == 0 and "simulated p50" in plan.stdout, (plan.stdout, plan.stderr)


@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        (["bench", "--rate", "1"], "bench"),
        (["up", "--backend", "hf", "--model-path", "."], "hf"),
        (["up", "--otlp-endpoint", "http://127.0.0.1:1"], "tracing"),
    ],
)
def test_a_command_that_needs_an_extra_names_it(core: CoreInstall, argv: list[str], extra: str) -> None:
    done = core.run("batchwire", *argv)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"needs the {extra} extra: pip install 'batchwire[{extra}]'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.fixture
def served(core: CoreInstall, tmp_path: Path) -> Iterator[int]:
    port = free_port()
    log = (tmp_path / "up.log").open("wb")
    env = {"PATH": f"{core.venv / 'bin'}:/usr/bin:/bin"}
    proc = subprocess.Popen(
        ["batchwire", "up", "--port", str(port)], env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        eventually_sync(lambda: _ready(port) or proc.poll() is not None, what="batchwire up answers", timeout_s=60)
        assert proc.poll() is None, (tmp_path / "up.log").read_text()
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        log.close()
    assert code == 0, (tmp_path / "up.log").read_text()


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _readme_blocks() -> list[str]:
    """The shell blocks that follow "With `make run` going": the README's curls."""
    first_screen = (ROOT / "README.md").read_text().split("## Architecture")[0]
    after_run = first_screen.split("With `make run` going", 1)[1]
    return re.findall(r"```sh\n(.*?)```", after_run, flags=re.S)


def test_the_readme_curls_get_their_answers(served: int) -> None:
    sync_block, task_block = _readme_blocks()
    (sync,) = _bash(sync_block, served)
    assert json.loads(sync)["output"] == "olleh", sync
    long_poll, events = _bash(task_block, served)
    result = json.loads(long_poll)
    assert (result["status"], result["output"]) == ("completed", "olleh"), long_poll
    assert "event: completed" in events and '"output":"olleh"' in events, events


def _bash(block: str, port: int) -> list[str]:
    """Runs a README block against ``port``; returns what each of its ``curl`` lines printed."""
    end = "--- end of answer ---"
    lines = [f"{line}; echo; echo '{end}'" if line.startswith("curl") else line for line in block.splitlines()]
    script = "\n".join(lines).replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (script, done.stderr)
    return [answer.strip() for answer in done.stdout.split(end)[:-1]]
