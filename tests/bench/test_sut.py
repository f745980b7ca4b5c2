"""Starting and stopping the system under test, with a fake ``batchwire`` command."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import psutil
import pytest

from batchwire.bench import stack as stack_module
from batchwire.bench import sut as sut_module
from batchwire.bench.cli import main
from batchwire.bench.sut import Mode, SutError, SutSpec, SystemUnderTest, plan

FAKE = (sys.executable, str(Path(__file__).with_name("fake_batchwire.py")))


def test_kafka_plan_starts_every_role_in_one_namespace(tmp_path: Path) -> None:
    spec = SutSpec(
        mode="kafka",
        policy="classic",
        workers=2,
        batchers=2,
        gateways=2,
        sim_latency_ms=100,
        slow_worker_latency_ms=500,
        max_batch=32,
    )
    planned = plan(spec, ["bw"], "nsx", tmp_path)
    argvs = [role.argv for role in planned.roles]
    assert [argv[1] for argv in argvs] == ["worker", "worker", "batcher", "batcher", "gateway", "gateway"]
    assert all(argv[-2:] == ["--namespace", "nsx"] for argv in argvs)
    assert argvs[0][argvs[0].index("--sim-latency-ms") + 1] == "500", "the first worker is the slow one"
    assert argvs[1][argvs[1].index("--sim-latency-ms") + 1] == "100"
    assert argvs[2][2:6] == ["--policy", "classic", "--max-batch", "32"]
    assert argvs[0][-4:-2] == ["--max-batch", "32"], "workers must take the batches the batcher makes"
    assert len(set(planned.urls)) == 2
    assert all(url.endswith("/v1/inference") for url in planned.urls)
    assert len(set(planned.metrics_urls)) == 6


def test_every_role_keeps_results_as_long_as_the_bench_says(tmp_path: Path) -> None:
    """A shared stack's Redis holds every run's results for their TTL: the bench sets a short one."""
    for mode in ("kafka", "embedded"):
        spec = SutSpec(mode=mode, policy="classic", workers=2, result_ttl_s=300)
        argvs = [role.argv for role in plan(spec, ["bw"], "nsx", tmp_path).roles]
        assert argvs and all(argv[argv.index("--result-ttl-s") + 1] == "300" for argv in argvs), argvs
    unset = plan(SutSpec(mode="kafka", policy="classic"), ["bw"], "nsx", tmp_path).roles
    assert all("--result-ttl-s" not in role.argv for role in unset), "None leaves the roles' default"


def test_embedded_plan_is_one_process(tmp_path: Path) -> None:
    spec = SutSpec(mode="embedded", policy="work-conserving", workers=3, sim_latency_ms=20, max_wait_ms=5)
    (role,) = plan(spec, ["bw"], "ignored", tmp_path).roles
    assert role.argv[:3] == ["bw", "up", "--host"]
    assert "--namespace" not in role.argv
    assert role.argv[role.argv.index("--workers") + 1] == "3"
    assert role.argv[-2:] == ["--max-wait-ms", "5"]


def test_the_roles_ports_are_drawn_once_the_stacks_servers_listen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port drawn before ``stack up`` may be the one a Sentinel then listens on: a gateway found it taken."""
    drawn: list[int] = []
    listening: set[int] = set()

    def draw(host: str = "127.0.0.1") -> int:
        drawn.append(30_000 + len(drawn))
        return drawn[-1]

    monkeypatch.setattr(sut_module, "free_port", draw)
    monkeypatch.setattr(SystemUnderTest, "_stack_up", lambda self: listening.update(drawn))  # the worst case
    monkeypatch.setattr(subprocess, "Popen", lambda *args, **kwargs: None)  # only the plan is under test
    with SystemUnderTest(SutSpec(mode="kafka", policy="classic", command=FAKE), tmp_path) as sut:
        sut.start()
    ports = {int(url.split(":")[2].split("/")[0]) for url in sut.urls + sut.metrics_urls}
    assert len(ports) == 3 and not ports & listening, f"roles on {sorted(ports)}, the stack on {sorted(listening)}"


async def test_start_wait_ready_and_stop_cleanly(tmp_path: Path) -> None:
    spec = SutSpec(mode="embedded", policy="classic", command=FAKE, ready_timeout_s=20)
    with SystemUnderTest(spec, tmp_path) as sut:
        sut.start()
        await sut.wait_ready()
        async with aiohttp.ClientSession() as session, session.post(sut.urls[0], json={"input": "abc"}) as answer:
            assert (await answer.json()) == {"output": "cba"}
    assert sut.describe()["returncodes"] == {"up": 0}, "SIGTERM should have stopped it cleanly"


