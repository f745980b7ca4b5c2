"""`batchwire stack ...` run for a test's own cluster, in a state dir of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def stack_cli(state_dir: Path, action: str, *extra: str, timeout_s: float = 150) -> subprocess.CompletedProcess[str]:
    """Runs ``batchwire stack ACTION --state-dir STATE_DIR EXTRA...`` without the developer's
    BATCHWIRE_* settings or stack.env, so the command acts on the test's cluster only."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("BATCHWIRE_")}
    env["BATCHWIRE_STACK_ENV"] = str(state_dir.parent / "no-stack.env")
    return subprocess.run(
        [sys.executable, "-m", "batchwire.cli", "stack", action, "--state-dir", str(state_dir), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
