"""The Kafka + Redis stack a kafka-mode bench runs on: noted before the run, restored after it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence

from batchwire.bench.own_stack import OwnStack, child_env, server_pids
from batchwire.bench.sut import SutError, batchwire_command


class Stack:
    """The local Kafka + Redis of ``batchwire stack``: left as it was found unless told otherwise.

    Starting Kafka takes many seconds, so a stack that was already up stays up; one this bench
    started is stopped at the end (``keep`` keeps it for the next run). A stack of the run's own
    (``own``) is also removed with its data: nothing else uses it.
    """

    def __init__(
        self, command: Sequence[str] | None = None, timeout_s: float = 120.0, own: OwnStack | None = None
    ) -> None:
        self.command = list(command) if command else batchwire_command()
        self.timeout_s = timeout_s
        self.own = own
        self.was_up: bool | None = None

    def _run(self, action: str, *extra: str) -> subprocess.CompletedProcess[bytes]:
        argv = [*self.command, "stack", action, *extra]
        if self.own is not None:
            argv += ["--state-dir", str(self.own.state_dir)]
        try:
            return subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=self.timeout_s,
                check=False,
                env=child_env(os.environ, self.own),
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            raise SutError(f"'batchwire stack {action}' failed: {err}") from err

    def note_state(self) -> None:
        """Remembers whether the stack is up now, before anything is started."""
        self.was_up = self._run("status").returncode == 0

    def server_pids(self) -> dict[str, list[int]]:
        """Every live server's pid by kind, as ``stack status --json`` lists them."""
        done = self._run("status", "--json")
        try:
            return server_pids(json.loads(done.stdout))
        except ValueError as err:
            raise SutError(f"'batchwire stack status --json' printed no JSON: {err}") from err

    def restore(self, keep: bool) -> bool:
        """Stops the stack if this bench started it and ``keep`` is false; True if it was stopped, and
        ``SutError`` if ``stack down`` failed (its servers may still run)."""
        if self.was_up is not False or keep:
            return False
        done = self._run("down")
        if done.returncode != 0:
            said = done.stderr.decode(errors="replace").strip() or done.stdout.decode(errors="replace").strip()
            down = self.own.down if self.own is not None else "batchwire stack down"
            raise SutError(
                f"'batchwire stack down' exited with {done.returncode}, leaving the stack this run started: "
                f"{said or 'it printed nothing'}; stop it with {down}"
            )
        if self.own is not None:
            shutil.rmtree(self.own.state_dir, ignore_errors=True)
        return True
