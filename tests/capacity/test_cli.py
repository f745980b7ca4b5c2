"""The capacity commands as scripts call them: flags, exit codes and --json shapes."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from batchwire import cli
from batchwire.capacity import profile
from batchwire.capacity.curve import Curve, CurvePoint, load
from gpu_worker.backends.sim import SimBackend

Run = Callable[[list[str]], tuple[int, str, str]]
DATA = Path(__file__).parent / "data" / "bench"


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Run:
    def call(argv: list[str]) -> tuple[int, str, str]:
        code = cli.main(argv)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return call


@pytest.fixture
def flat(tmp_path: Path) -> str:
    path = tmp_path / "flat.json"
    Curve.flat(100.0, 100).save(path)
    return str(path)


def test_simulate_json_is_one_object_per_rate(run: Run, flat: str) -> None:
    code, out, _ = run(
        ["simulate", "--curve", flat, "--workers", "2", "--rate", "20,1000,2500", "--requests", "4000", "--json"]
    )
    assert code == 0
    results = json.loads(out)
    assert [r["rate"] for r in results] == [20.0, 1000.0, 2500.0]
    for r in results:
        assert {"rate", "throughput", "p50_ms", "p99_ms", "mean_batch", "busy"} <= set(r)
    assert results[0]["p99_ms"] is not None and not results[0]["unstable"]
    assert results[2]["unstable"] and results[2]["p99_ms"] is None, "over capacity: unstable, no p99"


def test_simulate_reads_a_trace_and_prints_a_table(run: Run, flat: str, tmp_path: Path) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text("\n".join(str(100 + i * 0.01) for i in range(500)))
    code, out, _ = run(["simulate", "--curve", flat, "--workers", "2", "--trace", str(trace)])
    assert code == 0 and "p99 ms" in out


def test_simulate_refuses_an_empty_curve(run: Run, tmp_path: Path) -> None:
    empty = tmp_path / "empty.json"
    empty.write_text('{"points": []}')
    code, _, err = run(["simulate", "--curve", str(empty), "--workers", "2", "--rate", "10"])
    assert code == 2 and "no points" in err


def test_plan_json_holds_every_figure(run: Run, tmp_path: Path) -> None:
    curve = tmp_path / "c32.json"
    Curve.flat(100.0, 32).save(curve)
    argv = ["plan", "--rate", "1000", "--p99-ms", "500", "--curve", str(curve), "--requests", "20000", "--json"]
    code, out, _ = run(argv)
    assert code == 0
    plan = json.loads(out)
    keys = ("gpus", "gpus_with_headroom", "batch_partitions", "request_partitions", "gateways", "batchers")
    assert {*keys, "kafka_brokers", "redis_memory_bytes", "formulas"} <= set(plan)
    assert (plan["gpus"], plan["gpus_with_headroom"], plan["batch_partitions"]) == (4, 6, 6)
    assert set(plan["formulas"]) >= set(keys)


def test_plan_sums_several_models_and_reads_a_cpu_file(run: Run, tmp_path: Path) -> None:
    curve = tmp_path / "c32.json"
    Curve.flat(100.0, 32).save(curve)
    cpu = tmp_path / "cpu.json"
    cpu.write_text('{"gateway_us_per_request": 7000, "batcher_us_per_request": 100}')
    argv = ["plan", "--models", "a=1000,b=300", "--p99-ms", "500", "--curve", str(curve), "--requests", "10000"]
    code, out, _ = run([*argv, "--cpu-file", str(cpu), "--json"])
    plan = json.loads(out)
    assert code == 0 and [m["model"] for m in plan["models"]] == ["a", "b"]
    assert plan["gpus"] == sum(m["gpus"] for m in plan["models"])
    assert plan["gateways"] == 13  # 1,300 x 7 ms = 9.1 cores / 0.7


def test_plan_table_of_several_models_labels_the_gpu_rows_as_sums_of_each_model(run: Run, tmp_path: Path) -> None:
    curve = tmp_path / "c32.json"
    Curve.flat(100.0, 32).save(curve)
    argv = ["plan", "--models", "a=1000,b=300", "--p99-ms", "500", "--curve", str(curve), "--requests", "10000"]
    code, out, _ = run(argv)
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("gpus")}
    assert code == 0 and set(rows) == {"gpus", "gpus_with_headroom"}, out
    for name, row in rows.items():
        assert "per model" not in row and "summed over the 2 models: for each," in row, f"{name}: {row}"
    models = [line for line in out.splitlines() if line.startswith("model ")]
    counts = [int(line.split(" GPUs")[0].rsplit(" ", 1)[1]) for line in models]
    assert len(counts) == 2 and int(rows["gpus"].split()[1]) == sum(counts), out


def test_plan_table_shows_each_formula(run: Run, tmp_path: Path) -> None:
    curve = tmp_path / "c32.json"
    Curve.flat(100.0, 32).save(curve)
    code, out, _ = run(["plan", "--rate", "300", "--p99-ms", "500", "--curve", str(curve), "--requests", "5000"])
    assert code == 0 and "ceil(gpus / headroom 0.7)" in out and "replication factor" in out


def test_a_reserve_with_the_classic_policy_is_refused(run: Run, flat: str) -> None:
    argv = ["simulate", "--curve", flat, "--workers", "1", "--rate", "100", "--policy", "classic"]
    code, _, err = run([*argv, "--reserve-ms", "20"])
    assert code == 2 and "--reserve-ms is 20, and --policy is classic" in err, err
    code, _, err = run([*argv, "--reserve-ms", "0", "--requests", "2000"])
    assert code == 0, f"a reserve of 0 is what classic does: {err}"


@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_zero_batchers_is_refused_by_simulate_and_plan_alike(run: Run, flat: str, command: str) -> None:
    rate = ["--rate", "100"] if command == "simulate" else ["--rate", "100", "--p99-ms", "500"]
    argv = [command, "--curve", flat, *rate, "--requests", "2000", "--batchers", "0"]
    if command == "simulate":
        argv += ["--workers", "1"]
    code, _, err = run(argv)
    assert code == 2 and f"batchwire {command}: --batchers is 0; it must be at least 1" in err, err


@pytest.mark.filterwarnings("ignore::batchwire.capacity.curve.CurveWarning")
def test_profile_sim_writes_a_curve(run: Run, tmp_path: Path) -> None:
    out_path = tmp_path / "sim.json"
    argv = ["profile", "--backend", "sim", "--sim-latency-ms", "2", "--max-batch", "4", "--repeats", "2"]
    code, out, _ = run([*argv, "--out", str(out_path)])
    assert code == 0 and "wrote" in out
    curve = load(out_path)
    assert [p.size for p in curve.points] == [1, 2, 4] and curve.backend == "sim"
    assert all(p.p50_ms >= 2.0 for p in curve.points)


def test_profile_into_a_folder_that_is_not_there_says_so_before_it_times_anything(
    run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(profile, "profile_backend", lambda *args, **kwargs: pytest.fail("timed for nothing"))
    out_path = tmp_path / "no-such-folder" / "c.json"
    code, _, err = run(["profile", "--backend", "sim", "--sim-latency-ms", "2", "--out", str(out_path)])
    assert code == 2 and f"--out {out_path}: {out_path.parent} is not a folder" in err, err


def test_profile_hf_without_torch_names_the_extra(run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = profile.importlib.util.find_spec
    monkeypatch.setattr(profile.importlib.util, "find_spec", lambda name: None if name == "torch" else real(name))
    code, _, err = run(["profile", "--backend", "hf", "--model-path", str(tmp_path), "--out", str(tmp_path / "c.json")])
    assert code == 2 and "[hf]" in err


class _Counted(SimBackend):
    def __init__(self) -> None:
        super().__init__(0.0, 8)
        self.sizes: list[int] = []

    def batchstring(self, inputs: list[str]) -> list[str]:
        self.sizes.append(len(inputs))
        return super().batchstring(inputs)


def test_profile_times_each_size_over_repeats_on_the_given_clock() -> None:
    ticks = iter(float(t) for t in range(1000))
    backend = _Counted()
    curve = profile.profile_backend(backend, [1, 8], 3, clock=lambda: next(ticks))
    assert curve.points == (CurvePoint(1, 1000.0, 1000.0), CurvePoint(8, 1000.0, 1000.0))
    assert backend.sizes == [1] * 4 + [8] * 4  # each size's first call (its one-off costs) is not timed
    assert profile.ladder(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert profile.parse_sizes("all", 3) == [1, 2, 3]
    with pytest.raises(profile.ProfileError, match=r"within 1\.\.4"):
        profile.parse_sizes("8", 4)


class _Words:
    """Counts tokens as a word tokenizer with two special tokens would: one per word begun."""

    max_input_tokens = 64

    def count_tokens(self, inputs: Sequence[str]) -> list[int]:
        return [len(text.split()) + 2 for text in inputs]


def test_the_input_of_a_length_is_the_longest_that_fits_it() -> None:
    text, counted = profile.text_of_tokens(_Words(), 10)
    assert counted == 10 and _Words().count_tokens([text + " x"])[0] == 11
    with pytest.raises(profile.ProfileError, match="longer than the model accepts"):
        profile.text_of_tokens(_Words(), 65)
    with pytest.raises(profile.ProfileError, match="shorter than the shortest input"):
        profile.text_of_tokens(_Words(), 2)
    capped = _Words()
    capped.count_tokens = lambda inputs: [5 for _ in inputs]  # type: ignore[method-assign]
    with pytest.raises(profile.ProfileError, match="reaches 10 tokens"):
        profile.text_of_tokens(capped, 10)
    assert profile.parse_lengths("auto", _Words()) == [16, 64]  # 256 is beyond the model: its longest
    assert profile.parse_lengths("auto", SimBackend(0.0, 8)) == [] == profile.parse_lengths("none", _Words())
    with pytest.raises(profile.ProfileError, match="positive token counts"):
        profile.parse_lengths("0,8", _Words())


# Two repeats of a 1-2 ms call on a shared CPU: a batch of 2 can time under a batch of 1, which the
# curve accepts with a warning (not what this test is about).
@pytest.mark.hf
@pytest.mark.filterwarnings("ignore::batchwire.capacity.curve.CurveWarning")
def test_profile_hf_times_each_length_in_the_models_own_tokens(run: Run, tmp_path: Path) -> None:
    from batchwire.bench.tiny_models import build_tiny_encoder  # torch: imported by the tests that use it

    model = build_tiny_encoder(tmp_path / "bert")
    out_path = tmp_path / "tiny.json"
    argv = ["profile", "--backend", "hf", "--model-path", str(model), "--hf-task", "embed", "--device", "cpu"]
    code, out, _ = run([*argv, "--max-batch", "2", "--repeats", "2", "--lengths", "16,48", "--out", str(out_path)])
    assert code == 0, out
    curve = load(out_path)
    assert [t.tokens for t in curve.by_tokens] == [16, 48]  # the tiny model counts a byte a token
    assert all([p.size for p in t.points] == [1, 2] for t in curve.by_tokens)
    assert curve.meta["input_tokens"] == 66  # the default 64 characters and two special tokens
    code, out, _ = run(["simulate", "--curve", str(out_path), "--tokens", "32", "--workers", "1", "--rate", "50"])
    assert code == 0 and "50.0" in out
    code, _, err = run(["simulate", "--curve", str(out_path), "--tokens", "49", "--workers", "1", "--rate", "50"])
    assert code == 2 and "--lengths up to 49" in err
    code, _, err = run(["plan", "--curve", str(out_path), "--tokens", "0", "--rate", "50", "--p99-ms", "100"])
    assert code == 2 and "--tokens takes a positive length" in err


def test_profile_lengths_need_a_tokenizer(run: Run, tmp_path: Path) -> None:
    argv = ["profile", "--backend", "sim", "--sim-latency-ms", "1", "--max-batch", "2", "--repeats", "1"]
    code, _, err = run([*argv, "--lengths", "16", "--out", str(tmp_path / "c.json")])
    assert code == 2 and "needs a backend with a tokenizer" in err


@pytest.mark.parametrize(
    ("rate", "said"),
    [
        ("nan", "rates must be positive finite numbers, got nan"),
        ("inf", "rates must be positive finite numbers, got inf"),
        ("1e9", "1e+09 req/s needs at least 3125000 GPUs"),  # refused at once, not simulated for hours
    ],
)
def test_plan_refuses_a_rate_it_cannot_plan(run: Run, rate: str, said: str, tmp_path: Path) -> None:
    curve = tmp_path / "c32.json"
    Curve.flat(100.0, 32).save(curve)
    code, _, err = run(["plan", f"--rate={rate}", "--p99-ms", "500", "--curve", str(curve)])
    assert code == 2 and said in err, err


@pytest.mark.parametrize("rate", ["nan", "inf", "0", "100,-1"])
def test_simulate_refuses_a_rate_that_is_not_positive_and_finite(run: Run, flat: str, rate: str) -> None:
    code, _, err = run(["simulate", "--curve", flat, "--workers", "1", f"--rate={rate}"])
    assert code == 2 and "--rate takes positive finite rates" in err, err


@pytest.mark.parametrize(("flag", "value"), [("--transit-ms", "-5"), ("--overhead-ms", "-50"), ("--transit-ms", "nan")])
@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_a_hop_that_is_no_duration_is_refused_naming_its_flag(
    run: Run, flat: str, command: str, flag: str, value: str
) -> None:
    """A negative transit read as time given back (negative latencies in the table); a negative overhead was
    refused in a dump of the whole simulated configuration."""
    rate = ["--rate", "100"] if command == "simulate" else ["--rate", "100", "--p99-ms", "500"]
    argv = [command, "--curve", flat, *rate, "--requests", "2000", flag, value]
    if command == "simulate":
        argv += ["--workers", "1"]
    code, _, err = run(argv)
    assert code == 2 and f"batchwire {command}: {flag} is {float(value):g}; it must be 0 or more ms" in err, err
    assert "SimConfig" not in err, err


@pytest.mark.parametrize("ttl", ["-1", "0"])
def test_plan_refuses_a_result_ttl_that_keeps_nothing(run: Run, flat: str, ttl: str) -> None:
    """A TTL of 0 or less planned Redis memory of 0 or less bytes."""
    code, out, err = run(["plan", "--curve", flat, "--rate", "100", "--p99-ms", "500", "--result-ttl-s", ttl])
    assert (code, out) == (2, ""), (code, out, err)
    assert "result TTL must be positive" in err and "--result-ttl-s" in err, err


@pytest.mark.parametrize(
    ("command", "flag"),
    [
        ("simulate", "--max-wait-ms"),
        ("simulate", "--reserve-ms"),
        ("simulate", "--credit-lead-ms"),
        ("simulate", "--credit-lead-full-ms"),
        ("simulate", "--spacing-margin-ms"),
        ("plan", "--max-wait-ms"),
        ("plan", "--p99-ms"),
        ("plan", "--result-ttl-s"),
        ("validate-sim", "--held-out"),
        ("profile", "--sim-latency-ms"),
    ],
)
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_float_flag_takes_finite_numbers_only(
    run: Run, flat: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, flag: str, value: str
) -> None:
    """A NaN passes no bound check: --max-wait-ms nan gave negative latencies, --p99-ms nan simulated every
    worker count up to 64 times the bound before it gave up, --result-ttl-s inf ended in a traceback."""
    argv = {
        "simulate": ["simulate", "--curve", flat, "--workers", "1", "--rate", "100", "--requests", "2000"],
        "plan": ["plan", "--curve", flat, "--rate", "100", "--p99-ms", "500", "--requests", "2000"],
        "validate-sim": ["validate-sim", str(DATA / "policies"), "--requests", "500", "--seeds", "1"],
        "profile": ["profile", "--max-batch", "2", "--repeats", "1", "--out", str(tmp_path / "c.json")],
    }[command]
    with pytest.raises(SystemExit) as exited:
        run([*argv, f"{flag}={value}"])
    said = capsys.readouterr().err
    assert exited.value.code == 2 and f"argument {flag}: expected a finite number, got '{value}'" in said, said


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ('{"broker_core_bytes_per_s": 0}', "broker_core_bytes_per_s is 0; it must be a finite number, more than 0"),
        ('{"redis_commands_per_s": 0}', "redis_commands_per_s is 0; it must be a finite number, more than 0"),
        ('{"redis_shard_bytes": 0}', "redis_shard_bytes is 0; it must be a finite number, more than 0"),
        ('{"broker_cores": 0}', "broker_cores is 0; it must be a finite number, more than 0"),
        ('{"gateway_us_per_request": NaN}', "gateway_us_per_request is nan; it must be a finite number, 0 or more"),
        ('{"kafka_bytes_per_request": Infinity}', "kafka_bytes_per_request is inf; it must be a finite number"),
        ('{"result_bytes": -5000}', "result_bytes is -5000; it must be a finite number, 0 or more"),
        # int() read 2.5 as 2, and an infinity ended in an OverflowError
        ('{"replication_factor": 2.5}', "replication_factor take whole numbers, got 2.5"),
        ('{"result_bytes": Infinity}', "holds a value that is not a finite number"),
        ('{"result_bytes": "1024x"}', "holds a value that is not a finite number"),
    ],
)
def test_a_cpu_file_value_the_sizing_cannot_use_is_refused_naming_it(
    run: Run, flat: str, tmp_path: Path, given: str, said: str
) -> None:
    """A capacity of 0 ended in a ZeroDivisionError, an infinity in an OverflowError, a NaN in "cannot convert
    float NaN to integer", and a negative size planned negative bytes."""
    cpu = tmp_path / "cpu.json"
    cpu.write_text(given)
    argv = ["plan", "--curve", flat, "--rate", "100", "--p99-ms", "500", "--requests", "2000", "--cpu-file", str(cpu)]
    code, out, err = run(argv)
    assert (code, out) == (2, ""), (code, out, err)
    assert f"batchwire plan: --cpu-file {cpu}: " in err and said in err, err
    assert "--cpu-file" in err, err


