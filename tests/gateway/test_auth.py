"""API keys: Bearer on every route but the probes and the docs, tasks visible only to their key, keys never kept."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.edge.auth import ApiKeys, KeyHolder, LoadedKeys, digest_of, load_api_keys, owner_of
from gateway.settings import GatewaySettings
from schemas.records import TaskStatus
from schemas.wire import Names
from tests.support.gateway_rig import RigFactory, error_of
from transport.redis.store import RedisTaskStore

pytestmark = pytest.mark.timeout(60)

KEY_A = "alpha-key-0123456789"
KEY_B = "bravo-key-9876543210"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_without_a_key_every_api_route_is_401(make_rig: RigFactory) -> None:
    rig = await make_rig(api_keys=(digest_of(KEY_A),))
    calls = [
        ("POST", "/v1/inference"),
        ("POST", "/v1/tasks"),
        ("GET", "/v1/result/AnyTask"),
        ("GET", "/v1/result/AnyTask/events"),
        ("DELETE", "/v1/result/AnyTask"),
        ("GET", "/metrics"),
        ("GET", "/no/such/route"),
    ]
    for method, path in calls:
        response = await rig.client.request(method, path, json={"input": "x"} if method == "POST" else None)
        assert response.status_code == 401, f"{method} {path}: {response.status_code} {response.text}"
        assert error_of(response)["code"] == "unauthorized"
        assert response.headers["www-authenticate"] == 'Bearer realm="batchwire"'
    assert rig.produced() == 0
    assert rig.store.created == []


async def test_a_wrong_key_is_401_invalid_token(make_rig: RigFactory) -> None:
    rig = await make_rig(api_keys=(digest_of(KEY_A),))
    for header in (f"Bearer {KEY_B}", f"Basic {KEY_A}", "Bearer ", KEY_A):
        response = await rig.client.post("/v1/tasks", json={"input": "x"}, headers={"Authorization": header})
        assert response.status_code == 401, header
        assert 'error="invalid_token"' in response.headers["www-authenticate"]
        assert KEY_A not in response.text and KEY_B not in response.text
    assert rig.store.created == []


async def test_two_authorization_headers_are_refused_whichever_comes_first(make_rig: RigFactory) -> None:
    """The header is a singleton (RFC 9110): with two, which key speaks would depend on their order, which
    a proxy that appends its own rather than replacing the client's leaves to the client."""
    rig = await make_rig(api_keys=(digest_of(KEY_A), digest_of(KEY_B)))
    task_id = (await rig.client.post("/v1/tasks", json={"input": "a's"}, headers=bearer(KEY_A))).json()["task_id"]
    for first, second in ((KEY_B, KEY_A), (KEY_A, KEY_B), (KEY_A, KEY_A)):
        headers = [("authorization", f"Bearer {first}"), ("authorization", f"Bearer {second}")]
        for method, path in (("POST", "/v1/tasks"), ("GET", f"/v1/result/{task_id}")):
            body = {"input": "x"} if method == "POST" else None
            response = await rig.client.request(method, path, json=body, headers=headers)
            assert response.status_code == 401, f"{method} {path}: {response.status_code} {response.text}"
            error = error_of(response)
            assert error["code"] == "unauthorized" and "one Authorization header" in error["message"], error
            assert response.headers["www-authenticate"] == 'Bearer realm="batchwire"'
            assert KEY_A not in response.text and KEY_B not in response.text
    assert len(rig.store.created) == 1, "nothing but key A's own task was created"


async def test_probes_and_docs_stay_open(make_rig: RigFactory) -> None:
    rig = await make_rig(api_keys=(digest_of(KEY_A),))
    for path in ("/healthz", "/readyz", "/openapi.json", "/docs"):
        response = await rig.client.get(path)
        assert response.status_code == 200, f"{path}: {response.status_code}"
    spec = (await rig.client.get("/openapi.json")).json()
    assert spec["components"]["securitySchemes"]["apiKey"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "An API key (BATCHWIRE_API_KEYS).",
    }
    assert spec["paths"]["/v1/inference"]["post"]["security"] == [{"apiKey": []}]
    assert "401" in spec["paths"]["/v1/result/{task_id}"]["delete"]["responses"]
    assert "security" not in spec["paths"]["/healthz"]["get"]


