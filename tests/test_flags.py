"""Settings that cannot work stop a role before it starts, with exit 2 and the setting's name: a float
setting takes finite numbers only (NaN passes every bound check: each comparison with it is false),
and counts, latencies and ports keep to their ranges."""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from batchwire import flags
from batchwire import role_settings as rs
from batchwire.cli import TOOLS, build_parser, config_table, main, tool_parser
from batchwire.settings import SettingsError
from batchwire.supervise import serve_metrics
from gpu_worker.settings import WorkerSettings
from telemetry import logs
from telemetry.metrics import BATCHER_EXPORTS


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf"])
def test_a_float_flag_refuses_what_is_not_a_finite_number(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["worker", f"--credit-ttl-s={value}"])
    assert exited.value.code == 2
    assert f"argument --credit-ttl-s: expected a finite number, got {value!r}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "variable", "value", "refusal"),
    [
        (
            "worker",
            "BATCHWIRE_DRAIN_TIMEOUT_S",
            "inf",
            "argument --drain-timeout-s: expected a finite number, got 'inf'",
        ),
        # empty in an env file: not read as false, which would turn a setting on by default off
        ("gateway", "BATCHWIRE_ADMIT_BY_WAIT", "", "argument --admit-by-wait: expected true or false, got ''"),
        ("up", "BATCHWIRE_PORT", "abc", "argument --port: invalid int value: 'abc'"),
    ],
)
def test_a_variable_that_is_no_value_of_its_flag_is_refused_by_the_flags_and_the_variables_name(
    command: str,
    variable: str,
    value: str,
    refusal: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The caller who set the variable passed no flag: the flag's name alone would not say what to fix."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([command])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"{refusal} (from {variable}: correct it or unset it)" in err, err


def test_a_refused_value_from_the_stack_file_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = tmp_path / "stack.env"
    stack.write_text("BATCHWIRE_METRICS_PORT=ninety\n")
    monkeypatch.setenv("BATCHWIRE_STACK_ENV", str(stack))
    monkeypatch.delenv("BATCHWIRE_METRICS_PORT", raising=False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker"])
    err = capsys.readouterr().err
    assert f"invalid int value: 'ninety' (from BATCHWIRE_METRICS_PORT in {stack}" in err, err


@pytest.mark.parametrize(
    ("argv", "missing"), [(["batcher"], "Kafka"), (["worker", "--kafka-bootstrap=127.0.0.1:9"], "Redis")]
)
def test_a_role_started_away_from_its_stack_file_names_the_file_it_looked_for(
    argv: list[str], missing: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``stack up`` in the checkout, a role started in another directory: its stack file is relative to that one."""
    for variable in ("BATCHWIRE_STACK_ENV", "BATCHWIRE_KAFKA_BOOTSTRAP", "BATCHWIRE_REDIS_URL"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{missing} is not configured" in err, err
    assert f"no stack file at {tmp_path / '.batchwire' / 'stack.env'}" in err and "BATCHWIRE_STACK_ENV" in err, err


def test_a_stack_file_named_that_is_not_there_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("BATCHWIRE_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.setenv("BATCHWIRE_STACK_ENV", str(tmp_path / "typo.env"))
    assert main(["worker"]) == 2
    err = capsys.readouterr().err
    assert f"no stack file at {tmp_path / 'typo.env'} (BATCHWIRE_STACK_ENV)" in err, err


def test_a_refused_flag_names_no_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--port", "abc"])
    err = capsys.readouterr().err
    assert "argument --port: invalid int value: 'abc'\n" in err, err


def test_a_boolean_flag_takes_off() -> None:
    assert build_parser().parse_args(["gateway", "--admit-by-wait", "off"]).admit_by_wait is False


def test_a_boolean_flag_alone_turns_it_on() -> None:
    """As a switch is written: ``--trust-client-id``, followed by another flag or by nothing."""
    parsed = build_parser().parse_args(["up", "--trust-client-id", "--port", "8001"])
    assert parsed.trust_client_id is True and parsed.port == 8001
    assert build_parser().parse_args(["up", "--trust-client-id"]).trust_client_id is True
    assert build_parser().parse_args(["up"]).trust_client_id is False


def test_finite_numbers_still_parse() -> None:
    assert (
        build_parser().parse_args(["worker", "--credit-ttl-s", "2.5", "--drain-timeout-s", "1e1"]).credit_ttl_s == 2.5
    )


def test_a_negative_drain_timeout_is_refused_naming_the_variable() -> None:
    with pytest.raises(ValueError, match="BATCHWIRE_DRAIN_TIMEOUT_S"):
        WorkerSettings(drain_timeout_s=-1.0)
    assert WorkerSettings(drain_timeout_s=0.0).drain_timeout_s == 0.0, "0: the batch in hand goes back at once"


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["worker", "--sim-latency-ms=-1"], "--sim-latency-ms must be >= 0"),
        (["worker", "--max-batch=0"], "--max-batch (BATCHWIRE_MAX_BATCH) must be at least 1"),
        (["worker", "--hf-num-threads=0"], "--hf-num-threads (BATCHWIRE_HF_NUM_THREADS) must be at least 1"),
        (["worker", "--metrics-port=70000"], "--metrics-port must be within 0..65535"),
        (["worker", "--batch-partitions=0"], "--batch-partitions must be at least 1"),
        (["batcher", "--reserve-ms=-1"], "BATCHWIRE_RESERVE_MS"),
        (["worker", "--result-ttl-s=0"], "--result-ttl-s must be positive"),
        (["up", "--workers=0"], "workers must be at least 1 per model, got 0 (--workers / BATCHWIRE_WORKERS)"),
        (["up", "--result-ttl-s=3"], "--result-ttl-s (BATCHWIRE_RESULT_TTL_S) is 3 s, shorter than the longest"),
        (
            ["gateway", "--result-ttl-s=20", "--default-timeout-ms=5000", "--max-timeout-ms=25000"],
            "raise --result-ttl-s to at least 25 s",
        ),
        (["up", "--log-level=verbose"], "--log-level is 'verbose'; use debug, info, warning, error or critical"),
        (["worker", "--log-level=verbose"], "(BATCHWIRE_LOG_LEVEL)"),
        (["worker", "--batch-log=/nonexistent/batches.jsonl"], "cannot append to --batch-log /nonexistent/"),
        (["up", "--batch-log=/nonexistent/batches.jsonl"], "No such file or directory (BATCHWIRE_BATCH_LOG)"),
        (["worker", "--namespace="], "namespace '' must be one or more letters, digits, -, _ and ."),
        (["batcher", "--namespace=team a"], "namespace 'team a' must be"),
        (["batcher", "--max-batch=60000"], "--max-batch (BATCHWIRE_MAX_BATCH) is 60000; a batch holds at most"),
        (["batcher", "--kafka-bootstrap=127.0.0.1:abc"], "Kafka bootstrap address '127.0.0.1:abc' is not HOST:PORT"),
        (["worker", "--redis-url=redis://127.0.0.1:abc/0"], "the port must be a number from 1 to 65535"),
        (["worker", "--redis-url=redis://127.0.0.1:1/staging"], "the DB 'staging' must be a number"),
        (["batcher", "--tokenizer=/models/minilm"], "--tokenizer (BATCHWIRE_TOKENIZER) counts tokens for a token"),
        (["gateway", "--tokenizer=/models/minilm"], "--tokenizer (BATCHWIRE_TOKENIZER) counts tokens for a token"),
        (["gateway", "--max-batch-tokens=100", f"--tokenizer={__file__}"], "is not a tokenizer.json the tokenizers"),
        (["worker", "--deterministic-models=Sim"], "--deterministic-models names Sim, not among --models sim"),
        (["batcher", "--max-batch-tokens=100", f"--tokenizer={__file__}"], "is not a tokenizer.json the tokenizers"),
        (
            ["batcher", "--policy=classic", "--reserve-ms=20"],
            "--reserve-ms (BATCHWIRE_RESERVE_MS) is 20, and --policy (BATCHWIRE_POLICY) is classic",
        ),
        (
            ["worker", "--metrics-host=0.0.0.0"],
            "--metrics-host (BATCHWIRE_METRICS_HOST) is 0.0.0.0, and --metrics-port (BATCHWIRE_METRICS_PORT) is 0",
        ),
        (["batcher", "--metrics-host=0.0.0.0"], "which serves no /metrics: set the port, or leave the host unset"),
        (["batcher", "--models=sim,sim"], "models (BATCHWIRE_MODELS) lists a model twice: sim, sim"),
        (["worker", "--models=a,b,a"], "models (BATCHWIRE_MODELS) lists a model twice: a, b, a"),
        (
            ["up", "--models=minilm,gpt2", "--backend=hf", "--model-path=/models/minilm"],
            "batchwire up serves one hf model (one --model-path), and --models (BATCHWIRE_MODELS) names 2",
        ),
        # Past Kafka's cap a fresh namespace's topic is refused with Kafka's own words, naming no flag.
        (
            ["worker", "--batch-partitions=1000000"],
            "(BATCHWIRE_BATCH_PARTITIONS) is 1000000; it must be from 1 to 10,000",
        ),
        (
            ["batcher", "--request-partitions=20000"],
            "(BATCHWIRE_REQUEST_PARTITIONS) is 20000; it must be from 1 to 10,000",
        ),
    ],
)
def test_a_setting_that_cannot_work_stops_the_role_before_it_starts(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing listens here: a role that got past its settings would stop at Redis or Kafka instead.
    monkeypatch.setenv("BATCHWIRE_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setenv("BATCHWIRE_REDIS_URL", "redis://127.0.0.1:1/0")
    assert main([*argv, "--port=0"] if argv[0] == "up" else argv) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv", [["batcher", "--max-wait-ms=-1"], ["batcher", "--max-batch-tokens=-1"]])
def test_a_batching_value_refused_does_not_blame_the_policy(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The policy's name is right here: only an unknown one is told which names there are."""
    monkeypatch.setenv("BATCHWIRE_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setenv("BATCHWIRE_REDIS_URL", "redis://127.0.0.1:1/0")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "must be >= 0" in err and "--policy" not in err, err


def test_an_unknown_policy_is_told_the_names() -> None:
    args = build_parser().parse_args(["batcher", "--policy=fifo"])
    with pytest.raises(SettingsError, match=r"--policy \(BATCHWIRE_POLICY\) is 'fifo'; use work-conserving or classic"):
        rs.batcher_settings(args, 12)


def test_a_setting_at_its_default_is_not_refused_for_its_pair() -> None:
    args = build_parser().parse_args(["batcher", "--policy=classic", "--reserve-ms=0"])
    assert rs.batcher_settings(args, 12).policy.reserve_ms == 0.0
    serve_metrics(BATCHER_EXPORTS, 0, "127.0.0.1")  # the default host with no port: nothing to serve, nothing to refuse


def test_a_refusal_names_only_variables_that_exist(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHWIRE_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setenv("BATCHWIRE_REDIS_URL", "redis://127.0.0.1:1/0")
    assert main(["gateway", "--default-timeout-ms=0"]) == 2
    err = capsys.readouterr().err
    named = set(re.findall(r"BATCHWIRE_[A-Z_]+", err))
    unknown = {name for name in named if f"`{name}`" not in config_table()}
    assert not unknown, f"the message names variables that no flag reads ({unknown}): {err}"
    assert "--default-timeout-ms (BATCHWIRE_DEFAULT_TIMEOUT_MS) is 0; it must be at least 1" in err, err


@pytest.mark.parametrize("role", ["gateway", "up"])
def test_a_port_in_use_stops_the_role_before_anything_starts(
    role: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing listens here: a gateway that got past the port would stop at Redis instead.
    monkeypatch.setenv("BATCHWIRE_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setenv("BATCHWIRE_REDIS_URL", "redis://127.0.0.1:1/0")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main([role, "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: address already in use" in err and "BATCHWIRE_PORT" in err, err


@pytest.mark.parametrize(
    ("argv", "meant"),
    [
        (["--port", "8001", "gateway"], "batchwire gateway --port 8001"),
        (["--workers=2", "up", "--port", "8002"], "batchwire up --workers=2 --port 8002"),
        (["--duration-s", "5", "bench"], "batchwire bench --duration-s 5"),
        (["--namespace", "up", "gateway"], "batchwire gateway --namespace up"),
    ],
)
def test_options_before_the_command_are_refused_showing_where_they_go(
    argv: list[str], meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err == f"batchwire: options go after the command: {meant}\n"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["gateway", "--max-inflight=-3"], "--max-inflight (BATCHWIRE_MAX_INFLIGHT) is -3; it must be at least 1"),
        (["worker", "--credit-ttl-s=0.1"], "--credit-ttl-s must be above 0.5 s, got 0.1 (BATCHWIRE_CREDIT_TTL_S)"),
        (["up", "--hang-min-s=0"], "--hang-factor must be >= 0 (0: off) and --hang-min-s > 0"),
        (
            ["worker", "--models=a,b,a"],
            "models (BATCHWIRE_MODELS) lists a model twice: a, b, a; name each once (--models)",
        ),
    ],
)
def test_a_refused_setting_names_the_flag_beside_its_variable(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A setting's own check names its field and variable; the caller may have given the flag."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err, err


def test_a_field_name_inside_a_path_is_left_as_it_is() -> None:
    """A file named like a setting is the caller's, not the flag."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["up"]
    said = flags.with_flags("cannot append to /tmp/batch_log: denied (BATCHWIRE_BATCH_LOG)", sub)
    assert said == "cannot append to /tmp/batch_log: denied (--batch-log / BATCHWIRE_BATCH_LOG)", said


def test_every_log_level_flag_names_each_level_it_takes() -> None:
    """The help (and the configuration table made from it) lists what `check_level` accepts, no fewer."""
    parsers = [build_parser(), *(tool_parser(name) for name in TOOLS)]
    subs = [next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)) for p in parsers]
    helps = {
        command: action.help
        for sub in subs
        for command, parser in sub.choices.items()
        for action in parser._actions
        if "--log-level" in action.option_strings
    }
    assert {"up", "gateway", "batcher", "worker", "topics", "profile", "simulate", "plan"} <= set(helps), sorted(helps)
    for command, text in helps.items():
        named = set(re.findall(r"[a-z]+", str(text))) - {"or", "default"}
        assert named == set(logs.LEVELS), f"{command}: --log-level's help names {sorted(named)}; takes {logs.LEVELS}"


def test_python_m_batchwire_is_the_batchwire_command() -> None:
    """Where the environment's scripts folder is not on PATH, ``python -m batchwire`` runs the same command."""
    done = subprocess.run(
        [sys.executable, "-m", "batchwire", "stack", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: batchwire stack"), done.stdout


@pytest.mark.parametrize("argv", [["up"], ["stack", "status"]])
def test_ctrl_c_while_a_command_loads_ends_it_with_130_and_no_traceback(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in the second ``batchwire up`` spends importing its role (or a tool its module) ends it as
    Ctrl-C at any later moment does: exit 130, no 30-line traceback out of importlib."""

    def interrupted(name: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("batchwire.cli.importlib.import_module", interrupted)
    assert main(argv) == 130


def test_version_prints_the_installed_release_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    """What an operator asks first of a deployed binary (a bug report, a rolling upgrade's progress)."""
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"batchwire {importlib.metadata.version('batchwire')}"
