"""Every malformed submission gets its own code, and nothing of it reaches the bus or the store."""

from __future__ import annotations

import contextlib
import gzip
import json
import time
from collections.abc import AsyncIterator, Callable

import pytest

from gateway.edge.body import parse_inference_body
from gateway.errors import InvalidJson, ValidationFailed
from tests.support.eventually import eventually
from tests.support.gateway_rig import RigFactory, error_of

PATHS = ["/v1/inference", "/v1/tasks"]
JSON = {"content-type": "application/json"}

CASES: list[tuple[str, bytes, int, str, str]] = [
    # (case, body, status, code, a word the message must contain)
    ("malformed json", b'{"input": ', 400, "invalid_json", "JSON"),
    ("empty body", b"", 400, "invalid_json", "JSON"),
    ("trailing garbage", b'{"input": "x"} x', 400, "invalid_json", "JSON"),
    ("lone surrogate escape", b'{"input": "\\ud800"}', 400, "invalid_json", "JSON"),
    ("invalid utf-8", b'{"input": "\xff\xfe"}', 400, "invalid_utf8", "UTF-8"),
    # a byte order mark is invisible where the caller looks (a Windows editor's UTF-8 file, sent with
    # curl -d @file): "expected value at line 1 column 1" of a body that starts with `{` says nothing
    ("byte order mark", b'\xef\xbb\xbf{"input": "x"}', 400, "invalid_json", "byte order mark (U+FEFF)"),
    ("input is a number", b'{"input": 5}', 422, "validation_error", "input"),
    ("input is null", b'{"input": null}', 422, "validation_error", "input"),
    ("input missing", b'{"model": "sim"}', 422, "validation_error", "input"),
    ("timeout as string", b'{"input": "x", "timeout_ms": "100"}', 422, "validation_error", "timeout_ms"),
    ("timeout with fraction", b'{"input": "x", "timeout_ms": 1.5}', 422, "validation_error", "timeout_ms"),
    ("timeout as bool", b'{"input": "x", "timeout_ms": true}', 422, "validation_error", "timeout_ms"),
    ("model is a list", b'{"input": "x", "model": ["sim"]}', 422, "validation_error", "model"),
    ("unknown field", b'{"input": "x", "timeout": 5}', 422, "validation_error", "timeout"),
    ("not an object", b'["x"]', 422, "validation_error", "object"),
    ("empty input", b'{"input": ""}', 422, "empty_input", "empty"),
    ("unknown model", b'{"input": "x", "model": "gpt-9"}', 404, "unknown_model", "sim, echo"),
    ("timeout zero", b'{"input": "x", "timeout_ms": 0}', 422, "timeout_out_of_range", "timeout_ms"),
    (
        "timeout too long",
        b'{"input": "x", "timeout_ms": 30001}',
        422,
        "timeout_out_of_range",
        "BATCHWIRE_MAX_TIMEOUT_MS",
    ),
    (
        "timeout huge",
        b'{"input": "x", "timeout_ms": 99999999999999999999999}',
        422,
        "timeout_out_of_range",
        "timeout_ms",
    ),
    (
        "input too long",
        json.dumps({"input": "y" * 70_000}).encode(),
        413,
        "input_too_large",
        "input is 70000 characters; the limit is 65536 (BATCHWIRE_MAX_INPUT_CHARS)",
    ),
    (
        "body too large",
        json.dumps({"input": "z" * 1_100_000}).encode(),
        413,
        "body_too_large",
        "BATCHWIRE_MAX_BODY_BYTES",
    ),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("case", "body", "status", "code", "hint"), CASES, ids=[c[0] for c in CASES])
