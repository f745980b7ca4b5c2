"""``batchwire bench`` end to end through ``main()``: table, results.json, plots, --compare, usage errors."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
from pathlib import Path

import pytest

from batchwire.bench.cli import main
from batchwire.bench.results import SCHEMA
from tests.support.fake_inference_server import Behaviour, FakeServer

pytestmark = pytest.mark.slow

RATE_KEYS = {
    "offered_rps",
    "window_s",
    "warmup_s",
    "scheduled",
    "sent",
    "ok",
    "errors",
    "error_total",
    "unfinished",
    "warmup_sent",
    "answers_in_window",
    "throughput_rps",
    "drained_answers",
    "drain_s",
    "latency_ms",
    "latency_all_ms",
    "latency_hdr",
    "latency_by_second_ms",
    "lag_ms",
    "sends",
    "warmup_sends",
    "calls",
    "refused_ms",
    "refused_from_send_ms",
    "after_504",
    "generator",
    "server",
    "processes",
    "notes",
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One real run (two rates) against a fake server, shared by the tests that only read its output."""
    server = FakeServer(Behaviour(delay_s=0.05, fail_every=10)).start()
    out = tmp_path_factory.mktemp("bench")
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            status = main(
                [
                    "--url",
                    server.url,
                    "--rate",
                    "20,60",
                    "--duration",
                    "1",
                    "--warmup",
                    "0.2",
                    "--pause",
                    "0",
                    "--check",
                    "--out",
                    str(out),
                    "--label",
                    "fake",
                    "--seed",
                    "5",
                    "--backend-latency-ms",
                    "50",
                    "--lone",
                    "3",
                    "--lone-gap-ms",
                    "10",
                    "--warm",
                    "4",
                ]
            )
    finally:
        server.stop()
    assert status == 0
    return out, printed.getvalue()


def test_table_lists_every_rate_and_the_errors(finished_run: tuple[Path, str]) -> None:
    _, printed = finished_run
    assert "== fake" in printed
    for column in ("p50", "p99.9", "lag99", "batch", "µs/req"):
        assert column in printed
    assert "20/s errors: http_503=" in printed
    assert "60/s flushes: full=" in printed


def test_results_json_has_config_metadata_and_every_rate(finished_run: tuple[Path, str]) -> None:
    out, _ = finished_run
    document = json.loads((out / "results.json").read_text())
    assert document["schema"] == SCHEMA
    assert document["label"] == "fake"
    assert document["config"]["rate"] == [20.0, 60.0]
    assert document["config"]["check"] is True
    assert {"git_commit", "cpu_count", "started_at", "finished_at", "python"} <= set(document["metadata"])
    (run,) = document["runs"]
    assert [rate["offered_rps"] for rate in run["rates"]] == [20.0, 60.0]
    for rate in run["rates"]:
        assert set(rate) == RATE_KEYS
        assert {"p50", "p90", "p95", "p99", "p99.9", "max", "count"} <= set(rate["latency_ms"])
        assert {"p50", "p99", "max"} <= set(rate["lag_ms"])
        assert {"p50", "p99", "max", "count"} <= set(rate["refused_ms"]), "the fake's 503s are refusals"
        assert rate["after_504"] == {
            "answered": 0,
            "without_task_id": 0,
            "statuses": {},
            "computed": 0,
            "share_of_computed": 0.0,
        }
        assert rate["latency_hdr"], "the encoded HDR histogram is kept for later analysis"
        (second,) = rate["latency_by_second_ms"]  # a 1 s window
        assert second >= 50.0, "each second's mean latency, and the fake answers after 50 ms"
        assert rate["server"]["batch_size_mean"] == pytest.approx(2.0)
        assert set(rate["generator"]) == {"cpu_s", "cores", "us_per_request", "max_outstanding", "event_loop", "client"}


def test_the_lone_probe_is_in_the_json_and_the_table(finished_run: tuple[Path, str]) -> None:
    out, printed = finished_run
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    lone = run["lone"]
    assert (lone["count"], lone["gap_ms"]) == (3, 10.0)
    assert lone["ok"] + sum(lone["errors"].values()) == 3
    assert lone["latency_ms"]["p50"] >= 50.0, "the fake answers after 50 ms"
    assert "lone requests (3 one at a time, 10 ms idle before each): p50 " in printed
    warm = run["warm"]
    assert (warm["count"], warm["gap_ms"]) == (4, 0.0), "the warm probe sends each the moment the last is answered"
    assert warm["ok"] + sum(warm["errors"].values()) == 4
    assert warm["latency_ms"]["p50"] >= 50.0, "the fake answers after 50 ms"
    assert "warm requests (4 one at a time, 0 ms idle before each): p50 " in printed
    for probe in (lone, warm):  # the fake counts 50 ms of busy time per call (every second request)
        assert probe["call_ms"] == pytest.approx(50.0), "the backend's time per call while the probe ran"
        assert probe["stages_ms"] == {
            "sealed_to_started_ms_mean": pytest.approx(2.0),
            "call_ms_mean": pytest.approx(50.0),
        }, "the fake counts 2 ms from sealing to the call and the whole call for each input of a batch"


