"""``batchwire status`` against a gateway's ``/v1/fleet``: the tables, the JSON, and the exit codes scripts read."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import time

import pytest

from batchwire.cli import main
from gateway.edge.auth import digest_of
from schemas.heartbeat import Beat
from tests.support.gateway_rig import RigFactory, serving
from transport.memory.fleet import MemoryFleet

CLEAR = b"\x1b[H\x1b[2J"
TENANT = "tenant-key-0123456789"
OPERATOR = "operator-key-0123456789"


def beat(
    role: str,
    member_id: str,
    models: tuple[str, ...],
    *,
    age_s: float = 0.1,
    interval_s: float = 1.0,
    pid: int = 4242,
    state: str = "busy",
    final: bool = False,
    result_ttl_s: float | None = None,
    **figures: float,
) -> Beat:
    return Beat(
        role=role,
        id=member_id,
        host="host-a",
        pid=pid,
        version="0.1.0",
        models=models,
        state=state,
        at_ms=int((time.time() - age_s) * 1000),
        interval_s=interval_s,
        figures=figures,
        final=final,
        result_ttl_s=result_ttl_s,
    )


async def fleet_of(*beats: Beat) -> MemoryFleet:
    fleet = MemoryFleet()
    await fleet.beat(beats)
    return fleet


async def status(*args: str) -> int:
    return await asyncio.to_thread(main, ["status", *args])


async def test_the_fleet_prints_as_a_members_table_and_a_models_table(
    make_rig: RigFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = await fleet_of(
        beat("gateway", "gw-1", ("sim",), requests_per_s=812.0, p99_ms=180.0),
        beat("batcher", "b-1", ("sim",)),
        beat("worker", "sim-worker-0", ("sim",), batches_per_s=9.9, mean_batch_size=81.2, busy_fraction=0.49),
    )
    rig = await make_rig(fleet=fleet, models=("sim",))
    async with serving(rig) as client:
        code = await status("--url", str(client.base_url))
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["ROLE", "ID", "MODELS", "STATE"]
    gateway_line = next(line for line in lines if line.startswith("gateway"))
    assert "gw-1" in gateway_line and "812.0" in gateway_line and "180" in gateway_line
    worker_line = next(line for line in lines if line.startswith("worker"))
    assert "sim-worker-0" in worker_line and "81.2" in worker_line and "49%" in worker_line
    model_line = next(line for line in lines if line.startswith("sim "))
    assert model_line.split()[1:3] == ["1", "1"], "one live batcher and one live worker for sim"


async def test_two_live_processes_with_one_id_are_both_shown_and_named(
    make_rig: RigFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = await fleet_of(
        beat("batcher", "b1", ("sim",)), beat("worker", "w1", ("sim",), pid=11), beat("worker", "w1", ("sim",), pid=12)
    )
    rig = await make_rig(fleet=fleet, models=("sim",))
    async with serving(rig) as client:
        code = await status("--url", str(client.base_url))
    out = capsys.readouterr().out
    assert code == 0, out
    assert sum(line.startswith("worker") for line in out.splitlines()) == 2, out
    warning = "2 live processes beat as worker w1 (host-a:11, host-a:12): give each its own --worker-id"
    assert warning in out, out


async def test_live_processes_keeping_task_states_for_different_times_are_named(
    make_rig: RigFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each role sets the expiry of the states it writes, so one with a shorter TTL drops results early: the
    roles that disagree are named (a stopped one, and one that states no TTL, are not counted)."""
    fleet = await fleet_of(
        beat("batcher", "b1", ("sim",), result_ttl_s=3600.0),
        beat("worker", "w1", ("sim",), result_ttl_s=5.0),
        beat("worker", "w2", ("sim",), result_ttl_s=60.0, state="stopped", final=True),
        beat("worker", "w3", ("sim",)),
    )
    rig = await make_rig(fleet=fleet, models=("sim",))
    async with serving(rig) as client:
        code = await status("--url", str(client.base_url))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "live processes keep task states for different times (batcher b1 3600 s, worker w1 5 s)" in out, out
    assert "give every role the same --result-ttl-s" in out, out


