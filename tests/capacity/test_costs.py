"""``batchwire plan --costs``: the sizing inputs a bench run over Kafka measured, each named with its source."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchwire import cli
from batchwire.capacity.costs import read_costs
from batchwire.capacity.sizing import SizingError

CURVE = Path(__file__).parents[2] / "bench" / "results" / "capacity" / "sim-100ms-100.json"


def rate(offered: float, throughput: float, gateway_us: float, commands: float, memory: float | None) -> dict[str, Any]:
    return {
        "offered_rps": offered,
        "sent": offered * 20,
        "window_s": 20.0,
        "throughput_rps": throughput,
        "processes": {
            "batchwire.gateway": {"us_per_request": gateway_us},
            "batchwire.batcher": {"us_per_request": gateway_us / 2},
            "redis": {"us_per_request": 40.0},
            "kafka": {"us_per_request": 300.0},
        },
        "redis_commands": {"per_request": commands},
        "redis_bytes_per_request": memory,
        "kafka_writes": {"bytes_per_request": 3 * memory if memory else None, "records_per_request": 2.5},
    }


def write_run(path: Path, mode: str, rates: list[dict[str, Any]]) -> Path:
    path.mkdir(parents=True)
    runs = [{"label": "sim", "sut": {"mode": mode}, "rates": rates}]
    (path / "results.json").write_text(json.dumps({"runs": runs}))
    return path


def test_the_busiest_rate_that_kept_up_gives_the_costs(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "kafka-run",
        "kafka",
        [rate(500, 499, 600, 3.5, 900.0), rate(1000, 998, 450, 3.2, 1100.0), rate(2000, 1500, 300, 3.0, 1200.0)],
    )
    costs = read_costs(run)
    assert costs.values == {
        "gateway_us_per_request": 450.0,
        "batcher_us_per_request": 225.0,
        "redis_commands_per_request": 3.2,
        "result_bytes": 1100.0,
        "key_overhead_bytes": 0.0,
        "kafka_bytes_per_request": 3300.0,
        "kafka_records_per_request": 2.5,
        "redis_commands_per_s": pytest.approx(3.2 / 40e-6),
        "broker_core_bytes_per_s": pytest.approx(3300.0 / 300e-6),
    }, "1,000 req/s: 2,000 fell behind (1,500 answered/s)"
    assert all("kafka-run, 1000 req/s" in source for source in costs.sources.values())


def test_a_figure_the_run_did_not_measure_is_left_to_its_default(tmp_path: Path) -> None:
    costs = read_costs(write_run(tmp_path / "old", "kafka", [rate(800, 800, 500, 3.0, None)]))
    assert "result_bytes" not in costs.values and "key_overhead_bytes" not in costs.values


@pytest.mark.parametrize("mode", ["embedded"])
def test_a_run_that_is_not_over_kafka_is_refused_with_what_to_measure(tmp_path: Path, mode: str) -> None:
    with pytest.raises(SizingError, match="batchwire bench --start kafka"):
        read_costs(write_run(tmp_path / "run", mode, [rate(800, 800, 500, 3.0, 1000.0)]))
    with pytest.raises(SizingError, match="cannot read"):
        read_costs(tmp_path / "missing")


def test_the_plan_sizes_from_the_costs_and_says_where_each_input_came_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path / "measured", "kafka", [rate(1000, 1000, 500, 4.0, 2000.0)])
    argv = ["plan", "--curve", str(CURVE), "--rate", "1000", "--p99-ms", "300", "--requests", "2000"]
    assert cli.main([*argv, "--costs", str(run), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["redis_commands_per_s"] == 4000, "1,000 req/s x 4 commands measured"
    assert plan["gateways"] == 1 and plan["inputs"]["gateway_us_per_request"]["value"] == 500.0
    assert plan["inputs"]["redis_commands_per_request"]["from"].startswith("measured: Redis commands per request")
    assert plan["inputs"]["kafka_bytes_per_request"]["from"].startswith("measured: Kafka bytes per request")
    assert plan["kafka_bytes_per_s"] == 1000 * 6000 * 3, "rate x the measured bytes x the replication factor"
    assert plan["kafka_records_per_s"] == 2500
    assert plan["redis_memory_bytes"] == 1000 * 3600 * 2000, "rate x TTL x the measured bytes per task"
    assert plan["inputs"]["redis_commands_per_s"]["value"] == pytest.approx(4.0 / 40e-6), "a shard: one core"
    assert plan["inputs"]["broker_core_bytes_per_s"]["from"].startswith("measured: Kafka bytes appended")
    assert plan["inputs"]["broker_cores"]["from"].startswith("default"), "hardware: chosen, not measured"
    assert cli.main([*argv, "--costs", str(run), "--result-ttl-s", "60"]) == 0
    table = capsys.readouterr().out
    assert "result_ttl_s" in table and "--result-ttl-s" in table and "measured: the gateways' CPU" in table
    assert cli.main([*argv, "--costs", str(tmp_path / "nothing")]) == 2
    assert "cannot read a bench run" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text",
    ['{"runs": 5}', '{"runs": ["x"]}', '{"runs": [{"sut": {"mode": "kafka"}, "rates": [{"throughput_rps": "x"}]}]}'],
)
def test_a_results_file_of_another_shape_is_refused_naming_it(tmp_path: Path, text: str) -> None:
    """Each ended in a traceback: a TypeError or an AttributeError from deep in the selection of the rate."""
    file = tmp_path / "results.json"
    file.write_text(text)
    with pytest.raises(SizingError, match=f"--costs: {file} is not a batchwire bench run's results"):
        read_costs(file)