@pytest.mark.parametrize(
    ("command", "flag", "value", "least"),
    [
        ("simulate", "--workers", "0", 1),
        ("simulate", "--requests", "0", 1),
        ("plan", "--requests", "-3", 1),
        ("simulate", "--max-batch", "0", 1),
        ("plan", "--max-wait-ms", "-1", 0),
        ("simulate", "--reserve-ms", "-5", 0),
        ("simulate", "--credit-lead-ms", "-5", 0),
        ("plan", "--credit-lead-full-ms", "-5", 0),
    ],
)
def test_a_count_or_duration_below_its_least_is_refused_naming_its_flag(
    run: Run, flat: str, command: str, flag: str, value: str, least: int
) -> None:
    """These were refused in the words of the Poisson draw, the flush policy's variables (BATCHWIRE_MAX_BATCH) or
    the workers' count, or not at all: a negative credit lead, which the worker refuses, ran as no lead."""
    rate = ["--rate", "100"] if command == "simulate" else ["--rate", "100", "--p99-ms", "500"]
    argv = [command, "--curve", flat, *rate, "--requests", "2000"]
    if command == "simulate" and flag != "--workers":
        argv += ["--workers", "1"]
    code, out, err = run([*argv, f"{flag}={value}"])
    assert (code, out) == (2, ""), (code, out, err)
    assert f"batchwire {command}: {flag} is {float(value):g}; it must be at least {least}" in err, err