async def test_bad_body_is_refused_and_nothing_is_produced(
    make_rig: RigFactory, path: str, case: str, body: bytes, status: int, code: str, hint: str
) -> None:
    rig = await make_rig()
    response = await rig.client.post(path, content=body, headers=JSON)
    assert response.status_code == status, f"{case}: expected {status}, got {response.status_code}: {response.text}"
    error = error_of(response)
    assert error["code"] == code, f"{case}: {error}"
    assert hint in error["message"], f"{case}: the message should mention {hint!r}: {error['message']!r}"
    assert rig.produced() == 0, f"{case}: a refused request was produced to the bus"
    assert rig.store.created == [], f"{case}: a refused request was stored"


@pytest.mark.parametrize("path", PATHS)
async def test_streamed_body_over_the_limit_is_413_without_content_length(make_rig: RigFactory, path: str) -> None:
    rig = await make_rig(max_body_bytes=1000)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"input": "'
        for _ in range(20):
            yield b"x" * 100
        yield b'"}'

    response = await rig.client.post(path, content=chunks(), headers=JSON)
    assert "content-length" not in response.request.headers, "the test must exercise the streamed check"
    assert response.status_code == 413, response.text
    assert error_of(response)["code"] == "body_too_large"
    assert rig.produced() == 0
    assert rig.store.created == []


async def test_declared_length_over_the_limit_is_413_before_reading(make_rig: RigFactory) -> None:
    rig = await make_rig(max_body_bytes=1000)
    response = await rig.client.post(
        "/v1/inference", content=b'{"input": "x"}', headers={**JSON, "content-length": "5000"}
    )
    assert response.status_code == 413, response.text
    assert error_of(response)["code"] == "body_too_large"
    assert "5000" in error_of(response)["message"]
    assert rig.produced() == 0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "content_type",
    [
        "application/x-www-form-urlencoded",  # curl -d, and an HTML form from any web page
        "text/plain",  # fetch() from any web page without a CORS preflight
        "multipart/form-data; boundary=x",
        None,  # fetch() of a Blob: no Content-Type, and no preflight either
        "application/jsonx",
        "text/json",
    ],
)
async def test_a_body_not_declared_json_is_415_and_nothing_is_queued(
    make_rig: RigFactory, path: str, content_type: str | None
) -> None:
    rig = await make_rig()
    headers = {} if content_type is None else {"content-type": content_type}
    response = await rig.client.post(path, content=b'{"input": "cross-site"}', headers=headers)
    assert response.status_code == 415, f"{content_type!r}: {response.status_code} {response.text}"
    error = error_of(response)
    assert error["code"] == "unsupported_media_type"
    assert "application/json" in error["message"], error
    assert rig.produced() == 0
    assert rig.store.created == []


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON ; charset=UTF-8",
        "application/vnd.x+json",
    ],
)
async def test_json_content_types_are_accepted(make_rig: RigFactory, content_type: str) -> None:
    rig = await make_rig()
    await rig.worker()
    response = await rig.client.post(
        "/v1/inference", content=b'{"input": "json"}', headers={"content-type": content_type}
    )
    assert response.status_code == 200, f"{content_type!r}: {response.text}"
    assert response.json()["output"] == "nosj"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate, gzip"])
async def test_a_compressed_body_is_415_naming_the_encoding_and_nothing_is_queued(
    make_rig: RigFactory, path: str, encoding: str
) -> None:
    """Bodies are read as sent: a gzip body read as JSON was refused as "not valid UTF-8", which says
    nothing of what to change (RFC 9110: 415 for a content coding the server does not take)."""
    rig = await make_rig()
    body = gzip.compress(b'{"input": "zipped"}') if encoding == "gzip" else b'{"input": "zipped"}'
    response = await rig.client.post(path, content=body, headers={**JSON, "content-encoding": encoding})
    assert response.status_code == 415, f"{encoding!r}: {response.status_code} {response.text}"
    error = error_of(response)
    assert error["code"] == "unsupported_media_type", error
    assert repr(encoding) in error["message"] and "uncompressed" in error["message"], error
    assert rig.produced() == 0
    assert rig.store.created == []


