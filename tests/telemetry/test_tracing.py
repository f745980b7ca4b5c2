"""The tracing switch and the W3C trace context: off costs nothing, a bad context starts a new trace."""

from __future__ import annotations

import subprocess
import sys

import pytest

from batchwire import cli
from telemetry import tracing
from telemetry.tracing import TracingError
from tests.support.otlp_receiver import OtlpReceiver

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (VALID, (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1)),
        (VALID.upper(), (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1)),
        (None, None),
        ("", None),
        ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),  # a version this code does not know
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),  # the all-zero trace id is invalid
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", None),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", None),
        ("garbage", None),
    ],
)
def test_parse_takes_only_well_formed_version_00_contexts(header: str | None, expected: object) -> None:
    assert tracing.parse(header) == expected


def test_trace_id_of_names_the_trace_for_log_lines() -> None:
    assert tracing.trace_id_of(VALID) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert tracing.trace_id_of("nonsense") is None


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("http://collector:4318", "http://collector:4318/v1/traces"),
        ("http://collector:4318/", "http://collector:4318/v1/traces"),
        ("https://collector/v1/traces", "https://collector/v1/traces"),
    ],
)
def test_a_base_url_gets_the_traces_path(endpoint: str, url: str) -> None:
    assert tracing.traces_url(endpoint) == url


def test_an_endpoint_that_is_not_a_url_names_the_flag() -> None:
    with pytest.raises(TracingError, match=r"--otlp-endpoint.*BATCHWIRE_OTLP_ENDPOINT"):
        tracing.traces_url("collector:4318")


def test_with_no_endpoint_nothing_is_set_up() -> None:
    tracing.configure(None, "batchwire")
    tracing.configure("", "batchwire")
    assert not tracing.ACTIVE
    assert tracing.provider() is None


def test_with_no_endpoint_no_sdk_is_loaded_by_any_role() -> None:
    """A fresh interpreter wires every role's modules and the CLI's set-up with no endpoint, and has
    imported neither the tracing SDK nor an exporter, and set no tracer provider. (redis-py imports
    the metrics SDK when it is installed, for its own opt-in metrics.)"""
    probe = (
        "import sys\n"
        "from batchwire import cli, roles, embedded\n"
        "from telemetry import tracing, logs\n"
        "args = cli.build_parser().parse_args(['up'])\n"
        "assert args.otlp_endpoint is None, args.otlp_endpoint\n"
        "tracing.configure(args.otlp_endpoint, 'batchwire')\n"
        "logs.configure('info', args.log_format)\n"
        "tracer_modules = ('opentelemetry.sdk.trace', 'opentelemetry.exporter')\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(tracer_modules))\n"
        "assert not loaded and tracing.provider() is None and not tracing.ACTIVE, loaded\n"
        "api = sys.modules.get('opentelemetry.trace')\n"
        "assert api is None or type(api.get_tracer_provider()).__name__ == 'ProxyTracerProvider'\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr


def test_configure_with_an_exporter_turns_tracing_on_and_shutdown_off() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.configure(None, "batchwire-test", exporter=exporter)
    try:
        assert tracing.ACTIVE
        context = tracing.record("step", VALID, 1_000, 2_000)
        assert tracing.trace_id_of(context) == "4bf92f3577b34da6a3ce929d0e0e4736", "a child of the caller's span"
    finally:
        tracing.shutdown()
    assert not tracing.ACTIVE and tracing.provider() is None
    (span,) = exporter.get_finished_spans()
    assert (span.name, span.start_time, span.end_time) == ("step", 1_000, 2_000)
    assert span.parent is not None and span.parent.span_id == 0x00F067AA0BA902B7


def test_spans_go_over_otlp_http_to_the_endpoint() -> None:
    receiver = OtlpReceiver().start()
    try:
        tracing.configure(receiver.url, "batchwire-test")
        try:
            tracing.record("step", VALID, 1_000, 2_000, attributes={"task.id": "t1"})
        finally:
            tracing.shutdown()  # exports what the batch processor still holds
    finally:
        receiver.stop()
    (span,) = receiver.spans()
    assert (span.name, span.service, span.trace_id) == ("step", "batchwire-test", "4bf92f3577b34da6a3ce929d0e0e4736")
    assert (span.start_ns, span.end_ns, span.attributes) == (1_000, 2_000, {"task.id": "t1"})
    assert not receiver.refused


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--otlp-endpoint", "collector:4318"], "--otlp-endpoint 'collector:4318' is not an http(s) URL"),
        (["--log-format", "xml"], "--log-format is 'xml'; use text or json"),
        (
            ["--otlp-endpoint", "http://127.0.0.1:9/", "--trace-sample-ratio", "1.5"],
            "--trace-sample-ratio is 1.5; give a share from 0 to 1",
        ),
        # without an endpoint too: not first refused once an endpoint is added
        (["--trace-sample-ratio", "2"], "--trace-sample-ratio is 2.0; give a share from 0 to 1"),
    ],
)
def test_a_wrong_observability_flag_stops_the_role_before_it_starts(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["up", *flags]) == 2
    assert message in capsys.readouterr().err
    assert not tracing.ACTIVE


def test_a_sample_ratio_of_zero_records_no_new_trace_but_follows_a_callers_sampled_one() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.configure(None, "batchwire-test", sample_ratio=0.0, exporter=exporter)
    try:
        unsampled = tracing.record("new", None, 1_000, 2_000)
        child = tracing.record("child", unsampled, 2_000, 3_000)
        followed = tracing.record("followed", VALID, 1_000, 2_000)
    finally:
        tracing.shutdown()
    assert not tracing.sampled(unsampled) and not tracing.sampled(child), "the decision travels in the context"
    assert tracing.sampled(followed)
    assert [span.name for span in exporter.get_finished_spans()] == ["followed"]
