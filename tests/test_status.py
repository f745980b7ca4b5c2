"""``batchwire status`` against a gateway it cannot read: exit 2 and a line that says why, never a traceback."""

from __future__ import annotations

import argparse
import http.client
import io
import json
import urllib.error
import urllib.request
from email.message import Message

import pytest

from batchwire.cli import main
from batchwire.status import EXIT_UNREACHABLE, EXIT_UNSERVED, run


@pytest.mark.parametrize("url", ["gateway", "", "http://[::1"])
def test_a_url_that_names_no_gateway_exits_2_saying_so(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = run(argparse.Namespace(url=url, api_key=None, json=False, watch=None))
    out, err = capsys.readouterr()
    assert (code, out) == (EXIT_UNREACHABLE, ""), (code, out, err)
    assert err.startswith(f"batchwire status: cannot read the fleet from {url}"), err


@pytest.mark.parametrize("body", [b"[]", b"{}", b'{"members": [], "models": []}'])
def test_an_answer_that_is_not_the_fleet_exits_2_saying_so(
    body: bytes, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Something else listening where the gateway was expected, answering 200 with other JSON."""
    monkeypatch.setattr(urllib.request, "urlopen", lambda request, timeout: io.BytesIO(body))
    code = run(argparse.Namespace(url="http://127.0.0.1:1", api_key=None, json=False, watch=None))
    out, err = capsys.readouterr()
    assert (code, out) == (EXIT_UNREACHABLE, ""), (code, out, err)
    assert "not the fleet's document" in err, err


class _CutShort(io.BytesIO):
    """A gateway that closed the connection part-way through its answer's body."""

    def read(self, size: int | None = -1) -> bytes:
        raise http.client.IncompleteRead(b'{"members', 90)


def test_an_answer_cut_short_exits_2_saying_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(urllib.request, "urlopen", lambda request, timeout: _CutShort())
    code = run(argparse.Namespace(url="http://127.0.0.1:1", api_key=None, json=False, watch=None))
    out, err = capsys.readouterr()
    assert (code, out) == (EXIT_UNREACHABLE, ""), (code, out, err)
    assert err.startswith("batchwire status: cannot read the fleet from http://127.0.0.1:1"), err


def test_a_gateway_whose_store_is_down_exits_1_with_its_readiness(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fleet lives in the store: with the store down the gateway answers, 503, and is not ready, which
    is exit 1 (unserved), not 2 (no gateway there), and /readyz's reason is printed."""

    def answer_503(request: urllib.request.Request | str, timeout: float) -> io.BytesIO:
        url = request if isinstance(request, str) else request.full_url
        body: dict[str, object]
        if url.endswith("/v1/fleet"):
            error = {"code": "unavailable", "message": "the fleet's heartbeats cannot be read from the store now"}
            body = {"error": error}
        else:
            error = {
                "code": "not_ready",
                "message": "not ready: redis (down: Redis at redis://r:6379/0 does not answer)",
            }
            body = {"error": error, "checks": {"redis": False}, "models": {}}
        raise urllib.error.HTTPError(url, 503, "Service Unavailable", Message(), io.BytesIO(json.dumps(body).encode()))

    monkeypatch.setattr(urllib.request, "urlopen", answer_503)
    code = run(argparse.Namespace(url="http://127.0.0.1:1", api_key=None, json=False, watch=None))
    out, err = capsys.readouterr()
    assert (code, out) == (EXIT_UNSERVED, ""), (code, out, err)
    assert "answered 503" in err and "redis (down: Redis at redis://r:6379/0 does not answer)" in err, err


@pytest.mark.parametrize("seconds", ["inf", "1e12", "nan", "0"])
def test_a_watch_period_that_is_no_period_exits_2_naming_the_flag(
    seconds: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before the first read: an infinite or huge period would overflow the sleep after one table."""
    code = main(["status", "--url", "http://127.0.0.1:1", "--watch", seconds])
    out, err = capsys.readouterr()
    assert (code, out) == (EXIT_UNREACHABLE, ""), (code, out, err)
    assert err.startswith("batchwire status: --watch takes"), err
    assert "cannot read the fleet" not in err, err


@pytest.mark.parametrize(
    "members",
    [[{}], [{"role": "worker", "id": "w", "state": "idle", "figures": {"p50_ms": "fast"}}], ["worker"]],
)
def test_members_that_are_not_the_fleets_exit_2_saying_so(
    members: list[object], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The document's shape is right, its members' are not (another release, another service): one line."""
    body = json.dumps({"members": members, "models": {}}).encode()
    monkeypatch.setattr(urllib.request, "urlopen", lambda request, timeout: io.BytesIO(body))
    code = run(argparse.Namespace(url="http://127.0.0.1:1", api_key=None, json=False, watch=None))
    out, err = capsys.readouterr()
    assert (code, out) == (EXIT_UNREACHABLE, ""), (code, out, err)
    assert "not the fleet's document" in err, err
