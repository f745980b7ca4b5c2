"""The curve file: loading, validation and interpolation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchwire.capacity.curve import (
    Curve,
    CurveError,
    CurvePoint,
    CurveWarning,
    TokenCurve,
    from_json,
    load,
    percentile,
)


def test_an_empty_curve_is_refused() -> None:
    with pytest.raises(CurveError, match="no points"):
        from_json({"points": []})


def test_a_curve_without_points_or_fields_is_refused_with_what_is_missing() -> None:
    with pytest.raises(CurveError, match="points"):
        from_json({"sizes": [1, 2]})
    with pytest.raises(CurveError, match="size and p50_ms"):
        from_json({"points": [{"size": 1}]})


def test_a_file_that_is_missing_or_not_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(CurveError, match="cannot read"):
        load(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CurveError, match="not JSON"):
        load(bad)


def test_a_curve_not_monotone_in_size_is_accepted_with_a_warning() -> None:
    with pytest.warns(CurveWarning, match="not monotone"):
        curve = from_json({"points": [{"size": 1, "p50_ms": 50}, {"size": 8, "p50_ms": 30}]})
    assert curve.latency_ms(8) == 30


def test_latency_is_interpolated_between_sizes_and_bounded_by_the_max() -> None:
    curve = Curve((CurvePoint(1, 10.0, 12.0), CurvePoint(11, 30.0, 40.0)))
    assert curve.latency_ms(1) == 10.0
    assert curve.latency_ms(6) == pytest.approx(20.0)
    assert curve.latency_ms(6, "p99") == pytest.approx(26.0)
    assert curve.max_batch == 11
    with pytest.raises(CurveError, match="above the curve's max batch"):
        curve.latency_ms(12)


def test_best_rate_per_worker_is_full_batches_back_to_back() -> None:
    rate, size = Curve.flat(100.0, 32).best_rate_per_worker()
    assert (rate, size) == (pytest.approx(320.0), 32)


def test_a_saved_curve_loads_back_the_same(tmp_path: Path) -> None:
    curve = Curve((CurvePoint(1, 5.0, 6.0), CurvePoint(4, 7.0, 9.0)), "sim", {"repeats": 3})
    path = tmp_path / "curve.json"
    curve.save(path)
    assert json.loads(path.read_text())["points"][1] == {"size": 4, "p50_ms": 7.0, "p99_ms": 9.0}
    assert load(path) == curve


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 1.0) == 100.0


def _by_length() -> Curve:
    short = TokenCurve(16, (CurvePoint(1, 10.0, 11.0), CurvePoint(8, 20.0, 22.0)))
    long = TokenCurve(64, (CurvePoint(1, 30.0, 33.0), CurvePoint(8, 60.0, 70.0)))
    return Curve(short.points, "hf", {"input_tokens": 16}, (short, long))


def test_the_curve_at_a_length_interpolates_between_the_lengths_profiled() -> None:
    curve = _by_length()
    between = curve.at_tokens(40)
    assert between.points == (CurvePoint(1, 20.0, 22.0), CurvePoint(8, 40.0, 46.0))
    assert between.meta["input_tokens"] == 40
    assert curve.at_tokens(64).points == curve.by_tokens[1].points
    assert curve.at_tokens(4).points == curve.by_tokens[0].points  # below the shortest: its floor
    with pytest.raises(CurveError, match="longer than the curve's longest"):
        curve.at_tokens(65)
    with pytest.raises(CurveError, match="--lengths"):
        Curve.flat(100.0, 8).at_tokens(16)


def test_a_curve_by_length_saves_and_loads_back_and_bad_lengths_are_named(tmp_path: Path) -> None:
    curve = _by_length()
    path = tmp_path / "curve.json"
    curve.save(path)
    assert json.loads(path.read_text())["by_tokens"][1]["tokens"] == 64
    assert load(path) == curve
    with pytest.raises(CurveError, match='"tokens" must be a whole number'):
        from_json({"points": [{"size": 1, "p50_ms": 1}], "by_tokens": [{"tokens": "long", "points": []}]})
    with pytest.raises(CurveError, match="no points"):
        from_json({"points": [{"size": 1, "p50_ms": 1}], "by_tokens": [{"tokens": 8, "points": []}]})


def test_best_rate_per_worker_within_a_smaller_max_batch() -> None:
    rate, size = Curve.flat(100.0, 32).best_rate_per_worker(4)
    assert rate == pytest.approx(40.0) and size == 4, (rate, size)
    assert Curve.flat(100.0, 32).best_rate_per_worker(64)[1] == 32, "the curve's largest size bounds it still"


def test_a_size_or_length_that_is_not_a_whole_number_is_refused() -> None:
    """int() read a size of 1.7 as 1 (and 1.2 and 1.7 as two points of size 1), a length of 16.5 tokens as 16."""
    with pytest.raises(CurveError, match="the size a whole number"):
        from_json({"points": [{"size": 1.7, "p50_ms": 10}, {"size": 4, "p50_ms": 20}]})
    with pytest.raises(CurveError, match=r'"tokens" must be a whole number, got 16\.5'):
        from_json({"points": [{"size": 1, "p50_ms": 1}], "by_tokens": [{"tokens": 16.5, "points": []}]})
    assert from_json({"points": [{"size": 4.0, "p50_ms": 1}]}).max_batch == 4, "a whole number written as 4.0"