async def test_the_right_key_works(make_rig: RigFactory) -> None:
    rig = await make_rig(api_keys=(digest_of(KEY_A),))
    await rig.worker()
    answer = await rig.client.post("/v1/inference", json={"input": "key"}, headers=bearer(KEY_A))
    assert answer.status_code == 200, answer.text
    assert answer.json()["output"] == "yek"
    assert rig.store.created[0].owner == owner_of(digest_of(KEY_A))
    assert rig.workers[0].seen[0].owner == owner_of(digest_of(KEY_A)), "the request carries its owner"


async def test_metrics_need_an_operator_key_and_a_tenant_key_gets_403(make_rig: RigFactory) -> None:
    operator = digest_of(KEY_B)
    rig = await make_rig(api_keys=(digest_of(KEY_A), operator), operator_keys=(operator,))
    await rig.worker()
    refused = await rig.client.get("/metrics", headers=bearer(KEY_A))
    assert refused.status_code == 403, refused.text
    error = error_of(refused)
    assert error["code"] == "forbidden"
    assert "operator key" in error["message"] and "BATCHWIRE_API_KEYS_FILE" in error["message"], error
    assert "batchwire_" not in refused.text
    slashes = await rig.client.get("/metrics" + "/" * 20_000, headers=bearer(KEY_A))
    assert slashes.status_code == 403 and len(slashes.content) < 1_000, len(slashes.content)
    scraped = await rig.client.get("/metrics", headers=bearer(KEY_B))
    assert scraped.status_code == 200, scraped.text
    assert "batchwire_requests_total" in scraped.text
    answer = await rig.client.post("/v1/inference", json={"input": "op"}, headers=bearer(KEY_B))
    assert answer.status_code == 200, "an operator key is also a key for the API"
    assert (await rig.client.post("/v1/tasks", json={"input": "t"}, headers=bearer(KEY_A))).status_code == 202
    spec = (await rig.client.get("/openapi.json")).json()
    assert "403" in spec["paths"]["/metrics"]["get"]["responses"], "the 403 is documented"


async def test_without_api_keys_metrics_stay_open(make_rig: RigFactory) -> None:
    rig = await make_rig()
    assert (await rig.client.get("/metrics")).status_code == 200
    spec = (await rig.client.get("/openapi.json")).json()
    assert "403" not in spec["paths"]["/metrics"]["get"]["responses"]


async def test_a_task_is_visible_only_to_the_key_that_created_it(make_rig: RigFactory) -> None:
    rig = await make_rig(api_keys=(digest_of(KEY_A), digest_of(KEY_B)))
    task_id = (await rig.client.post("/v1/tasks", json={"input": "mine"}, headers=bearer(KEY_A))).json()["task_id"]

    for method, path in (
        ("GET", f"/v1/result/{task_id}"),
        ("GET", f"/v1/result/{task_id}?wait=0.1"),
        ("GET", f"/v1/result/{task_id}/events"),
        ("DELETE", f"/v1/result/{task_id}"),
    ):
        other = await rig.client.request(method, path, headers=bearer(KEY_B))
        unknown = await rig.client.request(method, path.replace(task_id, "NoSuchTask"), headers=bearer(KEY_B))
        assert other.status_code == 404, f"{method} {path}: {other.text}"
        assert error_of(other)["code"] == "task_not_found"
        assert error_of(other)["message"].replace(task_id, "X") == error_of(unknown)["message"].replace(
            "NoSuchTask", "X"
        ), "another key's task must look exactly like a missing one"
    assert (await rig.client.get(f"/v1/result/{task_id}", headers=bearer(KEY_A))).json()["status"] == "queued"
    assert (await rig.client.delete(f"/v1/result/{task_id}", headers=bearer(KEY_A))).status_code == 200