@pytest.mark.parametrize("mode", ["echo", "echo-asgi"])
async def test_the_echo_floor_answers_as_the_sim_backend_does(tmp_path: Path, mode: Mode) -> None:
    """``--start echo``: a bare FastAPI endpoint (``echo-asgi``: a plain ASGI callable), so ``--check``
    holds against it as against batchwire."""
    spec = SutSpec(mode=mode, policy="work-conserving", ready_timeout_s=30)
    with SystemUnderTest(spec, tmp_path) as sut:
        sut.start()
        await sut.wait_ready()
        async with aiohttp.ClientSession() as session, session.post(sut.urls[0], json={"input": "abc"}) as answer:
            assert answer.status == 200
            assert answer.content_type == "application/json"
            assert (await answer.json()) == {"output": "cba"}
    # uvicorn re-raises the SIGTERM it shut down on: -15, not -9 (the SIGKILL after the grace period)
    assert sut.describe()["returncodes"] == {"echo": -signal.SIGTERM}, "SIGTERM should have stopped it"


async def test_sigkill_when_sigterm_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_BW_IGNORE_TERM", "1")
    spec = SutSpec(mode="embedded", policy="classic", command=FAKE, ready_timeout_s=20, stop_grace_s=0.5)
    with SystemUnderTest(spec, tmp_path) as sut:
        sut.start()
        await sut.wait_ready()
    assert sut.describe()["returncodes"] == {"up": -signal.SIGKILL}


async def test_children_left_behind_are_killed_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "argv.jsonl"
    monkeypatch.setenv("FAKE_BW_LOG", str(log))
    monkeypatch.setenv("FAKE_BW_ORPHAN", "1")
    spec = SutSpec(mode="embedded", policy="classic", command=FAKE, ready_timeout_s=20)
    with SystemUnderTest(spec, tmp_path) as sut:
        sut.start()
        await sut.wait_ready()
    (orphan,) = [entry["orphan"] for entry in map(json.loads, log.read_text().splitlines()) if "orphan" in entry]
    assert sut.describe()["returncodes"] == {"up": 0}
    with contextlib.suppress(psutil.NoSuchProcess):  # gone already
        # SIGKILL lands when the kernel next schedules the process: give it a moment.
        psutil.Process(orphan).wait(timeout=5)


async def test_a_role_that_exits_early_is_reported_with_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_BW_FAIL", "1")
    spec = SutSpec(mode="embedded", policy="classic", command=FAKE, ready_timeout_s=20)
    with SystemUnderTest(spec, tmp_path) as sut:
        sut.start()
        with pytest.raises(SutError, match=r"up exited with 3 before it was ready:\n.*told to fail"):
            await sut.wait_ready()


@pytest.fixture
def fake_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "argv.jsonl"
    monkeypatch.setenv("FAKE_BW_LOG", str(log))
    monkeypatch.setattr(sut_module, "batchwire_command", lambda: list(FAKE))
    monkeypatch.setattr(stack_module, "batchwire_command", lambda: list(FAKE))
    return log


def _started(log: Path) -> list[list[str]]:
    return [entry["argv"] for entry in map(json.loads, log.read_text().splitlines()) if "argv" in entry]


def _run(argv: list[str]) -> tuple[int, str]:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(argv)
    return status, printed.getvalue()


