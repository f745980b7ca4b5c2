"""``/v1/fleet`` and ``/dashboard``: the fleet's members, totals and models, and who may read them."""

from __future__ import annotations

import json
import time

import pytest
from httpx_sse import aconnect_sse

from gateway.edge.auth import digest_of
from gateway.edge.routes.fleet import fleet_view
from schemas.heartbeat import Beat
from tests.support.eventually import eventually
from tests.support.gateway_rig import RigFactory, error_of, serving
from transport.memory.fleet import MemoryFleet

NOW_MS = 1_700_000_000_000
TENANT = "tenant-key-0123456789"
OPERATOR = "operator-key-0123456789"


def beat(
    role: str,
    member_id: str,
    *,
    models: tuple[str, ...] = ("sim",),
    state: str = "busy",
    age_ms: int = 100,
    pid: int = 1,
    figures: dict[str, float] | None = None,
    breakdowns: dict[str, dict[str, float]] | None = None,
    per_model: dict[str, dict[str, float]] | None = None,
    final: bool = False,
) -> Beat:
    return Beat(
        role=role,
        id=member_id,
        host="h",
        pid=pid,
        version="0.1.0",
        models=models,
        state=state,
        at_ms=NOW_MS - age_ms,
        interval_s=1.0,
        figures=figures or {},
        breakdowns=breakdowns or {},
        per_model=per_model or {},
        final=final,
    )


FLEET = [
    beat(
        "gateway",
        "g1",
        figures={"requests_per_s": 300.0, "answered_per_s": 300.0, "refused_per_s": 5, "p50_ms": 100, "p99_ms": 150},
        breakdowns={"refusals_per_s": {"503": 5.0}},
        per_model={"sim": {"answered_per_s": 300.0, "refused_per_s": 5, "p50_ms": 100, "p99_ms": 150}},
    ),
    beat(
        "gateway",
        "g2",
        figures={"requests_per_s": 100.0, "answered_per_s": 100.0, "refused_per_s": 1, "p50_ms": 120, "p99_ms": 400},
        breakdowns={"refusals_per_s": {"503": 0.5, "429": 0.5}},
        per_model={"sim": {"answered_per_s": 100.0, "refused_per_s": 1, "p50_ms": 120, "p99_ms": 400}},
    ),
    beat(
        "batcher",
        "b1",
        figures={"queue_depth": 7},
        breakdowns={"flushes_per_s": {"full": 2.0}},
        per_model={"sim": {"queue_depth": 7}},
    ),
    beat("worker", "w1", figures={"batches_per_s": 10, "mean_batch_size": 30, "busy_fraction": 1.0}),
    beat("worker", "w2", state="idle", figures={"batches_per_s": 10, "mean_batch_size": 10, "busy_fraction": 0.5}),
    beat("worker", "w3", age_ms=10_000, figures={"batches_per_s": 99, "mean_batch_size": 99, "busy_fraction": 1.0}),
    beat("worker", "e1", models=("embed",), state="hung", figures={"batches_per_s": 0.0, "busy_fraction": 0.0}),
    beat("worker", "e2", models=("embed",), state="failed"),
]


def test_the_view_sums_live_members_and_shows_the_dead_as_gone() -> None:
    view = fleet_view(FLEET, ("sim", "embed", "idle-model"), NOW_MS)
    states = {member["id"]: member["state"] for member in view["members"]}
    assert states == {
        **{"g1": "busy", "g2": "busy", "b1": "busy", "w1": "busy", "w2": "idle", "w3": "gone"},
        **{"e1": "hung", "e2": "failed"},
    }
    assert [member["role"] for member in view["members"]][:3] == ["gateway", "gateway", "batcher"]
    totals = view["totals"]
    assert totals["requests_per_s"] == 400.0
    assert totals["p50_ms"] == pytest.approx(105.0), "the gateways' p50s weighted by what each answered"
    assert totals["p99_ms"] == 400, "the highest p99: quantiles of several gateways do not average"
    assert totals["refusals_per_s"] == {"503": 5.5, "429": 0.5}
    assert totals["flushes_per_s"] == {"full": 2.0}
    assert totals["queue_depth"] == 7
    assert totals["batches_per_s"] == 20, "the gone worker's last figures count no more"
    assert totals["mean_batch_size"] == pytest.approx(20.0)


def test_an_id_two_live_processes_beat_as_is_named_with_both() -> None:
    twins = [beat("worker", "w1", pid=2), beat("worker", "w9", pid=3), beat("worker", "w9", pid=4, age_ms=10_000)]
    view = fleet_view([*FLEET, *twins], ("sim",), NOW_MS)
    assert view["shared_ids"] == [{"role": "worker", "id": "w1", "processes": ["h:1", "h:2"]}], (
        "w1 twice live is named; w9's second process is gone (a restart), not a twin"
    )
    assert view["models"]["sim"]["workers_live"] == 4, "w1 twice, w2 and w9: both processes of w1 serve, and count"
    assert fleet_view(FLEET, ("sim",), NOW_MS)["shared_ids"] == []


