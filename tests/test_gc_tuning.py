"""The collector's settings: parsed from the flag, applied once start-up is done."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from batchwire.cli import build_parser
from batchwire.gc_tuning import DEFAULT, parse_threshold, tune_gc


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_thresholds_parse_and_off_keeps_pythons_own() -> None:
    assert parse_threshold("20000,20,100") == (20_000, 20, 100)
    assert parse_threshold(" OFF ") is None


@pytest.mark.parametrize("text", ["", "700,10", "a,b,c", "0,10,10", "700,-1,10", "1,2,3,4"])
def test_a_bad_threshold_says_what_a_good_one_looks_like(text: str) -> None:
    with pytest.raises(ValueError, match=r"three counts like 20000,20,100 \(or off\)"):
        parse_threshold(text)


def test_the_flag_defaults_to_the_tuned_thresholds_and_rejects_bad_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["up"]).gc_threshold == DEFAULT
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["up", "--gc-threshold", "700"])
    assert exited.value.code == 2
    assert "three counts like 20000,20,100" in capsys.readouterr().err


@pytest.mark.usefixtures("restored_gc")
def test_tuning_freezes_what_exists_and_sets_the_thresholds() -> None:
    gc.unfreeze()
    tune_gc(None)
    assert gc.get_freeze_count() == 0, "off: nothing frozen"
    tune_gc((12_345, 6, 7))
    assert gc.get_threshold() == (12_345, 6, 7)
    assert gc.get_freeze_count() > 1000, "start-up objects (modules, classes) are frozen"
