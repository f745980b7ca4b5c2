"""A refused connection's request: where it ends, whatever its framing, and what it sent."""

from __future__ import annotations

from gateway.edge.refused_request import RefusedRequest


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


SERVED = frozenset({b"/healthz", b"/metrics"})


def test_a_get_of_a_served_path_keeps_its_head_to_be_served() -> None:
    refused = RefusedRequest(SERVED, keep_bytes=1024)
    head = b"GET /metrics?x=1 HTTP/1.1\r\nhost: gw\r\n\r\n"
    assert not refused.feed(head[:7]) and not refused.serve, "the path is not whole yet"
    assert refused.feed(head[7:])
    assert refused.serve and bytes(refused.kept) == head


def test_other_requests_are_not_served_and_a_head_past_the_bound_is_not_kept() -> None:
    for request in (
        b"POST /healthz HTTP/1.1\r\nhost: gw\r\ncontent-length: 0\r\n\r\n",
        b"GET /healthz/x HTTP/1.1\r\nhost: gw\r\n\r\n",
        b"GET /v1/result/abc HTTP/1.1\r\nhost: gw\r\n\r\n",
    ):
        refused = RefusedRequest(SERVED, keep_bytes=1024)
        assert refused.feed(request) and not refused.serve, request
    large = RefusedRequest(SERVED, keep_bytes=64)
    large.feed(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n")
    large.feed(b"x-pad: " + b"p" * 100 + b"\r\n")
    assert large.feed(b"\r\n") and not large.serve, "a head larger than the bound is refused"
    assert len(large.kept) <= 64 + 110, "and no more is kept"
    unserved = RefusedRequest()
    assert unserved.feed(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n") and not unserved.serve
    assert not unserved.kept and not unserved.head_kept, "nothing is kept without a bound"


def test_a_head_within_the_bound_is_kept_whole_with_what_came_in_its_read() -> None:
    refused = RefusedRequest(SERVED, keep_bytes=1024)
    head = b"POST /v1/inference HTTP/1.1\r\nhost: gw\r\ncontent-length: 9\r\n\r\n"
    assert not refused.feed(head[:20]) and not refused.head_ended
    assert not refused.feed(head[20:] + b"{}")
    assert refused.head_ended and refused.head_kept and not refused.ended
    assert bytes(refused.kept) == head + b"{}", "the body's first bytes came in the head's read"
    refused.feed(b"1234567")
    assert refused.ended and bytes(refused.kept) == head + b"{}", "nothing after the head's read is kept"
    large = RefusedRequest(SERVED, keep_bytes=16)
    large.feed(b"POST /v1/inference HTTP/1.1\r\n")
    large.feed(b"host: gw\r\ncontent-length: 0\r\n\r\n")
    assert large.head_ended and not large.head_kept, "a read past the bound was dropped"


def test_a_head_that_asks_for_100_continue_is_noted_even_split_across_reads() -> None:
    refused = RefusedRequest()
    for piece in (b"POST / HTTP/1.1\r\nhost: gw\r\nExp", b"ect: 100-Con", b"tinue\r\ncontent-length: 5\r\n\r\n"):
        refused.feed(piece)
    assert refused.head_ended and refused.expects_continue and not refused.ended
    plain = RefusedRequest()
    plain.feed(b"POST / HTTP/1.1\r\nhost: gw\r\ncontent-length: 5\r\n\r\n")
    assert plain.head_ended and not plain.expects_continue
