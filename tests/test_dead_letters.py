"""``batchwire dead-letters`` run as a process over a real broker: letters a worker's producer wrote come out as
JSON lines, and a namespace with nothing to read says what to change."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from batchwire.operations import ensure_role_topics
from batchwire.settings import SharedSettings
from infra.topic_checks import Durability
from infra.topics import BOOTSTRAP_TIMEOUT_S, BOOTSTRAP_WAIT
from schemas.deadletter import DeadLetter, DeadLetterItem
from schemas.wire import Names
from transport.kafka.dead_letters import KafkaDeadLetterReader
from transport.kafka.producers import KafkaDeadLetterProducer
from transport.ports import TransportError

pytestmark = pytest.mark.timeout(120)

AT_MS = 1_796_000_000_123  # 2026-11-30T00:53:20.123 UTC
FIRST = DeadLetter(
    batch_id="batch-1",
    model="sim",
    batcher_id="batcher-a",
    worker_id="worker-0",
    deliveries=3,
    error="the worker process died 3 times with this input in flight",
    dead_lettered_at_ms=AT_MS,
    items=(DeadLetterItem("task-1", "poison ☠", AT_MS - 2_000, 3, reply_to="gw-1"),),
)
SECOND = DeadLetter(
    "batch-2", "sim", "batcher-b", "worker-1", 4, "killed", AT_MS + 1, (DeadLetterItem("t2", "x", 7, 4),)
)


def environment(tmp_path: Path, **variables: str) -> dict[str, str]:
    """The test's environment without the developer's BATCHWIRE_* settings or stack file, plus ``variables``."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("BATCHWIRE_")}
    return {**env, "BATCHWIRE_STACK_ENV": str(tmp_path / "no-stack.env"), **variables}


async def dead_letters(env: dict[str, str], *args: str) -> tuple[int, list[dict[str, Any]], str]:
    """Runs ``batchwire dead-letters ARGS``: its exit status, its stdout as JSON lines, its stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "batchwire.cli",
        "dead-letters",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, [json.loads(line) for line in out.decode().splitlines()], err.decode()


async def send(bootstrap: str, names: Names, *letters: DeadLetter) -> None:
    """Sends ``letters`` as a worker does, creating the topic first as a worker does at start."""
    shared = SharedSettings(namespace=names.namespace, kafka_bootstrap=bootstrap)
    await ensure_role_topics(shared, Durability(1, 1), False, (), dead_letters=True)
    producer = KafkaDeadLetterProducer(bootstrap, names)
    await producer.start()
    try:
        for letter in letters:
            await producer.send(letter)
    finally:
        await producer.close()


async def following(env: dict[str, str], stdout: int = asyncio.subprocess.PIPE) -> asyncio.subprocess.Process:
    """``batchwire dead-letters --follow`` as a process of its own, its stderr piped."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "batchwire.cli",
        "dead-letters",
        "--follow",
        env=env,
        stdout=stdout,
        stderr=asyncio.subprocess.PIPE,
    )


async def send_a_bad_record_between(bootstrap: str, names: Names) -> None:
    """``FIRST``, bytes that are no letter, ``SECOND``: offsets 0, 1 and 2 of partition 0."""
    await send(bootstrap, names, FIRST)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(names.dead_letter_topic, b"not avro", partition=0)
    finally:
        await producer.stop()
    await send(bootstrap, names, SECOND)


async def test_each_letter_prints_as_one_json_line_then_the_command_exits_0(
    infra: Any, names: Names, tmp_path: Path
) -> None:
    await send(infra.kafka_bootstrap, names, FIRST, SECOND)
    env = environment(tmp_path, BATCHWIRE_KAFKA_BOOTSTRAP=infra.kafka_bootstrap)

    code, lines, err = await dead_letters(env, "--namespace", names.namespace)

    assert code == 0, err
    assert lines[0] == {
        "batch_id": "batch-1",
        "model": "sim",
        "batcher_id": "batcher-a",
        "worker_id": "worker-0",
        "deliveries": 3,
        "error": "the worker process died 3 times with this input in flight",
        "dead_lettered_at": "2026-11-30T00:53:20.123+00:00",
        "items": [
            {
                "task_id": "task-1",
                "input": "poison ☠",
                "enqueued_at": "2026-11-30T00:53:18.123+00:00",
                "strikes": 3,
                "reply_to": "gw-1",
            }
        ],
        "partition": 0,
        "offset": 0,
    }, lines
    assert len(lines) == 2, f"expected the two letters sent, got {lines}"
    assert (lines[1]["batch_id"], lines[1]["deliveries"], lines[1]["offset"]) == ("batch-2", 4, 1), lines[1]
    assert lines[1]["items"][0]["enqueued_at"] == "1970-01-01T00:00:00.007+00:00", lines[1]


