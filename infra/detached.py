"""One detached server of a state dir: where it lives, its recorded ports and pid file, how its
process is recognised, and the checks `up` makes before and after starting it.

Shared by the single stack (`infra.stack`) and the cluster (`infra.cluster_stack`).
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from infra.errors import InfraError
from infra.loopback import write_atomically
from infra.ports import LOOPBACK, port_is_free
from infra.process import ServiceProcess

POLL_INTERVAL_S = 0.05


@dataclass(frozen=True)
class StackCommands:
    """The `batchwire stack` commands a message about a server gives: without its stack's --state-dir they act
    on the default stack, and `up` without a replicated stack's shape is refused (`down` and `status` read the
    shape)."""

    where: str = ""
    """` --state-dir DIR` (`infra.stack.state_dir_flag`); empty for the default folder."""
    shape: str = ""
    """` --brokers N --redis-replicas R` (or `--redis-cluster P`) of a replicated stack; empty for the single one."""

    @property
    def up(self) -> str:
        return f"batchwire stack up{self.shape}{self.where}"

    @property
    def down(self) -> str:
        return f"batchwire stack down{self.where}"

    @property
    def status(self) -> str:
        return f"batchwire stack status{self.where}"


@dataclass(frozen=True)
class DetachedServer:
    """Where one server of a state dir lives, how to recognise its process, and the commands that act on its
    stack."""

    name: str
    work_dir: Path
    config_path: Path
    pid_path: Path
    marks: tuple[str, ...]
    read_ports: Callable[[Path], tuple[int, ...]]
    commands: StackCommands

    def ports(self) -> tuple[int, ...]:
        """The recorded ports (Kafka: broker, controller; Redis: one); empty when none are."""
        return self.read_ports(self.config_path)

    def process(self) -> ServiceProcess | None:
        """The server's live process: the pid file's if that is still ours, else one found running
        in its folder (a pid file lost or stale)."""
        pid = read_pid(self.pid_path)
        found = None if pid is None else ServiceProcess.attach(pid, self.marks, cwd=self.work_dir)
        return found if found is not None else ServiceProcess.find(self.marks, cwd=self.work_dir)


def refuse_taken_ports(server: DetachedServer) -> None:
    """Raises, changing nothing, when another process holds a port the stopped ``server`` needs."""
    up, down = server.commands.up, server.commands.down
    for port in server.ports():
        if not port_is_free(port):
            raise InfraError(
                f"{server.name} is not running and its port {LOOPBACK}:{port} (recorded in {server.config_path}) "
                f"is taken by another process; nothing was changed. Find that process with "
                f"`ss -ltnp 'sport = :{port}'`, stop it, and run `{up}` again (the stack comes back "
                f"on the same addresses with its data). Or, for {server.name} on new ports without its data, run "
                f"`{down}`, delete {shlex.quote(str(server.work_dir))} and run `{up}`; then restart every "
                "role, which holds the old address"
            )


def unrecorded(server: DetachedServer, process: ServiceProcess) -> InfraError:
    """The error for a server that runs while the config recording its ports is gone."""
    return InfraError(
        f"{server.name} runs (pid {process.pid}) but {server.config_path}, which records its ports, is gone; "
        f"it was left running. Run `{server.commands.down}`, then `{server.commands.up}`"
    )


def not_answering(server: DetachedServer, process: ServiceProcess, port: int) -> InfraError:
    """The error for a server that runs but did not answer before the deadline."""
    return InfraError(
        f"{server.name} runs (pid {process.pid}, port {port}) but did not answer before the deadline; it was "
        f"left running. See {server.work_dir} for its log; `{server.commands.down}` then `{server.commands.up}` "
        "restarts it over its data"
    )


def poll_until(check: Callable[[], bool], deadline: float, process: ServiceProcess) -> bool:
    """True once ``check`` passes; False at the deadline or when ``process`` dies first."""
    while not check():
        if time.monotonic() >= deadline or not process.is_alive():
            return False
        time.sleep(POLL_INTERVAL_S)
    return True


def read_pid(path: Path) -> int | None:
    """The pid in a pid file, or None when it is absent or not a number."""
    try:
        text = path.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return int(text) if text.isdigit() else None


def write_pid(path: Path, pid: int | None) -> None:
    """Records ``pid`` in a pid file, atomically."""
    if pid is None:
        raise InfraError(f"no pid to write to {path}: the service is not running")
    write_atomically(path, f"{pid}\n")