async def test_a_model_without_a_live_worker_exits_1_and_is_named(
    make_rig: RigFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = await fleet_of(beat("worker", "w-dead", ("sim",), age_s=10))
    rig = await make_rig(fleet=fleet, models=("sim",))
    async with serving(rig) as client:
        code = await status("--url", str(client.base_url))
    out = capsys.readouterr().out
    assert code == 1
    assert "gone" in next(line for line in out.splitlines() if "w-dead" in line)
    assert "no live worker for sim" in out


async def test_a_model_without_a_live_batcher_exits_1_and_is_named(
    make_rig: RigFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = await fleet_of(beat("batcher", "b-dead", ("sim",), age_s=10), beat("worker", "w1", ("sim",)))
    rig = await make_rig(fleet=fleet, models=("sim",))
    async with serving(rig) as client:
        code = await status("--url", str(client.base_url))
    out = capsys.readouterr().out
    assert code == 1, out
    assert "no live batcher for sim" in out and "no live worker" not in out, out


async def test_a_member_that_stopped_reads_as_it_stopped_past_3_beats_and_is_not_counted(
    make_rig: RigFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """A clean stop is no alarm: the model is still served by the others, and the command exits 0. A
    worker that stopped because its backend hung reads ``hung``, not live."""
    fleet = await fleet_of(
        beat("gateway", "gw-old", ("sim",), age_s=20, state="stopped", final=True),
        beat("batcher", "b1", ("sim",)),
        beat("batcher", "b-old", ("sim",), age_s=20, state="stopped", final=True),
        beat("worker", "w1", ("sim",)),
        beat("worker", "w-old", ("sim",), age_s=20, state="stopped", final=True),
        beat("worker", "w-hung", ("sim",), age_s=20, state="hung", final=True),
    )
    rig = await make_rig(fleet=fleet, models=("sim",))
    async with serving(rig) as client:
        code = await status("--url", str(client.base_url))
    out = capsys.readouterr().out
    assert code == 0, out
    rows = {line.split()[1]: line.split() for line in out.splitlines() if line.split()[:1] in (["batcher"], ["worker"])}
    rows.update({line.split()[1]: line.split() for line in out.splitlines() if line.startswith("gateway")})
    states = {member_id: row[3] for member_id, row in rows.items()}
    assert states == {"gw-old": "stopped", "b1": "busy", "b-old": "stopped", "w1": "busy", "w-old": "stopped"} | {
        "w-hung": "hung"
    }, out
    model = next(line for line in out.splitlines() if line.startswith("sim "))
    assert model.split()[1:5] == ["1", "1", "1", "0"], "one live batcher and worker, busy; the hung one gone: " + out


async def test_a_model_whose_workers_all_stopped_exits_1_and_is_named(
    make_rig: RigFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = await fleet_of(
        beat("batcher", "b1", ("sim",)), beat("worker", "w1", ("sim",), age_s=5, state="stopped", final=True)
    )
    rig = await make_rig(fleet=fleet, models=("sim",))
    async with serving(rig) as client:
        code = await status("--url", str(client.base_url))
    out = capsys.readouterr().out
    assert code == 1, out
    assert "stopped" in next(line for line in out.splitlines() if "w1" in line)
    assert "no live worker for sim" in out, out


async def test_json_is_the_gateway_s_document(make_rig: RigFactory, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = await fleet_of(beat("batcher", "b1", ("sim",)), beat("worker", "w1", ("sim",)))
    rig = await make_rig(fleet=fleet, models=("sim",))
    async with serving(rig) as client:
        code = await status("--url", str(client.base_url), "--json")
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [member["id"] for member in doc["members"]] == ["b1", "w1"]
    assert doc["models"]["sim"]["workers_live"] == 1


async def test_a_key_the_gateway_refuses_exits_2_with_its_reason(
    make_rig: RigFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    operator = digest_of(OPERATOR)
    rig = await make_rig(
        fleet=MemoryFleet(), models=("sim",), api_keys=(digest_of(TENANT), operator), operator_keys=(operator,)
    )
    async with serving(rig) as client:
        keyless = await status("--url", str(client.base_url))
        keyless_err = capsys.readouterr().err
        refused = await status("--url", str(client.base_url), "--api-key", TENANT)
        refused_err = capsys.readouterr().err
        accepted = await status("--url", str(client.base_url), "--api-key", OPERATOR)
    assert refused == 2 and "403" in refused_err and "operator key" in refused_err
    assert accepted == 1, "an empty fleet: sim has no live worker"
    # the gateway's own message speaks of a header; the command's caller sets a flag or a variable
    for err in (keyless_err, refused_err):
        assert "--api-key" in err and "BATCHWIRE_API_KEY" in err, err
    assert keyless == 2 and "401" in keyless_err, keyless_err


async def test_an_unreachable_gateway_exits_2_and_says_where_it_looked(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again before the command runs: nothing listens there
    code = await status("--url", f"http://127.0.0.1:{port}")
    err = capsys.readouterr().err
    assert code == 2
    assert f"127.0.0.1:{port}" in err, err
    assert "--url" in err and "BATCHWIRE_URL" in err, f"the message says how to name another gateway: {err}"


async def test_watch_redraws_until_interrupted_and_exits_with_the_last_code(make_rig: RigFactory) -> None:
    # Live for three beats: a long beat, so that it is still live however slowly the command starts.
    fleet = await fleet_of(
        beat("batcher", "b1", ("sim",), interval_s=60.0), beat("worker", "w1", ("sim",), interval_s=60.0)
    )
    rig = await make_rig(fleet=fleet, models=("sim",))
    async with serving(rig) as client:
        watch = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "batchwire.cli",
            "status",
            "--url",
            str(client.base_url),
            "--watch",
            "0.05",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert watch.stdout is not None
        seen = b""
        try:
            async with asyncio.timeout(30):
                while seen.count(CLEAR) < 3:
                    seen += await watch.stdout.read(4096) or b""
                    assert watch.returncode is None, seen
        finally:
            watch.send_signal(signal.SIGINT)
            code = await watch.wait()
    assert code == 0, "interrupted after a fleet whose every model had a live batcher and worker"
    frames = [frame for frame in seen.split(CLEAR) if frame]
    assert all(b"w1" in frame for frame in frames[:2]), "each redraw is the whole table"