async def test_idempotency_keys_belong_to_their_api_key(make_rig: RigFactory) -> None:
    rig = await make_rig(api_keys=(digest_of(KEY_A), digest_of(KEY_B)))
    headers_a = {**bearer(KEY_A), "Idempotency-Key": "same"}
    headers_b = {**bearer(KEY_B), "Idempotency-Key": "same"}
    first = await rig.client.post("/v1/tasks", json={"input": "x"}, headers=headers_a)
    other = await rig.client.post("/v1/tasks", json={"input": "y"}, headers=headers_b)
    assert first.status_code == other.status_code == 202
    assert first.json()["task_id"] != other.json()["task_id"], "one key's retry must not see another key's task"


async def test_keys_never_reach_the_logs(make_rig: RigFactory, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    rig = await make_rig(api_keys=(digest_of(KEY_A),))
    await rig.client.post("/v1/tasks", json={"input": "x"}, headers=bearer(KEY_A))
    await rig.client.post("/v1/tasks", json={"input": "x"}, headers=bearer(KEY_B))
    assert KEY_A not in caplog.text and KEY_B not in caplog.text
    assert KEY_A not in repr(rig.settings), "settings hold digests only"


def test_load_api_keys_hashes_text_and_takes_digests(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"from-a-digest-entry-1234").hexdigest()
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# one key a line\n{KEY_B}\n\nsha256:{digest.upper()}\n")

    loaded = load_api_keys(f" {KEY_A} ,", str(keys_file))

    assert loaded.digests == (digest_of(KEY_A), digest_of(KEY_B), digest)
    assert loaded.operators == ()
    assert load_api_keys(None, None) == LoadedKeys((), ())
    assert load_api_keys(f"{KEY_A},{KEY_A}", None).digests == (digest_of(KEY_A),), "duplicates collapse"


def test_operator_entries_mark_operator_keys(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"an-operator-digest-0123").hexdigest()
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{KEY_A}\noperator {KEY_B}\n  operator   sha256:{digest}  \n")

    loaded = load_api_keys(None, str(keys_file))

    assert loaded.digests == (digest_of(KEY_A), digest_of(KEY_B), digest), "an operator key is a key too"
    assert loaded.operators == (digest_of(KEY_B), digest)
    assert load_api_keys(f"operator {KEY_A}", None).operators == (digest_of(KEY_A),), "the variable takes them too"


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ("short", "entry 1 of BATCHWIRE_API_KEYS: an API key must have at least 16 characters"),
        (f"{KEY_A},sha256:abc", "entry 2 of BATCHWIRE_API_KEYS: after 'sha256:' come the 64 hex digits"),
        (f"{KEY_A},admin {KEY_B}", "entry 2 of BATCHWIRE_API_KEYS: an entry is one key"),
        ("operator short", "entry 1 of BATCHWIRE_API_KEYS: an API key must have at least 16 characters"),
        (f"{KEY_A},{KEY_B}é", "entry 2 of BATCHWIRE_API_KEYS: an API key is printable ASCII"),
    ],
)
def test_load_api_keys_refuses_naming_the_entry_not_the_key(keys: str, message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")) as failure:
        load_api_keys(keys, None)
    assert keys.split(",")[-1] not in str(failure.value), "the message must not echo the entry"


def test_a_missing_keys_file_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="BATCHWIRE_API_KEYS_FILE"):
        load_api_keys(None, str(tmp_path / "absent"))


def test_a_keys_file_that_is_not_text_names_the_variable_and_the_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.bin"
    keys_file.write_bytes(b"\xff\xfe" + KEY_A.encode())
    with pytest.raises(ValueError, match=f"BATCHWIRE_API_KEYS_FILE {keys_file} is not UTF-8 text"):
        load_api_keys(None, str(keys_file))


@pytest.mark.parametrize("text", ["", "# keys come here\n\n"])
def test_a_keys_file_that_holds_no_key_is_refused_rather_than_leaving_the_gateway_open(
    tmp_path: Path, text: str
) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(text)
    with pytest.raises(ValueError, match=f"BATCHWIRE_API_KEYS_FILE {keys_file} holds no API key"):
        load_api_keys(None, str(keys_file))
    with pytest.raises(ValueError, match="BATCHWIRE_API_KEYS holds no API key"):
        load_api_keys(" , ", None)
    assert load_api_keys(KEY_A, str(keys_file)).digests == (digest_of(KEY_A),), "the other source has one"