def test_plots_are_png_files(finished_run: tuple[Path, str]) -> None:
    out, _ = finished_run
    for name in ("latency.png", "throughput.png", "batch_sizes.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n"), f"{name} is not a PNG"
        assert len(data) > 5000, f"{name} has {len(data)} bytes: nothing drawn?"


def test_compare_prints_ratios(
    finished_run: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = finished_run
    document = json.loads((out / "results.json").read_text())
    slower = copy.deepcopy(document)
    slower["runs"][0]["label"] = "slower"
    for rate_a, rate_b in zip(document["runs"][0]["rates"], slower["runs"][0]["rates"], strict=True):
        rate_b["latency_ms"]["p99"] = 2 * rate_a["latency_ms"]["p99"]
    (tmp_path / "b.json").write_text(json.dumps(slower))
    assert main(["--compare", str(out / "results.json"), str(tmp_path / "b.json")]) == 0
    printed = capsys.readouterr().out
    assert "B = slower" in printed
    assert "p99 B/A" not in printed  # one ratio column per metric, headed B/A
    assert printed.count("2.00x") == 2, f"both rates should show p99 doubled:\n{printed}"
    assert "1.00x" in printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--duration", "1"], "--rate is required"),
        (["--rate", "10", "--policies", "classic,work-conserving"], "--policies needs --start"),
        (["--rate", "10", "--gateways", "2"], "need --start kafka"),
        (["--rate", "10", "--start", "embedded", "--url", "http://x/"], "exclude each other"),
        (["--rate", "10", "--start", "embedded", "--brokers", "3"], "--brokers needs --start kafka"),
        (["--rate", "10", "--start", "kafka", "--redis-replicas", "1"], "--redis-replicas needs --brokers"),
        (["--rate", "10", "--lone", "-1"], "--lone, --lone-gap-ms and --warm must be 0 or more"),
        (["--rate", "10", "--warm", "-1"], "--lone, --lone-gap-ms and --warm must be 0 or more"),
        (["--rate", "10", "--start", "echo", "--sut-args", "--x 'a"], '--sut-args "--x \'a": No closing quotation'),
        (["--rate", "10", "--url", "http://h:99999/v1/inference"], "--url http://h:99999/v1/inference: Port out of"),
        (["--rate", "10", "--url", "localhost:8000/v1/inference"], "--url localhost:8000/v1/inference: not an http://"),
        (["--rate", "10", "--metrics-url", "http://h:x/metrics"], "--metrics-url http://h:x/metrics: Invalid URL"),
        (["--rate", "10", "--redis-url", "127.0.0.1:6379"], "--redis-url 127.0.0.1:6379: the scheme must be one of"),
    ],
)
def test_usage_errors_say_which_flag(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_an_out_folder_that_cannot_be_made_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "results"
    argv = ["--rate", "10", "--duration", "1", "--lone", "0", "--warm", "0", "--no-metrics"]
    assert main([*argv, "--url", "http://127.0.0.1:1/v1/inference", "--out", str(out)]) == 2
    assert f"--out {out}: Not a directory" in capsys.readouterr().err


def test_a_run_with_no_request_answered_exits_1_saying_why(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--rate", "10", "--duration", "1", "--warmup", "0", "--lone", "0", "--warm", "0", "--no-metrics"]
    assert main([*argv, "--url", "http://127.0.0.1:1/v1/inference"]) == 1
    captured = capsys.readouterr()
    assert "rate/s" in captured.out, f"the table should still be printed:\n{captured.out}"
    assert "batchwire bench: no request was answered (connection=" in captured.err, captured.err


def test_wrong_answers_under_check_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    server = FakeServer(Behaviour(wrong_every=3)).start()
    argv = ["--rate", "20", "--duration", "1", "--warmup", "0", "--lone", "0", "--warm", "0", "--no-metrics"]
    try:
        status = main([*argv, "--url", server.url, "--check"])
    finally:
        server.stop()
    err = capsys.readouterr().err
    assert status == 1, f"expected exit 1 for wrong answers, got {status}:\n{err}"
    assert "answers were wrong (--check / --expect reverse)" in err, err


def test_compare_refuses_other_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "x.json"
    other.write_text("{}")
    assert main(["--compare", str(other), str(other)]) == 2
    assert "not a batchwire bench result" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--rate=nan"], "argument --rate: expected positive finite numbers, got 'nan'"),
        (["--rate=10,inf"], "argument --rate: expected positive finite numbers"),
        (["--rate=10", "--duration=nan"], "argument --duration: expected a finite number, got 'nan'"),
    ],
)
def test_a_rate_or_duration_that_is_not_a_finite_number_is_refused(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(flags)
    assert exited.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--gateways", "0"], ["--batchers", "0"], ["--workers", "0"], ["--workers", "-1"]])
def test_a_started_system_with_no_process_of_a_role_is_refused_before_it_starts(argv: list[str]) -> None:
    """Checked alone (no system is started): with no gateway the load had no URL to go to (a ZeroDivisionError
    once Kafka and the roles were up), with no batcher or worker nothing answered until --ready-timeout."""
    from batchwire.bench.cli import build_parser
    from batchwire.bench.command import UsageError, _load_config

    args = build_parser().parse_args(["--rate", "10", "--start", "kafka", *argv])
    with pytest.raises(UsageError, match=f"{argv[0]} must be 1 or more"):
        _load_config(args)


@pytest.mark.parametrize("flags", [["--pids=-1"], ["--redis-pids=0"], ["--kafka-pids=,"]])
def test_a_pid_below_1_is_refused_naming_its_flag(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A negative pid raised a bare ValueError (psutil) as the first window opened; 0, or none, counted nothing."""
    with pytest.raises(SystemExit) as exited:
        main(["--rate=10", *flags])
    flag = flags[0].partition("=")[0]
    assert exited.value.code == 2 and f"argument {flag}: expected process ids (1 or more)" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--pids", "--kafka-pids", "--redis-pids"])
def test_a_pid_of_no_process_is_refused_before_the_run(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Sampled silently, it showed as a group using no CPU at all (0 µs per request)."""
    beyond = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process can have it
    argv = ["--rate", "10", "--duration", "1", "--no-metrics", "--url", "http://127.0.0.1:1/v1/inference"]
    assert main([*argv, flag, f"1,{beyond}"]) == 2
    assert f"{flag}: no process {beyond} runs here" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--start", "kafka", "--pids", "1"], "--pids counts a server given by --url"),
        (["--start", "embedded", "--redis-pids", "1"], "--start embedded runs neither"),
        (["--start", "echo", "--kafka-pids", "1"], "--start echo runs neither"),
    ],
)
def test_pids_the_started_system_would_not_count_are_refused(argv: list[str], said: str) -> None:
    """They were ignored: the run counted the processes it started, and said nothing of the pids given."""
    from batchwire.bench.cli import build_parser
    from batchwire.bench.command import UsageError, _load_config

    with pytest.raises(UsageError, match=said):
        _load_config(build_parser().parse_args(["--rate", "10", *argv]))


