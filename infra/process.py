"""Service processes (Kafka, Redis): spawn, watch, stop; owned by us or detached.

Owned processes are children we `wait()` for (tests). Detached ones are started through
`sh` so they are re-parented to init at once: they outlive the caller (`batchwire stack up`)
and a later process stops them by pid, after checking the pid still names the same program.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from infra.errors import ServiceStartError, ServiceStopError

# `$!` is the pid of the backgrounded service itself (sh forks, the child execs it);
# sh exits right after printing it, so init adopts the service.
_DETACH_SCRIPT = 'log=$1; shift; "$@" </dev/null >>"$log" 2>&1 & echo $!'

_POLL_INTERVAL_S = 0.05
_THREADS_EXIT_POLL_S = 0.001
_EXIT_STOP_TIMEOUT_S = 10.0
_PROC_TCP = Path("/proc/self/net/tcp")


class ServiceProcess:
    """One running service process. Build with `spawn` or `attach`."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None) -> None:
        self._pid = pid
        self._popen = popen

    @classmethod
    def spawn(
        cls,
        argv: Sequence[str],
        *,
        log_path: Path,
        cwd: Path,
        detached: bool,
        env: Mapping[str, str] | None = None,
    ) -> ServiceProcess:
        """Start `argv` with stdout and stderr appended to `log_path`."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = dict(os.environ if env is None else env)
        if detached:
            return cls(_spawn_detached(argv, log_path=log_path, cwd=cwd, env=full_env), None)
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=full_env,
            )
        process = cls(popen.pid, popen)
        _OWNED.add(process)
        return process

    @classmethod
    def attach(cls, pid: int, marks: Sequence[str], *, cwd: Path | None = None) -> ServiceProcess | None:
        """The process `pid` if it is alive, its command line contains every mark and, with `cwd`,
        it runs in that folder.

        Pid files outlive their processes and pids get reused; the marks (a config path, a
        program name) and the working folder (a state dir's own) keep `stack up` and `stack down`
        from signalling an unrelated program.
        """
        cmdline = _read_cmdline(pid)
        if cmdline is None or not _alive_by_pid(pid):
            return None
        if not all(mark in cmdline for mark in marks):
            return None
        if cwd is not None and not _runs_in(pid, cwd):
            return None
        return cls(pid, None)

    @classmethod
    def find(cls, marks: Sequence[str], *, cwd: Path) -> ServiceProcess | None:
        """A live process running in `cwd` whose command line contains every mark, if there is one.

        Finds a service whose pid file is gone or names another process (Linux only: None elsewhere).
        """
        try:
            entries = list(Path("/proc").iterdir())
        except OSError:
            return None
        for entry in entries:
            if entry.name.isdigit() and _runs_in(int(entry.name), cwd):
                found = cls.attach(int(entry.name), marks, cwd=cwd)
                if found is not None:
                    return found
        return None

    @property
    def pid(self) -> int:
        return self._pid

    def is_alive(self) -> bool:
        if self._popen is not None:
            return self._popen.poll() is None
        return _alive_by_pid(self._pid)

    def listens_on(self, port: int) -> bool | None:
        """Whether this process holds a listening TCP socket on ``port``; None where /proc cannot say.

        A server that answers on its port may be another one that bound the port first (another test
        worker's Redis or Kafka), while this process dies of "Address already in use". Read from /proc
        by hand: psutil, which reads the same, is not in the core install that ``stack up`` runs from.
        """
        if not _PROC_TCP.exists():
            return None  # not Linux
        inodes = _listening_inodes(self._pid, port)
        if not inodes:
            return False
        try:
            fds = list(Path(f"/proc/{self._pid}/fd").iterdir())
        except OSError:
            return False  # gone
        for fd in fds:
            try:
                if os.readlink(fd) in inodes:
                    return True
            except OSError:
                continue  # closed while we looked
        return False

    def wait_exit(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the process to end; True if it did."""
        if self._popen is not None:
            try:
                self._popen.wait(timeout=max(timeout_s, 0.0))
            except subprocess.TimeoutExpired:
                return False
            return True
        return _wait_pid_exit(self._pid, timeout_s)

    def terminate(self, timeout_s: float) -> None:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL. Returns once the process is gone."""
        if self.is_alive():
            self._signal(signal.SIGTERM)
            if not self.wait_exit(timeout_s):
                self.kill()
        self.wait_exit(0)
        _OWNED.discard(self)

    def kill(self) -> None:
        """SIGKILL and wait: a crash, as tests of failover want it."""
        self._signal(signal.SIGKILL)
        if not self.wait_exit(10.0):
            raise ServiceStopError(f"process {self._pid} survived SIGKILL for 10 s")
        _OWNED.discard(self)

    def _signal(self, sig: signal.Signals) -> None:
        if self._popen is not None:
            # Popen skips the signal once the child is reaped, so a recycled pid is never hit.
            self._popen.send_signal(sig)
            return
        # The process may end between our check and the signal; that is the goal anyway.
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._pid, sig)


# Owned children still running when the interpreter exits (a script that never called
# stop(), a test run ended by an exception) are stopped rather than left behind.
_OWNED: set[ServiceProcess] = set()


@atexit.register
def _stop_owned_at_exit() -> None:
    for process in list(_OWNED):
        process.terminate(_EXIT_STOP_TIMEOUT_S)


def tail_text(path: Path, lines: int = 40, max_bytes: int = 32_768) -> str:
    """Last `lines` lines of a log file, for error messages; empty if there is no file."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except FileNotFoundError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def _spawn_detached(argv: Sequence[str], *, log_path: Path, cwd: Path, env: dict[str, str]) -> int:
    result = subprocess.run(
        ["/bin/sh", "-c", _DETACH_SCRIPT, "sh", str(log_path), *argv],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        cwd=cwd,
        env=env,
        start_new_session=True,
        check=False,
        timeout=30,
    )
    out = result.stdout.decode().strip()
    if result.returncode != 0 or not out.isdigit():
        err = result.stderr.decode(errors="replace").strip()
        raise ServiceStartError(f"could not start {argv[0]} in the background: {err or out!r}")
    return int(out)


def _read_cmdline(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        # No /proc (not Linux) or not readable: fall back to trusting the pid file.
        return "" if _alive_by_pid(pid) else None
    return raw.replace(b"\0", b" ").decode(errors="replace")


def _listening_inodes(pid: int, port: int) -> set[str]:
    """``socket:[INODE]`` of every TCP socket listening on ``port`` in the network namespace of ``pid``
    (none once it is gone)."""
    found: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # local_address is HEXIP:HEXPORT; state 0A is LISTEN.
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
                found.add(f"socket:[{fields[9]}]")
    return found


def _runs_in(pid: int, folder: Path) -> bool:
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False  # gone, or another user's process (not ours)
    return cwd == str(folder.resolve())


def _alive_by_pid(pid: int) -> bool:
    """Alive and not a zombie (a zombie has exited but waits for a parent to reap it).

    The main thread of a killed process turns zombie before its other threads have exited, and
    those still hold its files (listening sockets): until they are gone it counts as alive.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if not _exited(stat):
        return True
    try:
        threads = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for thread in threads:
        try:
            if not _exited((thread / "stat").read_text()):
                return True
        except OSError:
            continue  # gone while we looked
    return False


def _exited(stat: str) -> bool:
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")


def _wait_pid_exit(pid: int, timeout_s: float) -> bool:
    """Wait for a process that is not our child to end."""
    deadline = time.monotonic() + max(timeout_s, 0.0)
    pidfd = _open_pidfd(pid)
    if pidfd is not None:
        # A pidfd becomes readable when the process ends, reaped or not: no polling needed.
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            while _alive_by_pid(pid):
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0:
                    return False
                if poller.poll(remaining_ms):
                    # Readable once the main thread ended; the other threads follow within moments.
                    time.sleep(_THREADS_EXIT_POLL_S)
            return True
        finally:
            os.close(pidfd)
    while _alive_by_pid(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_INTERVAL_S)
    return True


def _open_pidfd(pid: int) -> int | None:
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        fd: int = pidfd_open(pid)
    except OSError:
        # Gone already (ProcessLookupError) or an old kernel (ENOSYS): callers poll instead.
        return None
    return fd
