"""The plan: the design documents' example, the search, and the closed-form figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batcher.policy import FlushPolicy
from batchwire.capacity import plan
from batchwire.capacity.curve import Curve
from batchwire.capacity.engine import SimConfig
from batchwire.capacity.plan import PlanError, gpus_for, plan_model
from batchwire.capacity.sizing import SizingError, SizingInputs, as_dict, load_cpu_file, size


def test_the_design_example_320_per_gpu_and_1000_per_s_gives_4_gpus_and_6_with_headroom() -> None:
    """32 items in 100 ms is 320 req/s per GPU: 1,000 req/s need 3.1, so 4; ceil(4 / 0.7) = ceil(5.7) = 6."""
    curve = Curve.flat(100.0, 32)
    plan = plan_model(
        lambda w: SimConfig(curve, w, FlushPolicy.work_conserving(max_batch=32)), "m", 1000.0, 500.0, 0.7, 20_000
    )
    assert (plan.gpus, plan.gpus_with_headroom) == (4, 6)
    assert plan.simulated.p99_ms is not None and plan.simulated.p99_ms <= 500.0


def test_a_tighter_p99_needs_more_gpus_than_the_closed_form_bound() -> None:
    curve = Curve.flat(100.0, 32)

    def configure(workers: int) -> SimConfig:
        return SimConfig(curve, workers, FlushPolicy.work_conserving(max_batch=32))

    loose, _ = gpus_for(configure, 1000.0, 500.0, 20_000)
    tight, result = gpus_for(configure, 1000.0, 150.0, 20_000)
    assert tight > loose == 4
    assert result.p99_ms is not None and result.p99_ms <= 150.0
    short, _ = gpus_for(configure, 1000.0, 150.0, 20_000)
    assert short == tight, "the search is deterministic"


def test_a_p99_below_one_call_is_refused() -> None:
    curve = Curve.flat(100.0, 32)
    with pytest.raises(PlanError, match="below one call"):
        gpus_for(lambda w: SimConfig(curve, w, FlushPolicy.work_conserving(max_batch=32)), 1000.0, 50.0, 1000)


def test_the_closed_form_figures_follow_their_formulas() -> None:
    inputs = SizingInputs(gateway_us_per_request=400.0, batcher_us_per_request=240.0, replication_factor=3)
    figures = as_dict(size(100_000.0, inputs))
    assert figures["gateways"] == 58  # 100,000 x 400 us = 40 cores / 0.7
    assert figures["batchers"] == 35  # 24 cores / 0.7
    assert figures["request_partitions"] == 116
    assert figures["kafka_bytes_per_s"] == 100_000 * 2 * 1024 * 3
    assert figures["kafka_brokers"] == 18  # 614.4 MB/s / (6.25 MB/s per core x 8 cores x headroom 0.7)
    assert figures["redis_memory_bytes"] == 100_000 * 3600 * (1024 + 300)
    assert figures["redis_commands_per_s"] == 300_000
    small = as_dict(size(10.0, inputs))
    assert (small["gateways"], small["batchers"], small["kafka_brokers"]) == (1, 1, 3)


def test_bad_sizing_inputs_name_the_flag() -> None:
    with pytest.raises(SizingError, match="--headroom"):
        SizingInputs(headroom=1.5)
    with pytest.raises(SizingError, match="--replication-factor"):
        SizingInputs(replication_factor=0)


def test_a_p99_below_a_single_items_call_and_transit_is_refused_before_any_simulation() -> None:
    """Every answer takes a call, the transit and the overhead: a target below their sum was searched for up to
    64 times the closed-form bound of workers, then refused as not met."""
    curve = Curve.flat(100.0, 32)

    def configure(workers: int) -> SimConfig:
        return SimConfig(curve, workers, FlushPolicy.work_conserving(max_batch=32), transit_ms=450.0)

    with pytest.raises(PlanError, match=r"below one call of a single item with its transit and overhead \(550\.0 ms\)"):
        gpus_for(configure, 100.0, 500.0, 2000)


def test_the_bound_counts_the_policys_max_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of at most 4 in 100 ms serve 40 req/s a worker, not the curve's 320: 500 req/s need 13 at least,
    past a limit of 10, refused at once (the bound read the curve's largest batch and simulated on)."""
    monkeypatch.setattr(plan, "MAX_WORKERS", 10)
    curve = Curve.flat(100.0, 32)
    with pytest.raises(PlanError, match=r"needs at least 13 GPUs \(one serves 40 req/s at best\)"):
        gpus_for(lambda w: SimConfig(curve, w, FlushPolicy.work_conserving(max_batch=4)), 500.0, 5000.0, 2000)


def test_a_cpu_file_may_write_a_whole_number_as_a_string_or_with_a_point(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu.json"
    cpu.write_text('{"result_bytes": "2048", "replication_factor": 2.0}')
    inputs = load_cpu_file(cpu, SizingInputs())
    assert (inputs.result_bytes, inputs.replication_factor) == (2048, 2)


@pytest.mark.parametrize("rates", ["a=100,b=100,c=100,d=100,e=100", "embed=20000,rerank=300"])
def test_the_request_partitions_planned_for_several_models_are_a_count_the_service_takes(
    rates: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Five models at 100 req/s were planned 2 request partitions, which every gateway and batcher refuses (at
    least one per model); the service splits the count evenly among the models, so each model's share must hold
    as many partitions as the batchers the plan simulated sharing that model's requests."""
    from batchwire.cli import main
    from batchwire.settings import SharedSettings
    from transport.routing import Partitioner

    curve = Path(__file__).parents[2] / "bench/results/capacity/sim-100ms-32.json"
    argv = ["plan", "--models", rates, "--p99-ms", "500", "--curve", str(curve), "--requests", "2000", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    models = tuple(model["model"] for model in result["models"])
    count = result["request_partitions"]
    SharedSettings(models=models, request_partitions=count)  # as every gateway and batcher checks it
    ranges = Partitioner(models, count)
    for model in result["models"]:
        share = len(ranges.partitions_for(model["model"]))
        assert share >= 2 * model["simulated_batchers"], f"{model['model']}: {share} of {count} partitions, {model}"
