"""``batchwire bench --mix``: parsing streams, their bodies, the started system's models, a run per stream."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from batchwire.bench.mix import mix_run, mix_table
from batchwire.bench.runner import LoadConfig, Target
from batchwire.bench.schedule import InputFactory
from batchwire.bench.streams import Stream, mix_models, parse_mix
from batchwire.bench.sut import SutSpec, plan
from tests.support.fake_inference_server import Behaviour, FakeServer


def test_a_mix_parses_into_streams_with_model_tier_and_rate() -> None:
    assert parse_mix("high:200,low:6000") == [Stream(None, "high", 200.0), Stream(None, "low", 6000.0)]
    assert parse_mix("a/normal:6000, b/normal:1000") == [Stream("a", "normal", 6000.0), Stream("b", "normal", 1000.0)]
    assert mix_models([parse_mix("a/low:1,high:2"), parse_mix("b/high:3,a/low:4")]) == ("a", "b")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("urgent:5", "tier one of high, normal, low"),
        ("high:fast", "not a number"),
        ("low:0", "above 0"),
        (",", "at least one stream"),
    ],
)
def test_a_bad_stream_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_mix(text)


def test_a_streams_bodies_carry_its_model_and_tier() -> None:
    inputs = InputFactory(12, random.Random(1), "input", "n", {"priority": "low", "model": "b"})
    text, body = inputs.next()
    assert json.loads(body) == {"input": text, "priority": "low", "model": "b"}
    plain_text, plain = InputFactory(12, random.Random(1)).next()
    assert json.loads(plain) == {"input": plain_text}


def test_two_models_get_their_own_workers_and_every_role_serves_both(tmp_path: Path) -> None:
    spec = SutSpec(mode="kafka", policy="work-conserving", workers=2, models=("a", "b"), gateway_args=("--x", "1"))
    argvs = [role.argv for role in plan(spec, ["bw"], "nsx", tmp_path).roles]
    workers = [argv for argv in argvs if argv[1] == "worker"]
    assert [argv[argv.index("--model") + 1] for argv in workers] == ["a", "a", "b", "b"]
    assert all(argv[argv.index("--models") + 1] == "a,b" for argv in argvs)
    gateway = next(argv for argv in argvs if argv[1] == "gateway")
    assert gateway[gateway.index("--x") + 1] == "1"
    assert all(argv[-2:] == ["--namespace", "nsx"] for argv in argvs)
    (embedded,) = plan(SutSpec(mode="embedded", policy="classic", models=("a", "b")), ["bw"], "-", tmp_path).roles
    assert embedded.argv[embedded.argv.index("--models") + 1] == "a,b"


@pytest.fixture
def behaviour() -> Behaviour:
    return Behaviour(delay_s=0.01, script=("200", "503"))


async def test_each_stream_is_counted_apart(fake: FakeServer) -> None:
    load = LoadConfig(rates_rps=(), duration_s=1.0, warmup_s=0.2, pause_s=0.0, lone_count=0)
    lines: list[str] = []
    (report,) = await mix_run(load, Target((fake.url,)), [parse_mix("high:20,low:40")], lines.append)
    high, low = report["streams"]
    assert (high["stream"], low["stream"]) == ("high", "low")
    for stream in (high, low):
        assert stream["sent"] > 0
        assert stream["ok"] + stream["refused"] == stream["sent"], f"every send is an answer or a refusal: {stream}"
    assert low["sent"] > high["sent"], "the low stream is offered twice the rate"
    assert any(line.startswith("low") for line in mix_table(report["streams"]))