def test_profile_refuses_inputs_of_no_characters(run: Run, tmp_path: Path) -> None:
    """An --input-chars of 0 or less timed calls on empty inputs."""
    argv = ["profile", "--sim-latency-ms", "1", "--max-batch", "2", "--repeats", "1", "--input-chars", "0"]
    code, _, err = run([*argv, "--out", str(tmp_path / "c.json")])
    assert code == 2 and "--input-chars must be at least 1, got 0" in err, err


@pytest.mark.parametrize("text", ["nan\n1\n2\n", "[1, Infinity, 2]"])
def test_a_trace_with_a_timestamp_that_is_not_finite_is_refused(run: Run, flat: str, tmp_path: Path, text: str) -> None:
    """A NaN sorted anywhere and made every arrival NaN (a rate of nan, nothing served); an infinity stretched
    the run without end (a rate of 0 and a busy share of 0)."""
    trace = tmp_path / "trace.txt"
    trace.write_text(text)
    code, out, err = run(["simulate", "--curve", flat, "--workers", "1", "--trace", str(trace)])
    assert (code, out) == (2, ""), (code, out, err)
    assert f"the trace {trace} holds a timestamp that is not a finite number" in err, err


def test_the_headroom_flag_applies_after_the_cpu_file(run: Run, tmp_path: Path) -> None:
    """As docs/capacity.md has it, a flag applies after the files: the file's headroom won over --headroom."""
    curve = tmp_path / "c32.json"
    Curve.flat(100.0, 32).save(curve)
    cpu = tmp_path / "cpu.json"
    cpu.write_text('{"headroom": 0.5, "gateway_us_per_request": 7000}')
    argv = ["plan", "--rate", "1000", "--p99-ms", "500", "--curve", str(curve), "--requests", "20000"]
    code, out, err = run([*argv, "--cpu-file", str(cpu), "--headroom", "0.9", "--json"])
    assert code == 0, err
    plan = json.loads(out)
    assert plan["inputs"]["headroom"] == {"value": 0.9, "from": "--headroom"}
    assert (plan["gpus"], plan["gpus_with_headroom"]) == (4, 5), "ceil(4 / 0.9)"
    assert plan["inputs"]["gateway_us_per_request"]["from"] == f"--cpu-file {cpu}", "the file's other values stay"


