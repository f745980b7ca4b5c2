"""A refused connection's request: where it ends, whatever its framing, and what it sent."""

from __future__ import annotations

from gateway.refused_request import RefusedRequest


def test_a_request_with_a_length_ends_with_its_body() -> None:
    refused = RefusedRequest()
    head = b"POST /v1/inference HTTP/1.1\r\nhost: gw\r\ncontent-length: 15\r\n\r\n"
    assert not refused.feed(head)
    assert not refused.feed(b'{"input":')
    assert refused.feed(b'"abc"}'), "the body's last byte ends it"
    assert refused.read == len(head) + 15


def test_a_chunked_request_ends_with_its_last_chunk() -> None:
    refused = RefusedRequest()
    assert not refused.feed(b"POST / HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
    assert refused.feed(b"0\r\n\r\n")


def test_a_request_without_a_body_ends_with_its_head_and_what_is_not_http_ends_at_once() -> None:
    assert RefusedRequest().feed(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n")
    garbage = RefusedRequest()
    assert garbage.feed(b"\x16\x03\x01 not http at all\r\n\r\n"), "a TLS hello or noise is answered all the same"
    assert garbage.feed(b"more"), "and stays ended"
    assert garbage.read == len(b"\x16\x03\x01 not http at all\r\n\r\n") + 4