@pytest.mark.slow
def test_two_policies_restart_the_system_and_print_ratios(fake_command: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    status, printed = _run(
        [
            "--start",
            "embedded",
            "--policies",
            "work-conserving,classic",
            "--rate",
            "20",
            "--duration",
            "0.5",
            "--warmup",
            "0.1",
            "--sim-latency-ms",
            "10",
            "--check",
            "--lone",
            "0",
            "--out",
            str(out),
        ]
    )
    assert status == 0, printed
    started = _started(fake_command)
    assert [argv[argv.index("--policy") + 1] for argv in started] == ["work-conserving", "classic"]
    assert "B/A" in printed
    assert "policy classic" in printed
    document = json.loads((out / "results.json").read_text())
    runs = document["runs"]
    assert [run["policy"] for run in runs] == ["work-conserving", "classic"]
    assert runs[0]["rates"][0]["server"]["flushes"].keys() == {"idle_worker"}
    assert runs[1]["rates"][0]["server"]["flushes"].keys() == {"max_wait"}
    assert all(run["sut"]["returncodes"] == {"up": 0} for run in runs)
    # CPU counters tick every 10 ms, so a 0.5 s window of a near-idle fake may read 0: check the pids only.
    assert len(runs[0]["rates"][0]["processes"]["batchwire"]["pids"]) == 1
    assert (out / "logs" / "classic" / "up.log").exists()


@pytest.mark.slow
def test_kafka_mode_starts_the_stack_and_every_role(fake_command: Path, tmp_path: Path) -> None:
    status, printed = _run(
        [
            "--start",
            "kafka",
            "--workers",
            "2",
            "--gateways",
            "2",
            "--rate",
            "40",
            "--duration",
            "0.5",
            "--warmup",
            "0.1",
            "--sim-latency-ms",
            "5",
            "--slow-worker-latency-ms",
            "50",
            "--lone",
            "0",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert status == 0, printed
    started = _started(fake_command)
    assert started[0] == ["stack", "status"]
    assert started[1][:2] == ["stack", "up"]
    assert sorted(argv[0] for argv in started[2:-1]) == ["batcher", "gateway", "gateway", "worker", "worker"]
    assert started[-1] == ["stack", "down"], "a stack this run started is stopped at the end"
    namespaces = {argv[argv.index("--namespace") + 1] for argv in started[1:-1]}
    assert len(namespaces) == 1, "the stack's topics and every role share one namespace"
    (run,) = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    rate = run["rates"][0]
    assert {"batchwire", "batchwire.gateway", "batchwire.batcher", "batchwire.worker"} <= set(rate["processes"])
    assert len(rate["processes"]["batchwire.gateway"]["pids"]) == 2
    assert rate["server"]["workers"] == 2
    assert len(rate["server"]["metrics_urls"]) == 5
    assert rate["ok"] == rate["scheduled"] > 0


@pytest.mark.slow
def test_brokers_start_a_stack_of_the_runs_own_and_remove_it(
    fake_command: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHWIRE_KAFKA_BOOTSTRAP", "elsewhere:9092")  # must not reach the roles
    out = tmp_path / "out"
    status, printed = _run(
        [
            "--start",
            "kafka",
            "--brokers",
            "3",
            "--redis-replicas",
            "1",
            "--rate",
            "20",
            "--duration",
            "0.5",
            "--warmup",
            "0.1",
            "--sim-latency-ms",
            "5",
            "--lone",
            "2",
            "--lone-gap-ms",
            "10",
            "--out",
            str(out),
        ]
    )
    assert status == 0, printed
    entries = [json.loads(line) for line in fake_command.read_text().splitlines()]
    argvs = [entry["argv"] for entry in entries]
    up = argvs[1]
    state_dir = Path(up[up.index("--state-dir") + 1])
    assert up[:2] == ["stack", "up"] and up[up.index("--brokers") + 1] == "3"
    assert up[up.index("--redis-replicas") + 1] == "1"
    assert all(
        argv[-2:] == ["--state-dir", str(state_dir)]
        for argv in argvs
        if argv[:2] != ["stack", "up"] and argv[0] == "stack"
    ), argvs
    assert argvs[-1][:2] == ["stack", "down"], "the run's own stack is stopped at the end"
    assert not state_dir.exists(), "and its state dir (data, logs) removed"
    for entry in entries:
        assert entry["env"] == {
            "BATCHWIRE_STACK_ENV": str(state_dir / "stack.env"),
            "BATCHWIRE_KAFKA_BOOTSTRAP": None,
        }, f"{entry['argv']} must take its addresses from the run's own stack.env"
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["sut"]["own_stack"] == {"state_dir": str(state_dir), "brokers": 3, "redis_replicas": 1}
    infra = run["sut"]["infra_pids"]
    assert infra["found_by"] == "stack status --json"
    assert (len(infra["kafka"]), len(infra["redis"]), len(infra["sentinel"])) == (2, 1, 2), "only live servers count"
    assert {"kafka", "redis", "sentinel"} <= set(run["rates"][0]["processes"]), "each kind's CPU is reported apart"
    assert run["lone"]["ok"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_stops_the_system_and_keeps_the_results(signum: int, tmp_path: Path) -> None:
    log = tmp_path / "argv.jsonl"
    out = tmp_path / "out"
    code = (
        "import sys\n"
        "from batchwire.bench import sut\n"
        f"sut.batchwire_command = lambda: {list(FAKE)!r}\n"
        "from batchwire.bench.cli import main\n"
        f"sys.exit(main(['--start', 'embedded', '--rate', '20,20', '--duration', '0.5', '--warmup', '0',"
        f" '--pause', '60', '--lone', '0', '--out', {str(out)!r}]))\n"
    )
    bench = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, "FAKE_BW_LOG": str(log)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert bench.stderr is not None
        seen = ""
        while "ok " not in seen:  # the first rate is done and the bench waits out the long pause
            line = bench.stderr.readline()
            assert line, f"the bench ended early: {seen}"
            seen += line
        bench.send_signal(signum)
        bench.communicate(timeout=30)
    finally:
        bench.kill()
        bench.communicate()  # closes the pipes
    assert bench.returncode == 130
    (started,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert not psutil.pid_exists(started["pid"]), "the system under test must be stopped"
    document = json.loads((out / "results.json").read_text())
    assert len(document["runs"][0]["rates"]) == 1, "what was measured before the interrupt is kept"
    assert document["runs"][0]["sut"]["returncodes"] == {"up": 0}
