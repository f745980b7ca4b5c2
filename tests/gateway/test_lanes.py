"""HEAD on every GET route (answered by ``GatewayApp``), and paths with a trailing slash (404, never a
redirect built from the Host header)."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.gateway_rig import RigFactory, error_of, serving


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics", "/openapi.json", "/docs"])
async def test_head_of_a_get_route_answers_as_get_without_a_body(make_rig: RigFactory, path: str) -> None:
    rig = await make_rig()
    got = await rig.client.get(path)
    head = await rig.client.head(path)
    assert head.status_code == got.status_code == 200, f"HEAD {path}: {head.status_code}"
    assert head.headers["content-type"] == got.headers["content-type"]
    assert head.content == b"", f"HEAD {path} sent a body"


async def test_head_of_a_task_answers_its_status_code(make_rig: RigFactory) -> None:
    rig = await make_rig()
    task_id = (await rig.client.post("/v1/tasks", json={"input": "head"})).json()["task_id"]
    found = await rig.client.head(f"/v1/result/{task_id}")
    missing = await rig.client.head("/v1/result/NoSuchTaskAtAll00000000")
    assert (found.status_code, found.content) == (200, b"")
    assert (missing.status_code, missing.content) == (404, b"")


async def test_head_of_an_event_stream_ends_at_once_and_frees_the_watcher(make_rig: RigFactory) -> None:
    rig = await make_rig()  # no worker: the task stays queued and its stream would run on
    async with serving(rig) as client:
        task_id = (await client.post("/v1/tasks", json={"input": "stream"})).json()["task_id"]
        head = await asyncio.wait_for(client.head(f"/v1/result/{task_id}/events"), 5)
        assert head.status_code == 200
        assert head.headers["content-type"].startswith("text/event-stream")
        assert head.content == b""
        healthz = await client.get("/healthz")  # the same connection still serves
        assert healthz.status_code == 200
    assert rig.gateway.watchers == 0


async def test_head_of_a_post_route_is_405_naming_the_methods(make_rig: RigFactory) -> None:
    rig = await make_rig()
    response = await rig.client.head("/v1/inference")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"


async def test_the_allow_header_of_a_get_route_names_head(make_rig: RigFactory) -> None:
    rig = await make_rig()
    response = await rig.client.post("/healthz", json={})
    assert response.status_code == 405
    assert response.headers["allow"] == "GET, HEAD"


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/inference/"), ("POST", "/v1/tasks/"), ("GET", "/healthz/"), ("GET", "/v1/result/SomeTask/")],
)
async def test_a_trailing_slash_is_404_and_never_a_redirect(make_rig: RigFactory, method: str, path: str) -> None:
    rig = await make_rig()
    response = await rig.client.request(
        method, path, json={"input": "x"} if method == "POST" else None, headers={"host": "evil.example"}
    )
    assert response.status_code == 404, f"{method} {path}: {response.status_code} {response.headers}"
    assert "location" not in response.headers
    assert error_of(response)["code"] == "not_found"
    assert "evil.example" not in response.text
    assert rig.produced() == 0