async def test_limit_stops_after_that_many_letters(infra: Any, names: Names, tmp_path: Path) -> None:
    await send(infra.kafka_bootstrap, names, FIRST, SECOND)
    env = environment(tmp_path)

    code, lines, err = await dead_letters(
        env, "--namespace", names.namespace, "--kafka-bootstrap", infra.kafka_bootstrap, "--limit", "1"
    )

    assert code == 0, err
    assert [line["batch_id"] for line in lines] == ["batch-1"], lines


async def test_follow_prints_letters_sent_after_it_started_until_sigterm(
    infra: Any, names: Names, tmp_path: Path
) -> None:
    await send(infra.kafka_bootstrap, names, FIRST)
    env = environment(tmp_path, BATCHWIRE_KAFKA_BOOTSTRAP=infra.kafka_bootstrap, BATCHWIRE_NAMESPACE=names.namespace)
    process = await following(env)
    assert process.stdout is not None and process.stderr is not None
    try:
        async with asyncio.timeout(60):
            first = json.loads(await process.stdout.readline() or b"null")
            assert first is not None and first["batch_id"] == "batch-1", (first, await process.stderr.read())
            await send(infra.kafka_bootstrap, names, SECOND)
            second = json.loads(await process.stdout.readline() or b"null")
            assert second is not None and second["batch_id"] == "batch-2", "a letter sent while it follows is printed"
            assert process.returncode is None, "--follow keeps reading past the letters there were at start"
    finally:
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            code = await process.wait()
    assert code == 0, await process.stderr.read()


async def test_a_record_that_is_no_letter_is_logged_the_rest_printed_and_the_command_exits_1(
    infra: Any, names: Names, tmp_path: Path
) -> None:
    await send_a_bad_record_between(infra.kafka_bootstrap, names)
    env = environment(tmp_path, BATCHWIRE_KAFKA_BOOTSTRAP=infra.kafka_bootstrap)

    code, lines, err = await dead_letters(env, "--namespace", names.namespace)

    assert code == 1, err
    assert [(line["batch_id"], line["offset"]) for line in lines] == [("batch-1", 0), ("batch-2", 2)], lines
    assert "partition 0 offset 1" in err, f"the log names where the undecodable record is: {err}"


async def test_following_a_record_that_is_no_letter_exits_1_at_sigterm(
    infra: Any, names: Names, tmp_path: Path
) -> None:
    """``--follow`` ends at a signal, and still says with its status that a record did not decode."""
    await send_a_bad_record_between(infra.kafka_bootstrap, names)
    env = environment(tmp_path, BATCHWIRE_KAFKA_BOOTSTRAP=infra.kafka_bootstrap, BATCHWIRE_NAMESPACE=names.namespace)
    process = await following(env)
    assert process.stdout is not None and process.stderr is not None
    try:
        async with asyncio.timeout(60):
            lines = [json.loads(await process.stdout.readline() or b"null") for _ in range(2)]
        # the letter after the bad record is printed: the bad record was read before it
        assert [line and line["offset"] for line in lines] == [0, 2], lines
    finally:
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            code = await process.wait()
    err = (await process.stderr.read()).decode()
    assert code == 1, f"exit {code}: {err}"
    assert "1 record(s) of" in err and "did not decode" in err, err