async def test_a_coding_behind_an_identity_content_encoding_header_is_415(make_rig: RigFactory) -> None:
    """Each Content-Encoding header names a coding applied in turn: one of them enough to refuse the body."""
    rig = await make_rig()
    headers = [("content-type", "application/json"), ("content-encoding", "identity"), ("content-encoding", "gzip")]
    response = await rig.client.post("/v1/tasks", content=gzip.compress(b'{"input": "zipped"}'), headers=headers)
    assert response.status_code == 415, response.text
    assert "'identity, gzip'" in error_of(response)["message"], response.text
    assert rig.produced() == 0


async def test_an_identity_content_encoding_is_read_as_it_is(make_rig: RigFactory) -> None:
    rig = await make_rig()
    await rig.worker()
    response = await rig.client.post(
        "/v1/inference", content=b'{"input": "plain"}', headers={**JSON, "content-encoding": "Identity"}
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "body",
    [
        {"input": "x", **{f"k{n}": 1 for n in range(20_000)}},  # a 300 KB body of unknown fields
        {"input": "x", "k" * 200_000: 1},  # one unknown field with a long name
    ],
    ids=["many unknown fields", "a long unknown field"],
)
async def test_a_refusal_of_unknown_fields_does_not_grow_with_them(make_rig: RigFactory, body: dict[str, int]) -> None:
    """An answer never grows with what a client sent: a body of many unknown fields was answered with a
    sentence per field, several times the body's own size."""
    rig = await make_rig()
    response = await rig.client.post("/v1/tasks", json=body)
    assert response.status_code == 422, response.text[:300]
    error = error_of(response)
    assert error["code"] == "validation_error", error
    assert len(response.content) < 1_000, f"a {len(response.content)}-byte answer: {response.text[:300]}"
    assert "is unknown; the fields are input, model, timeout_ms, priority" in error["message"], error
    if len(body) > 2:
        assert "and 19995 more" in error["message"], error
    assert rig.store.created == []


@pytest.mark.parametrize(
    "text",
    [b"\\ud800", b"a\\ud83db", b"\\udc00", b"\\ud800\\u0041"],
    ids=["high", "high mid-text", "low", "high, then a letter"],
)
def test_a_lone_surrogate_escape_is_refused_saying_so_and_what_to_send(text: bytes) -> None:
    """JSON's grammar takes ``"\\ud800"``, and JavaScript's JSON.stringify writes one for a string cut in
    the middle of an emoji; the parser's "unexpected end of hex escape" read as a truncated escape."""
    with pytest.raises(InvalidJson) as refused:
        parse_inference_body(b'{"input": "' + text + b'"}')
    message = str(refused.value)
    assert "lone UTF-16 surrogate" in message and "send valid Unicode text" in message, message
    assert "line 1 column" in message, message


def test_a_body_of_many_unknown_fields_costs_its_refusal_about_what_reading_it_costs() -> None:
    """The parse runs on the event loop: a 1 MiB body of 100,000 unknown fields was refused after reading
    each of pydantic's 100,000 errors, a second of the loop's CPU against a twentieth for the JSON itself,
    so two clients sending such bodies held every other caller's answer for seconds."""
    body = ("{" + ",".join(f'"{n:x}":0' for n in range(100_000)) + ',"input":"x"}').encode()

    def cpu_s(run: Callable[[], object]) -> float:
        took = []
        for _ in range(3):
            began = time.process_time()
            with contextlib.suppress(ValidationFailed):
                run()
            took.append(time.process_time() - began)
        return min(took)

    parse_s = cpu_s(lambda: json.loads(body))
    refuse_s = cpu_s(lambda: parse_inference_body(body))
    with pytest.raises(ValidationFailed, match="and 99995 more"):
        parse_inference_body(body)
    assert refuse_s < 4 * parse_s, f"the refusal took {refuse_s:.3f} s of CPU; parsing the body takes {parse_s:.3f} s"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sent", [b"9" * 4_000, b"-" + b"9" * 4_000, b"1e300"], ids=["digits", "negative", "float"])