def test_a_rate_over_what_the_policys_max_batch_serves_is_unstable(run: Run, tmp_path: Path) -> None:
    """A worker running batches of at most 4 in 100 ms serves 40 req/s: 40.5 req/s was reported stable, with a
    p50 that grew with the run's length (the capacity read the curve's 32 items, not the policy's 4)."""
    curve = tmp_path / "c32.json"
    Curve.flat(100.0, 32).save(curve)
    argv = ["simulate", "--curve", str(curve), "--workers", "1", "--max-batch", "4", "--rate", "40.5"]
    code, out, err = run([*argv, "--requests", "2000", "--json"])
    assert code == 0, err
    (result,) = json.loads(out)
    assert result["unstable"] and result["p50_ms"] is None, result


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["--models", "a=100,a=200"], "--models takes each model once, by name, with its whole rate"),
        (["--models", "=100"], "--models takes each model once, by name, with its whole rate"),
        (
            ["--rate", "5000", "--models", "a=100"],
            "give --rate R (one model) or --models NAME=RATE,... (several), not both",
        ),
    ],
)
def test_plan_refuses_models_it_would_plan_apart_or_a_rate_it_would_drop(
    run: Run, flat: str, given: list[str], said: str
) -> None:
    """A model named twice was planned as two deployments (2 GPUs for 300 req/s that one serves); an empty name
    was planned as a model; --rate beside --models was dropped without a word."""
    code, out, err = run(["plan", "--curve", flat, "--p99-ms", "500", "--requests", "2000", *given])
    assert (code, out) == (2, ""), (code, out, err)
    assert f"batchwire plan: {said}" in err, err


