"""`batchwire stack ...` run for a test's own cluster, in a state dir of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from infra.cluster_stack import nodes, read_shape


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


def discard_stack(state_dir: Path) -> None:
    """Ends a test's own replicated stack with SIGKILL, every server at once. Its data goes with the
    test, and a graceful ``stack down`` waits out Kafka's raft shutdown timeout (5 s), since the
    quorum's last leader has no one left to hand the leadership to."""
    shape = read_shape(state_dir.resolve())
    if shape is None:
        return  # its `up` never got as far as recording one
    for node in nodes(state_dir.resolve(), shape):
        process = node.server.process()
        if process is not None:
            process.kill()
