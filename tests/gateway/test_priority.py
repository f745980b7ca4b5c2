"""Priority tiers at the gateway: the body field, the key's default and ceiling, and admission by tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.admission.gate import Admission, Caller
from gateway.admission.priority import KeyTiers, request_tier
from gateway.edge.auth import digest_of, load_api_keys
from gateway.errors import InvalidPriority, Overloaded, PriorityAboveCeiling
from gateway.settings import GatewaySettings
from schemas.records import Priority
from telemetry.metrics import REGISTRY
from tests.support.gateway_rig import RigFactory, error_of
from tests.support.queue_depth import Counters, admit_sent
from transport.memory.cache import MemoryResultCache
from transport.ports import Backlog

pytestmark = pytest.mark.timeout(60)

KEY_FREE = "free-tier-key-0123456789"
KEY_PREMIUM = "premium-key-0123456789"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# the tier a request runs at ---------------------------------------------------------------------


def test_a_request_gets_what_it_asks_for_or_its_keys_default() -> None:
    assert request_tier(None, None) is Priority.NORMAL
    assert request_tier("low", None) is Priority.LOW
    assert request_tier("high", None) is Priority.HIGH, "without a key's ceiling any tier may be asked for"
    free = KeyTiers(default=Priority.LOW, ceiling=Priority.NORMAL)
    assert request_tier(None, free) is Priority.LOW
    assert request_tier("normal", free) is Priority.NORMAL


def test_asking_above_the_keys_ceiling_is_refused_and_names_the_ceiling() -> None:
    with pytest.raises(PriorityAboveCeiling) as refused:
        request_tier("high", KeyTiers(Priority.LOW, Priority.NORMAL))
    assert "ceiling, 'normal'" in refused.value.message, refused.value.message


def test_a_name_that_is_no_tier_is_refused_with_the_allowed_names() -> None:
    with pytest.raises(InvalidPriority) as refused:
        request_tier("urgent", None)
    assert "'high', 'normal', 'low'" in refused.value.message, refused.value.message


def test_a_default_above_the_ceiling_is_refused() -> None:
    with pytest.raises(ValueError, match="must not be above its ceiling"):
        KeyTiers(Priority.HIGH, Priority.NORMAL)


# the keys file ----------------------------------------------------------------------------------


def test_the_keys_file_gives_a_key_its_default_and_ceiling(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_FREE} priority=low ceiling=normal\n{KEY_PREMIUM}\noperator {'o' * 20} ceiling=low\n")
    loaded = load_api_keys(None, str(keys))
    tiers = dict(KeyTiers.decode(entry) for entry in loaded.tiers)
    assert tiers[digest_of(KEY_FREE)] == KeyTiers(Priority.LOW, Priority.NORMAL)
    assert tiers[digest_of("o" * 20)] == KeyTiers(Priority.LOW, Priority.LOW), "the default follows a low ceiling"
    assert digest_of(KEY_PREMIUM) not in tiers, "a key without options takes normal, up to high"
    assert loaded.operators == (digest_of("o" * 20),)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (f"{KEY_FREE} priority=urgent", "'urgent' is not a priority tier"),
        (f"{KEY_FREE} priority=high ceiling=low", "must not be above its ceiling"),
    ],
)
def test_a_bad_tier_in_the_keys_file_names_its_line(tmp_path: Path, entry: str, message: str) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# keys\n{entry}\n")
    with pytest.raises(ValueError, match=message) as refused:
        load_api_keys(None, str(keys))
    assert f"line 2 of {keys}" in str(refused.value)
    assert KEY_FREE not in str(refused.value), "an error never shows the key"


# over HTTP ----------------------------------------------------------------------------------------


async def test_the_tier_travels_on_the_request(make_rig: RigFactory) -> None:
    rig = await make_rig()
    await rig.worker()
    answered = {tier: tier_submits(tier, "answered") for tier in ("low", "high", "normal")}
    for tier in ("low", "high", None):
        body = {"input": "x"} if tier is None else {"input": "x", "priority": tier}
        assert (await rig.client.post("/v1/inference", json=body)).status_code == 200
    seen = [request.priority for request in rig.workers[0].seen]
    assert seen == [Priority.LOW, Priority.HIGH, Priority.NORMAL]
    assert {tier: tier_submits(tier, "answered") - before for tier, before in answered.items()} == {
        "low": 1,
        "high": 1,
        "normal": 1,
    }


async def test_shared_answers_count_as_answered_too(make_rig: RigFactory) -> None:
    """A deterministic model's synchronous 200s, computed for several callers or from the cache, are
    answers of their tier like any other."""
    rig = await make_rig(deterministic_models=("sim",), cache=MemoryResultCache(), cache_ttl_s=60.0)
    await rig.worker()
    before = tier_submits("low", "answered")
    for _ in range(2):  # computed, then from the cache
        answer = await rig.client.post("/v1/inference", json={"input": "same", "priority": "low"})
        assert answer.status_code == 200, answer.text
    assert tier_submits("low", "answered") - before == 2


@pytest.mark.parametrize("path", ["/v1/inference", "/v1/tasks"])
async def test_a_priority_that_is_no_tier_is_422_and_nothing_is_queued(make_rig: RigFactory, path: str) -> None:
    rig = await make_rig()
    refused = await rig.client.post(path, json={"input": "x", "priority": "urgent"})
    assert refused.status_code == 422, refused.text
    error = error_of(refused)
    assert error["code"] == "invalid_priority"
    assert "'high', 'normal', 'low'" in error["message"]
    typed = await rig.client.post(path, json={"input": "x", "priority": 1})
    assert typed.status_code == 422 and error_of(typed)["code"] == "validation_error"
    assert rig.produced() == 0


async def test_a_key_above_its_ceiling_is_403_and_its_default_applies(make_rig: RigFactory) -> None:
    free = KeyTiers(Priority.LOW, Priority.NORMAL).encode(digest_of(KEY_FREE))
    rig = await make_rig(api_keys=(digest_of(KEY_FREE), digest_of(KEY_PREMIUM)), key_tiers=(free,))
    await rig.worker()
    refused = await rig.client.post("/v1/tasks", json={"input": "x", "priority": "high"}, headers=bearer(KEY_FREE))
    assert refused.status_code == 403, refused.text
    assert error_of(refused)["code"] == "priority_above_ceiling"
    assert "'normal'" in error_of(refused)["message"]
    assert rig.produced() == 0
    assert (await rig.client.post("/v1/inference", json={"input": "x"}, headers=bearer(KEY_FREE))).status_code == 200
    premium = {"input": "x", "priority": "high"}
    assert (await rig.client.post("/v1/inference", json=premium, headers=bearer(KEY_PREMIUM))).status_code == 200
    assert [r.priority for r in rig.workers[0].seen] == [Priority.LOW, Priority.HIGH]
    spec = (await rig.client.get("/openapi.json")).json()
    body = spec["paths"]["/v1/tasks"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["properties"]["priority"]["anyOf"][0]["enum"] == ["high", "normal", "low"]
    assert "403" in spec["paths"]["/v1/tasks"]["post"]["responses"]


async def test_a_full_queue_sheds_low_first_then_normal_and_high_last(make_rig: RigFactory) -> None:
    rig = await make_rig(queue_depth="bus", max_queue_depth=10, retry_after_s=2)  # no worker: nothing leaves
    counted = {(tier, outcome): tier_submits(tier, outcome) for tier in ("low", "high") for outcome in OUTCOMES}
    accepted = {"low": 0, "normal": 0, "high": 0}
    for tier in ("low", "normal", "high"):
        while (
            response := await rig.client.post("/v1/tasks", json={"input": "x", "priority": tier})
        ).status_code == 202:
            accepted[tier] += 1
        assert response.status_code == 503, response.text
        assert error_of(response)["code"] == "overloaded"
        assert response.headers["retry-after"] == "2"
    assert accepted == {"low": 5, "normal": 3, "high": 2}, "low stops at half the limit, normal at 0.8, high at all"
    counts = {key: tier_submits(*key) - before for key, before in counted.items()}
    assert counts == {("low", "admitted"): 5, ("low", "refused"): 1, ("high", "admitted"): 2, ("high", "refused"): 1}
    other = await rig.client.post("/v1/tasks", json={"input": "x", "model": "echo", "priority": "low"})
    assert other.status_code == 202, "a full queue of one model refuses nothing of another"


OUTCOMES = ("admitted", "refused")


def tier_submits(tier: str, outcome: str) -> float:
    labels = {"model": "sim", "priority": tier, "outcome": outcome}
    return REGISTRY.get_sample_value("batchwire_tier_submits_total", labels) or 0.0


# admission by predicted wait ------------------------------------------------------------------------


async def test_a_high_request_waits_only_behind_its_share_of_a_low_flood() -> None:
    counters = Counters()
    admission = Admission(
        GatewaySettings(models=("a",), default_model="a", max_queue_depth=0), counters, None, clock=counters.clock
    )
    counters.backlogs["a"] = Backlog(100, 0, 0, 0.0)
    for n in range(1, 11):  # a queue of 100 that drains 100/s: a 1 s wait; 9 low admitted for each high
        counters.backlogs["a"] = Backlog(100, 10 * n, n, 0.1 * n)
        await admit_sent(admission, "a", 30_000, Priority.HIGH)
        for _ in range(9):
            await admit_sent(admission, "a", 30_000, Priority.LOW)
    with pytest.raises(Overloaded, match="a 'low' request's answer is predicted"):
        await admit_sent(admission, "a", 500, Priority.LOW)
    await admit_sent(admission, "a", 500, Priority.HIGH, Caller())


async def test_a_low_flood_of_one_key_never_holds_another_keys_high_requests_to_a_share() -> None:
    """A queue of 100 that drains 50/s (2 s of work). Key F floods ``low`` at 100 requests/s; key P
    sends ``high`` at 30/s, less than the drain. A high request waits behind high work only, so P's
    share is counted among the clients sending at its tier or above (P alone): every one of its
    requests is admitted, and F's low flood is what is refused."""
    counters = Counters()
    admission = Admission(GatewaySettings(models=("a",), default_model="a"), counters, None, clock=counters.clock)
    flood, premium = Caller(owner="tenant-flood"), Caller(owner="tenant-premium")
    left = batches = 0
    refused: dict[Priority, list[str]] = {Priority.LOW: [], Priority.HIGH: []}
    for step in range(1, 41):  # 4 s, sampled every 0.1 s as the gateway's sampler does
        left, batches = left + 5, batches + 1
        counters.backlogs = {"a": Backlog(100, left, batches, step / 10)}
        admission.models()
        for tier, caller, sent in ((Priority.LOW, flood, 10), (Priority.HIGH, premium, 3)):
            for _ in range(sent):
                try:
                    await admit_sent(admission, "a", 30_000, tier, caller)
                except Overloaded as err:
                    refused[tier].append(err.message)
    assert not refused[Priority.HIGH], f"{len(refused[Priority.HIGH])} high refused: {refused[Priority.HIGH][0]}"
    assert refused[Priority.LOW], "the low flood is held to what the high requests leave"
    assert "above its fair share" in refused[Priority.LOW][-1], refused[Priority.LOW][-1]


async def test_under_a_flood_of_low_a_high_request_is_admitted_and_answered(make_rig: RigFactory) -> None:
    rig = await make_rig(queue_depth="bus", max_queue_depth=10)
    refused = 0
    for index in range(20):  # nothing leaves the queue yet: low fills its half, then is refused
        response = await rig.client.post("/v1/tasks", json={"input": f"low{index}", "priority": "low"})
        refused += response.status_code == 503
    assert refused == 15
    await rig.worker()
    answer = await rig.client.post("/v1/inference", json={"input": "vip", "priority": "high"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["output"] == "piv"