def test_a_role_a_later_release_adds_is_listed_after_the_known_ones() -> None:
    view = fleet_view([beat("router", "r1"), *FLEET], ("sim",), NOW_MS)
    assert [member["role"] for member in view["members"]][-1] == "router"


def test_each_model_has_a_row_and_one_with_no_live_worker_says_so() -> None:
    rows = fleet_view(FLEET, ("sim", "embed", "idle-model"), NOW_MS)["models"]
    assert set(rows) == {"sim", "embed", "idle-model"}
    assert (rows["sim"]["workers_live"], rows["sim"]["workers_busy"], rows["sim"]["workers_hung"]) == (2, 1, 0)
    assert rows["sim"]["queue_depth"] == 7 and rows["sim"]["answered_per_s"] == 400.0
    assert (rows["embed"]["workers_live"], rows["embed"]["workers_hung"]) == (1, 1), "a failed worker is not live"
    assert rows["idle-model"]["workers_live"] == 0


async def test_the_fleet_route_serves_the_store_s_members(make_rig: RigFactory) -> None:
    fleet = MemoryFleet()
    now_ms = int(time.time() * 1000)
    await fleet.beat(
        [beat("worker", "w1", age_ms=NOW_MS - now_ms + 200), beat("worker", "w9", age_ms=NOW_MS - now_ms + 9000)]
    )
    rig = await make_rig(fleet=fleet)
    response = await rig.client.get("/v1/fleet")
    assert response.status_code == 200
    doc = response.json()
    assert {member["id"]: member["state"] for member in doc["members"]} == {"w1": "busy", "w9": "gone"}
    assert doc["models"]["sim"]["workers_live"] == 1
    assert abs(doc["at_ms"] - now_ms) < 60_000


async def test_without_a_fleet_store_the_route_says_so(make_rig: RigFactory) -> None:
    rig = await make_rig()
    response = await rig.client.get("/v1/fleet")
    assert response.status_code == 503
    assert error_of(response)["code"] == "unavailable"
    assert "fleet" in error_of(response)["message"]


async def test_the_page_is_open_and_the_fleet_needs_an_operator_key(make_rig: RigFactory) -> None:
    operator = digest_of(OPERATOR)
    rig = await make_rig(fleet=MemoryFleet(), api_keys=(digest_of(TENANT), operator), operator_keys=(operator,))
    page = await rig.client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/dashboard/events" in page.text and "<script" in page.text
    assert "http://" not in page.text and "https://" not in page.text, "nothing fetched from elsewhere"
    for path in ("/v1/fleet", "/dashboard/events"):
        assert (await rig.client.get(path)).status_code == 401
        tenant = await rig.client.get(path, headers={"Authorization": f"Bearer {TENANT}"})
        assert tenant.status_code == 403 and error_of(tenant)["code"] == "forbidden"
    answer = await rig.client.get("/v1/fleet", headers={"Authorization": f"Bearer {OPERATOR}"})
    assert answer.status_code == 200 and answer.json()["members"] == []


async def test_the_dashboard_stream_sends_the_fleet_with_rising_ids_and_resumes_after_the_last(
    make_rig: RigFactory,
) -> None:
    fleet = MemoryFleet()
    await fleet.beat([beat("worker", "w1", age_ms=NOW_MS - int(time.time() * 1000))])
    rig = await make_rig(fleet=fleet)
    async with serving(rig) as client:
        async with aconnect_sse(client, "GET", "/dashboard/events") as source:
            events = source.aiter_sse()
            first, second = await anext(events), await anext(events)
        async with aconnect_sse(client, "GET", "/dashboard/events", headers={"Last-Event-ID": second.id}) as source:
            resumed = await anext(source.aiter_sse())
    assert (first.event, first.retry, second.event) == ("fleet", 1000, "fleet")
    assert int(first.id) < int(second.id) < int(resumed.id)
    assert [member["id"] for member in json.loads(second.data)["members"]] == ["w1"]


def test_a_worker_still_starting_is_shown_and_not_live() -> None:
    """It is loading its model or joining its group: its model's requests wait, as ``status`` must say."""
    members = [beat("worker", "w1", state="starting"), beat("worker", "w2", models=("embed",), state="idle")]
    view = fleet_view(members, ("sim", "embed"), NOW_MS)
    assert [member["state"] for member in view["members"]] == ["starting", "idle"]
    assert (view["models"]["sim"]["workers_live"], view["models"]["embed"]["workers_live"]) == (0, 1)


