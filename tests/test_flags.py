"""A float setting takes finite numbers only, refused by its flag's name whether it came as a flag or
as its variable: NaN passes every bound check (each comparison with it is false)."""

from __future__ import annotations

import pytest

from batchwire.cli import build_parser
from gpu_worker.settings import WorkerSettings


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf"])
def test_a_float_flag_refuses_what_is_not_a_finite_number(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["worker", f"--credit-ttl-s={value}"])
    assert exited.value.code == 2
    assert f"argument --credit-ttl-s: expected a finite number, got {value!r}" in capsys.readouterr().err


def test_a_float_variable_is_refused_by_its_flags_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BATCHWIRE_DRAIN_TIMEOUT_S", "inf")
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["worker"])
    assert exited.value.code == 2
    assert "argument --drain-timeout-s: expected a finite number, got 'inf'" in capsys.readouterr().err


def test_finite_numbers_still_parse() -> None:
    assert (
        build_parser().parse_args(["worker", "--credit-ttl-s", "2.5", "--drain-timeout-s", "1e1"]).credit_ttl_s == 2.5
    )


def test_a_negative_drain_timeout_is_refused_naming_the_variable() -> None:
    with pytest.raises(ValueError, match="BATCHWIRE_DRAIN_TIMEOUT_S"):
        WorkerSettings(drain_timeout_s=-1.0)
    assert WorkerSettings(drain_timeout_s=0.0).drain_timeout_s == 0.0, "0: the batch in hand goes back at once"