def test_settings_take_digests_only_and_do_not_echo_the_value() -> None:
    with pytest.raises(ValueError, match="BATCHWIRE_API_KEYS") as failure:
        GatewaySettings(api_keys=(KEY_A,))
    assert KEY_A not in str(failure.value)


def test_api_keys_compare_every_digest() -> None:
    keys = ApiKeys((digest_of(KEY_A), digest_of(KEY_B)), operators=(digest_of(KEY_B),))
    assert keys.holder(f"Bearer {KEY_B}") == KeyHolder(owner_of(digest_of(KEY_B)), operator=True)
    assert keys.holder(f"bearer {KEY_A}") == KeyHolder(owner_of(digest_of(KEY_A)), operator=False), (
        "the scheme is case-insensitive"
    )
    assert keys.holder("Bearer nope-nope-nope-nope") is None
    assert keys.holder(None) is None
    assert len(owner_of(digest_of(KEY_A))) == 16


def test_operator_keys_must_be_accepted_keys() -> None:
    with pytest.raises(ValueError, match="operator"):
        ApiKeys((digest_of(KEY_A),), operators=(digest_of(KEY_B),))
    with pytest.raises(ValueError, match="operator_keys"):
        GatewaySettings(api_keys=(digest_of(KEY_A),), operator_keys=(digest_of(KEY_B),))


# over the real Redis ------------------------------------------------------------------------------


@pytest.fixture
async def redis_store(request: pytest.FixtureRequest, names: Names) -> AsyncIterator[RedisTaskStore]:
    store = RedisTaskStore(request.getfixturevalue("infra").redis_url, names)
    await store.start()
    yield store
    await store.close()


@pytest.mark.kafka
async def test_ownership_survives_the_workers_updates_in_redis(
    make_rig: RigFactory, redis_store: RedisTaskStore
) -> None:
    """Batcher and workers write states that do not carry the owner; the owner still sees the result."""
    rig = await make_rig(store=redis_store, api_keys=(digest_of(KEY_A), digest_of(KEY_B)))
    await rig.worker(progress=True)  # writes batched, running and completed without an owner
    task_id = (await rig.client.post("/v1/tasks", json={"input": "owned"}, headers=bearer(KEY_A))).json()["task_id"]

    done = await rig.client.get(f"/v1/result/{task_id}", params={"wait": 10}, headers=bearer(KEY_A))
    assert done.status_code == 200, done.text
    assert (done.json()["status"], done.json()["output"]) == ("completed", "denwo")
    stored = await redis_store.get(task_id)
    assert stored is not None
    assert (stored.status, stored.owner) == (TaskStatus.COMPLETED, owner_of(digest_of(KEY_A)))
    assert (await rig.client.get(f"/v1/result/{task_id}", headers=bearer(KEY_B))).status_code == 404


@pytest.mark.parametrize(
    "second",
    [f"operator {KEY_A}", f"{KEY_A} priority=low", f"sha256:{digest_of(KEY_A)} ceiling=normal"],
    ids=["operator", "tier", "digest"],
)
def test_a_key_listed_twice_with_other_options_is_refused_naming_both_entries(tmp_path: Path, second: str) -> None:
    """Which entry would win is a guess an operator should not have to make: the load names both."""
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{KEY_B}\n{second}\n")
    expected = f"^line 2 of {keys_file}: the same key as entry 1 of BATCHWIRE_API_KEYS"
    with pytest.raises(ValueError, match=expected) as failure:
        load_api_keys(KEY_A, str(keys_file))
    assert KEY_A not in str(failure.value), "an error never shows the key"
    same = load_api_keys(f"{KEY_A} priority=low,sha256:{digest_of(KEY_A)} priority=low", None)
    assert same.digests == (digest_of(KEY_A),), "a key listed twice alike is one key"
