"""The project's modules that one synchronous request over Kafka runs, per role (gateway, batcher, worker).

Starts (or reuses) the local stack, then one gateway, one batcher and one sim worker (100 ms a call) as
separate processes in a namespace of their own. A ``sitecustomize`` hook put on their PYTHONPATH
profiles every thread and, between SIGUSR1 and SIGUSR2 only (not during start-up), records the file of
each Python frame entered. After warm-up requests it records three windows of the same length: idle,
one ``POST /v1/inference {"input": "hello"}`` answered in full, idle again. A module seen in the request
window and in neither idle window is one the request ran; the others may be timers that happen to tick.

    .venv/bin/python bench/request_path.py

It stops the roles it started, and the stack only if it started it (the namespace's topics stay).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).parent / "batchwire")
SERVICES = ("gateway", "batcher", "gpu_worker", "transport", "schemas", "telemetry")
PACKAGES = (*SERVICES, "batchwire")
WINDOW_S = 1.0
WINDOWS = ("idle-before", "request", "idle-after")
TRACE_VAR = "BATCHWIRE_TRACE_MODULES"

HOOK = """\
import os, signal, sys, threading
_out = os.environ.get("BATCHWIRE_TRACE_MODULES")
if _out:
    _seen, _state = set(), {"on": False, "dumps": 0}

    def _profile(frame, event, arg):
        if event == "call" and _state["on"]:
            _seen.add(frame.f_code.co_filename)

    def _start(signum, frame):
        _seen.clear()
        _state["on"] = True

    def _stop(signum, frame):
        _state["on"] = False
        _state["dumps"] += 1
        path = f"{_out}.{os.getpid()}.{_state['dumps']}"
        with open(path + ".tmp", "w") as f:
            f.write("\\n".join(sorted(_seen)))
        os.replace(path + ".tmp", path)

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
    sys.setprofile(_profile)
    threading.setprofile(_profile)
"""


def stack_alive() -> bool:
    done = subprocess.run([CLI, "stack", "status", "--json"], cwd=REPO, capture_output=True, text=True, check=False)
    try:
        return any(server.get("alive") for server in json.loads(done.stdout).get("servers", []))
    except ValueError:
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def post(url: str, text: str) -> int:
    """The HTTP status of one synchronous inference request (0: no answer)."""
    body = json.dumps({"input": text}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10.0) as response:
            response.read()
            status: int = response.status
            return status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0


def modules(path: Path) -> set[str]:
    """The recorded files under the project's packages, relative to the repository."""
    found = set()
    for line in path.read_text().splitlines():
        parts = Path(line).parts
        root = REPO.parts
        if parts[: len(root)] == root and len(parts) > len(root) and parts[len(root)] in PACKAGES:
            found.add("/".join(parts[len(root) :]))
    return found


def wait_for(path: Path, timeout_s: float = 10.0) -> Path:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no trace file {path}")
        time.sleep(0.05)
    return path


def record(procs: dict[str, subprocess.Popen[bytes]], tmp: Path, number: int, url: str | None) -> dict[str, set[str]]:
    """One window of WINDOW_S: with a url, the one request sent at its start and answered within it."""
    for proc in procs.values():
        proc.send_signal(signal.SIGUSR1)
    started = time.monotonic()
    if url is not None:
        status = post(url, "hello")
        print(f"request: HTTP {status} in {(time.monotonic() - started) * 1000:.0f} ms")
        if status != 200:
            raise SystemExit("the request was not answered 200")
    time.sleep(max(0.0, started + WINDOW_S - time.monotonic()))
    for proc in procs.values():
        proc.send_signal(signal.SIGUSR2)
    return {role: modules(wait_for(tmp / f"{role}.{proc.pid}.{number}")) for role, proc in procs.items()}


def start_roles(tmp: Path, namespace: str, port: int) -> dict[str, subprocess.Popen[bytes]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp), os.environ.get("PYTHONPATH")]))}
    argvs = {
        "worker": ["worker", "--backend", "sim", "--sim-latency-ms", "100"],
        "batcher": ["batcher"],
        "gateway": ["gateway", "--host", "127.0.0.1", "--port", str(port)],
    }
    procs = {}
    for role, argv in argvs.items():
        with (tmp / f"{role}.log").open("wb") as log:
            procs[role] = subprocess.Popen(
                [CLI, *argv, "--namespace", namespace],
                cwd=REPO,
                env={**env, TRACE_VAR: str(tmp / role)},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    return procs


def warm_up(url: str, procs: dict[str, subprocess.Popen[bytes]], tmp: Path) -> None:
    """Until 5 requests in a row are answered 200 (the consumer groups have joined, lazy paths ran)."""
    deadline, good = time.monotonic() + 120.0, 0
    while good < 5:
        for role, proc in procs.items():
            if proc.poll() is not None:
                raise SystemExit(f"{role} exited {proc.returncode}:\n{(tmp / f'{role}.log').read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise SystemExit("the deployment did not answer within 120 s")
        good = good + 1 if post(url, "warm") == 200 else 0
        time.sleep(0.2)
    time.sleep(2 * WINDOW_S)  # what the warm-up set going (replies, commits) ends before the first window


def stop(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs.values():
        try:
            proc.wait(timeout=15.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def report(windows: dict[str, dict[str, set[str]]]) -> None:
    request, roles = windows["request"], list(windows["request"])
    idle = {role: windows["idle-before"][role] | windows["idle-after"][role] for role in roles}
    for role in roles:
        print(f"\n== {role}: request window ({len(request[role])} modules; * also in an idle window of {role})")
        for name in sorted(request[role]):
            print(f"  {'*' if name in idle[role] else ' '} {name}")
        only_idle = sorted(idle[role] - request[role])
        print(f"-- {role}: only in an idle window (background, {len(only_idle)}): {', '.join(only_idle) or '-'}")

    def union(sets: dict[str, set[str]], packages: tuple[str, ...]) -> set[str]:
        return {name for role in roles for name in sets[role] if name.split("/")[0] in packages}

    net = {role: request[role] - idle[role] for role in roles}
    print(f"\n== across {', '.join(roles)} (packages {', '.join(SERVICES)}; batchwire/ apart)")
    print(f"request window: {len(union(request, SERVICES))} modules")
    print(f"request window minus modules its role also ran in an idle window: {len(union(net, SERVICES))} modules")
    print(f"  {', '.join(sorted(union(net, SERVICES)))}")
    print(f"batchwire/ in the request window: {', '.join(sorted(union(request, ('batchwire',)))) or '-'}")
    print(f"batchwire/ minus idle: {', '.join(sorted(union(net, ('batchwire',)))) or '-'}")


def main() -> None:
    was_up = stack_alive()
    namespace = f"trace{secrets.token_hex(3)}"
    subprocess.run([CLI, "stack", "up", "--namespace", namespace], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    try:
        with tempfile.TemporaryDirectory(prefix="request-path-") as name:
            tmp = Path(name)
            (tmp / "sitecustomize.py").write_text(HOOK)
            port = free_port()
            url = f"http://127.0.0.1:{port}/v1/inference"
            procs = start_roles(tmp, namespace, port)
            try:
                warm_up(url, procs, tmp)
                windows = {
                    window: record(procs, tmp, number, url if window == "request" else None)
                    for number, window in enumerate(WINDOWS, start=1)
                }
            finally:
                stop(procs)
            report(windows)
    finally:
        if not was_up:
            subprocess.run([CLI, "stack", "down"], cwd=REPO, check=False, stdout=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