async def test_a_timeout_out_of_range_is_quoted_by_its_start_and_length(
    make_rig: RigFactory, path: str, sent: bytes
) -> None:
    """As any value a refusal quotes (an answer never grows with what a client sent): a timeout_ms of
    thousands of digits, or 1e300 (301 digits as an integer), was quoted whole."""
    rig = await make_rig()
    response = await rig.client.post(path, content=b'{"input": "x", "timeout_ms": ' + sent + b"}", headers=JSON)
    assert response.status_code == 422, response.text[:300]
    error = error_of(response)
    assert error["code"] == "timeout_out_of_range", error
    assert len(error["message"]) < 300, f"a {len(error['message'])}-character message: {error['message'][:300]}"
    assert "characters)" in error["message"] and "BATCHWIRE_MAX_TIMEOUT_MS" in error["message"], error
    assert rig.produced() == 0 and rig.store.created == []


async def test_the_media_type_is_checked_before_the_body_size(make_rig: RigFactory) -> None:
    rig = await make_rig(max_body_bytes=1000)
    response = await rig.client.post("/v1/tasks", content=b"x" * 5000, headers={"content-type": "text/plain"})
    assert response.status_code == 415, response.text


async def test_non_ascii_input_round_trips(make_rig: RigFactory) -> None:
    rig = await make_rig()
    await rig.worker()
    response = await rig.client.post("/v1/inference", json={"input": "héllo wörld ✓ 日本"})
    assert response.status_code == 200, response.text
    assert response.json()["output"] == "本日 ✓ dlröw olléh"


@pytest.mark.parametrize("path", PATHS)
async def test_an_integral_float_timeout_is_an_integer(make_rig: RigFactory, path: str) -> None:
    """JSON Schema's ``integer`` admits 17069.0, so generated clients send it; 17069.5 stays an error."""
    rig = await make_rig()
    worker = await rig.worker()
    response = await rig.client.post(path, json={"input": "abc", "timeout_ms": 17069.0})
    assert response.status_code in (200, 202), response.text
    await eventually(lambda: len(worker.seen) == 1, "the request to reach the worker")
    request = worker.seen[0]
    # The records carry what is left of the timeout when the request is sent: a loaded machine spends
    # a few milliseconds of it before then.
    assert 17069 - 1000 < request.deadline_ms - request.enqueued_at_ms <= 17069
    fraction = await rig.client.post(path, json={"input": "abc", "timeout_ms": 17069.5})
    assert fraction.status_code == 422
    assert error_of(fraction)["code"] == "validation_error"
    huge = await rig.client.post(path, json={"input": "abc", "timeout_ms": 1e300})
    assert huge.status_code == 422
    assert error_of(huge)["code"] == "timeout_out_of_range"
    assert rig.produced() == 1, "only the valid request was produced"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("text", "fits"), [("x" * 300_000, True), ("x" * 1_100_000, False), ("日" * 400_000, False)])
async def test_an_input_longer_than_a_batch_carries_is_413_naming_bytes(
    make_rig: RigFactory, path: str, text: str, fits: bool
) -> None:
    """A batch is one record on the bus (1 MiB): under a --max-input-chars raised past it, an input that
    alone would make a batch over it is refused as too long, in bytes; a batcher would otherwise send that
    batch again and again, refused each time, until its deadline."""
    rig = await make_rig(max_input_chars=2_000_000, max_body_bytes=8_000_000)
    response = await rig.client.post(path, json={"input": text, "timeout_ms": 100})
    if fits:
        assert response.status_code != 413, response.text
        return
    assert response.status_code == 413, response.text
    error = error_of(response)
    assert error["code"] == "input_too_large" and "bytes" in error["message"], error
    assert rig.produced() == 0 and rig.store.created == [], "a refused request was queued"