async def test_a_namespace_without_the_topic_exits_2_naming_what_to_set(
    infra: Any, names: Names, tmp_path: Path
) -> None:
    env = environment(tmp_path, BATCHWIRE_KAFKA_BOOTSTRAP=infra.kafka_bootstrap)

    code, lines, err = await dead_letters(env, "--namespace", names.namespace)

    assert (code, lines) == (2, []), err
    assert f"batchwire dead-letters: there is no topic {names.dead_letter_topic} at {infra.kafka_bootstrap}" in err, err
    assert "--namespace or BATCHWIRE_NAMESPACE" in err, err


async def test_without_kafka_it_exits_2_saying_embedded_mode_has_no_topic(tmp_path: Path) -> None:
    code, lines, err = await dead_letters(environment(tmp_path))

    assert (code, lines) == (2, []), err
    assert "batchwire dead-letters: Kafka is not configured: pass --kafka-bootstrap" in err, err
    assert "Embedded mode (`batchwire up`) has no dead-letter topic" in err, err


async def test_a_malformed_bootstrap_exits_2_naming_the_form_and_not_embedded_mode(tmp_path: Path) -> None:
    """Kafka is configured, wrongly: the embedded-mode advice (no topic there) sent the reader the wrong way."""
    code, lines, err = await dead_letters(environment(tmp_path, BATCHWIRE_KAFKA_BOOTSTRAP="127.0.0.1:x"))

    assert (code, lines) == (2, []), err
    assert "Kafka bootstrap address '127.0.0.1:x' is not HOST:PORT" in err, err
    assert "Embedded mode" not in err, err


@pytest.mark.slow  # it waits the bootstrap's whole wait
async def test_a_bootstrap_that_never_answers_exits_2_once_the_wait_is_over(silent_port: int, tmp_path: Path) -> None:
    """Not at the Kafka client's request timeout (40 s)."""
    env = environment(tmp_path, BATCHWIRE_KAFKA_BOOTSTRAP=f"127.0.0.1:{silent_port}")
    started = time.monotonic()

    code, lines, err = await dead_letters(env)

    assert (code, lines) == (2, []), err
    assert BOOTSTRAP_WAIT in err, err
    assert "check --kafka-bootstrap / BATCHWIRE_KAFKA_BOOTSTRAP" in err, err
    assert time.monotonic() - started < BOOTSTRAP_TIMEOUT_S + 10


async def test_a_reader_that_goes_away_ends_the_command_quietly(infra: Any, names: Names, tmp_path: Path) -> None:
    """A reader that closes the pipe (``| head -1``): the next letter ends the command with 0, no traceback."""
    await send(infra.kafka_bootstrap, names, FIRST)
    env = environment(tmp_path, BATCHWIRE_KAFKA_BOOTSTRAP=infra.kafka_bootstrap, BATCHWIRE_NAMESPACE=names.namespace)
    read_end, write_end = os.pipe()
    process = await following(env, stdout=write_end)
    os.close(write_end)
    assert process.stderr is not None
    try:
        with os.fdopen(read_end, "rb") as reader:
            first = await asyncio.wait_for(asyncio.to_thread(reader.readline), 60)
        assert json.loads(first or b"null")["batch_id"] == "batch-1", first
        await send(infra.kafka_bootstrap, names, SECOND)  # written into the closed pipe
        async with asyncio.timeout(60):
            code = await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    err = (await process.stderr.read()).decode()
    assert code == 0, err
    assert "Traceback" not in err, err


async def test_a_read_to_the_ends_that_stalls_fails_rather_than_waiting_for_ever(infra: Any, names: Names) -> None:
    """As when the brokers go away mid-read: the consumer retries them for ever, and records stop coming."""
    await send(infra.kafka_bootstrap, names, FIRST)
    reader = KafkaDeadLetterReader(infra.kafka_bootstrap, names, stall_s=1.0)
    await reader.start()
    try:
        reader._ends = {tp: end + 1 for tp, end in reader._ends.items()}  # one more than will ever come
        read: list[str] = []

        async def read_all() -> None:
            async for delivered in reader.letters(follow=False):
                read.append(delivered.value.batch_id if delivered.value else "?")

        with pytest.raises(TransportError, match=r"no record came for 1 s, with 1 partition\(s\) not read"):
            await asyncio.wait_for(read_all(), 30)
        assert read == ["batch-1"], "what came is read first"
    finally:
        await reader.close()
