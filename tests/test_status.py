"""``batchwire status`` against a gateway it cannot read: exit 2 and a line that says why, never a traceback."""

from __future__ import annotations

import argparse

import pytest

from batchwire.status import EXIT_UNREACHABLE, run


@pytest.mark.parametrize("url", ["gateway", "", "http://[::1"])
def test_a_url_that_names_no_gateway_exits_2_saying_so(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = run(argparse.Namespace(url=url, api_key=None, json=False, watch=None))
    out, err = capsys.readouterr()
    assert (code, out) == (EXIT_UNREACHABLE, ""), (code, out, err)
    assert err.startswith(f"batchwire status: cannot read the fleet from {url}"), err