def test_plan_refuses_inputs_whose_figures_overflow_before_it_simulates(
    run: Run, flat: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finite inputs whose product is not (100 req/s x 1e306 s x 1,324 B) ended in an OverflowError traceback,
    after the GPUs' simulations."""
    from batchwire.capacity import plan

    monkeypatch.setattr(plan, "plan_model", lambda *args, **kwargs: pytest.fail("simulated for nothing"))
    argv = ["plan", "--curve", flat, "--rate", "100", "--p99-ms", "500", "--result-ttl-s", "1e306"]
    code, out, err = run(argv)
    assert (code, out) == (2, ""), (code, out, err)
    assert "batchwire plan: the figures for 100 req/s overflow" in err and "--result-ttl-s" in err, err


def test_plan_draws_its_arrivals_from_the_seed_given(run: Run, tmp_path: Path) -> None:
    """plan took --seed and simulated seed 0 whatever it said."""
    curve = tmp_path / "c32.json"
    Curve.flat(100.0, 32).save(curve)
    argv = ["plan", "--rate", "1000", "--p99-ms", "500", "--curve", str(curve), "--requests", "3000", "--json"]
    p99s = set()
    for seed in ("0", "1", "2"):
        code, out, err = run([*argv, "--seed", seed])
        assert code == 0, err
        p99s.add(json.loads(out)["models"][0]["simulated"]["p99_ms"])
    assert len(p99s) > 1, f"three seeds, one p99: {p99s}"


def test_simulate_refuses_more_workers_than_the_planner_simulates(run: Run, flat: str) -> None:
    """Each worker gets its own latency table and events: 100,000 ran for hours where plan stops at 10,000."""
    code, _, err = run(["simulate", "--curve", flat, "--workers", "10001", "--rate", "100"])
    assert code == 2 and "--workers is 10001; it must be at most 10,000" in err, err


@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_more_simulated_requests_than_memory_holds_are_refused_before_any_is_drawn(flat: str, command: str) -> None:
    """Checked on the configuration alone (run, it would fill the memory): ``--requests 1000000000`` drew every
    arrival into memory and grew until the kernel killed the process."""
    from batchwire.capacity.simulate import MAX_REQUESTS, config_from

    rate = ["--workers", "1", "--rate", "100"] if command == "simulate" else ["--rate", "100", "--p99-ms", "500"]
    args = cli.tool_parser(command).parse_args([command, "--curve", flat, *rate, "--requests", "1000000000"])
    with pytest.raises(ValueError, match=f"--requests is 1,000,000,000; it must be at most {MAX_REQUESTS:,}"):
        config_from(args, load(flat), 1)
    args.requests = MAX_REQUESTS
    assert config_from(args, load(flat), 1, batchers=1).workers == 1


def test_validate_sim_refuses_more_simulated_requests_than_memory_holds(run: Run, tmp_path: Path) -> None:
    """Checked before the runs are read (the folder holds none): run, it drew every arrival into memory."""
    code, _, err = run(["validate-sim", str(tmp_path), "--requests", "1000000000"])
    assert code == 2 and "--requests is 1,000,000,000; it must be at most 10,000,000" in err, err