def test_a_redis_url_that_does_not_answer_is_noted_on_each_rate(
    fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Redis that could not be read left the commands out of results.json without a word."""
    argv = ["--rate", "20", "--duration", "0.5", "--warmup", "0", "--lone", "0", "--warm", "0", "--no-metrics"]
    assert main([*argv, "--url", fake.url, "--redis-url", "redis://:secret@127.0.0.1:1/0", "--out", str(tmp_path)]) == 0
    rate = json.loads((tmp_path / "results.json").read_text())["runs"][0]["rates"][0]
    assert "redis_commands" not in rate
    said = [note for note in rate["notes"] if "did not answer INFO" in note]
    assert said and "secret" not in said[0], f"expected a note on the unread Redis, password hidden: {rate['notes']}"
    assert "did not answer INFO" in capsys.readouterr().out, "the table's notes should say it too"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--rate", "0.001,1000", "--duration", "1e9"], "--rate 1000 over --warmup 2 + --duration 1e+09 s"),
        (["--rate", "200000", "--duration", "60", "--warmup", "0"], "--rate 200000 over --warmup 0 + --duration 60 s"),
        (["--mix", "high:10,low:5000", "--duration", "1e6"], "--mix high:10,low:5000 over --warmup 2 + --duration"),
    ],
)
def test_a_schedule_too_long_to_hold_is_refused_before_it_starts(argv: list[str], said: str) -> None:
    """Each send's time is drawn before the first send, and each answer kept: ``--duration 1e9`` grew the
    generator to all the machine's memory before it sent anything, deaf to Ctrl-C and SIGTERM, until the
    kernel killed it."""
    from batchwire.bench.cli import build_parser
    from batchwire.bench.command import UsageError, _load_config

    with pytest.raises(UsageError, match=re.escape(said)):
        _load_config(build_parser().parse_args(argv))


def test_the_longest_schedule_the_bench_holds_is_accepted() -> None:
    from batchwire.bench.cli import build_parser
    from batchwire.bench.command import MAX_SENDS_PER_RATE, _load_config

    rate = MAX_SENDS_PER_RATE / 100
    assert _load_config(build_parser().parse_args(["--rate", f"{rate:g}", "--duration", "98", "--warmup", "2"]))


def test_compare_of_a_result_that_lacks_a_field_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file of the right schema cut short (a run without its rates) ended the command in a KeyError traceback."""
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"schema": SCHEMA, "runs": [{"label": "cut"}]}))
    assert main(["--compare", str(short), str(short)]) == 2
    err = capsys.readouterr().err
    assert "lacks 'rates'" in err and "Traceback" not in err, err