def test_each_model_counts_its_live_batchers_and_not_one_still_joining() -> None:
    """With no batcher live, requests wait on the bus unbatched however many workers idle: ``status`` must
    say so, and a batcher still joining its group batches nothing yet, nor one whose loop crashed."""
    members = [
        beat("batcher", "b1", models=("sim", "embed")),
        beat("batcher", "b2", models=("sim",), state="starting"),
        beat("batcher", "b3", models=("embed",), age_ms=10_000),
        beat("worker", "w1", state="idle"),
        beat("batcher", "b4", models=("sim",), state="failed"),
    ]
    rows = fleet_view(members, ("sim", "embed", "idle-model"), NOW_MS)["models"]
    assert {model: row["batchers_live"] for model, row in rows.items()} == {"sim": 1, "embed": 1, "idle-model": 0}
    alone = fleet_view([members[1], members[3]], ("sim",), NOW_MS)["models"]["sim"]
    assert (alone["batchers_live"], alone["workers_live"]) == (0, 1)


async def test_dashboard_streams_count_against_the_watchers_and_end_after_sse_max_s(make_rig: RigFactory) -> None:
    """Each dashboard stream holds its connection's place at the cap and a fleet view a second, and with
    keys off anyone may open one: it counts against ``--max-watchers`` and the client's share, as a task's
    stream does, and ends after ``sse_max_s`` (the page resumes it). Uncounted and endless, one client's
    streams would hold every place of the cap for good."""
    fleet = MemoryFleet()
    await fleet.beat([beat("worker", "w1", age_ms=NOW_MS - int(time.time() * 1000))])
    rig = await make_rig(fleet=fleet, max_watchers_per_client=2, sse_max_s=1.5)
    async with serving(rig) as client:
        async with aconnect_sse(client, "GET", "/dashboard/events") as first:
            firsts = first.aiter_sse()
            assert (await anext(firsts)).event == "fleet"
            async with aconnect_sse(client, "GET", "/dashboard/events") as second:
                assert (await anext(second.aiter_sse())).event == "fleet"
                assert rig.gateway.watchers == 2
                over = await client.get("/dashboard/events")
                assert over.status_code == 503 and error_of(over)["code"] == "overloaded", over.text
                assert "BATCHWIRE_MAX_WATCHERS_PER_CLIENT" in error_of(over)["message"]
            ended = [event.event async for event in firsts]  # until the stream ends, sse_max_s after it began
        assert set(ended) <= {"fleet"} and len(ended) <= 3, ended
        await eventually(lambda: rig.gateway.watchers == 0, "the streams' places to be given back")


def test_a_member_that_stopped_shows_the_state_it_stopped_in_until_dropped_and_is_not_live() -> None:
    """A process that stops beats once more (``final``): a clean stop reads ``stopped``, a worker that
    stopped because its backend hung or failed reads ``hung`` or ``failed``, past the 3 beats after which
    a member that only fell silent (``kill -9``) reads ``gone``. None of them is live."""
    members = [
        beat("gateway", "g1", state="idle"),
        beat("gateway", "g2", state="stopped", final=True, age_ms=30_000),
        beat("batcher", "b1", state="idle"),
        beat("batcher", "b2", state="stopped", final=True, age_ms=30_000),
        beat("worker", "w1", state="idle"),
        beat("worker", "w2", state="stopped", final=True, age_ms=30_000),
        beat("worker", "w3", state="hung", final=True, age_ms=30_000),
        beat("worker", "w4", state="failed", final=True, age_ms=30_000),
        beat("worker", "w5", state="busy", age_ms=30_000),
        beat("worker", "w6", state="stopped", final=True, age_ms=10),
        beat("worker", "w1", state="stopped", final=True, pid=2, figures={"batches_per_s": 50.0}),
    ]
    view = fleet_view(members, ("sim",), NOW_MS)
    states = {(member["id"], member["pid"]): member["state"] for member in view["members"]}
    assert states == {
        **{("g1", 1): "idle", ("g2", 1): "stopped", ("b1", 1): "idle", ("b2", 1): "stopped"},
        **{("w1", 1): "idle", ("w1", 2): "stopped", ("w2", 1): "stopped", ("w3", 1): "hung"},
        **{("w4", 1): "failed", ("w5", 1): "gone", ("w6", 1): "stopped"},
    }, states
    row = view["models"]["sim"]
    assert (row["batchers_live"], row["workers_live"], row["workers_hung"]) == (1, 1, 0), row
    assert view["totals"]["batches_per_s"] == 0.0, "a stopped member's last figures count no more"
    assert view["shared_ids"] == [], "w1 restarted after a clean stop: one live process, not two"
    assert all(member["final"] == (member["state"] in ("stopped", "hung", "failed")) for member in view["members"])
    assert all(member["final"] is False for member in fleet_view(FLEET, ("sim",), NOW_MS)["members"])
