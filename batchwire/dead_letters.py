"""``batchwire dead-letters``: the inputs that workers set aside, one JSON object a line.

Dead letters are Avro, which Kafka's console consumer shows as bytes. This reads the namespace's
dead-letter topic outside any consumer group, committing nothing, so it can run beside a live deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from contextlib import aclosing
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from batchwire import flags
from batchwire.settings import SettingsError, SharedSettings
from schemas.deadletter import DeadLetter
from schemas.wire import Names
from transport.kafka.dead_letters import KafkaDeadLetterReader, NoDeadLetterTopic
from transport.ports import TransportError

EXIT_UNDECODABLE = 1
"""A record of the topic did not decode as a dead letter (logged with its partition and offset)."""


def _positive(text: str) -> int:
    if not (text.isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of letters, got {text!r}")
    return int(text)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``dead-letters``."""
    parser = sub.add_parser("dead-letters", help="the dead-letter topic's letters as JSON lines, oldest first")
    flags.field_flag(
        parser, SharedSettings, "namespace", str, "prefix of every topic and Redis key (isolates deployments)"
    )
    flags.add(parser, "--kafka-bootstrap", None, str, "Kafka bootstrap servers, HOST:PORT[,HOST:PORT]")
    parser.add_argument("--follow", action="store_true", help="keep printing new letters until SIGINT or SIGTERM")
    parser.add_argument("--limit", type=_positive, default=None, metavar="N", help="stop after N letters")


def run(args: argparse.Namespace) -> int:
    """0 once every letter there was at start is printed (``--follow``: at SIGINT or SIGTERM), 1 when a record
    did not decode (``--follow`` too), 2 when there is no topic to read or no broker answers."""
    shared = SharedSettings(namespace=args.namespace, kafka_bootstrap=args.kafka_bootstrap)
    try:
        bootstrap = shared.require_kafka()
    except SettingsError as err:
        if shared.kafka_bootstrap:  # configured, wrongly: the message names the form
            raise
        raise SettingsError(
            f"{err}. Embedded mode (`batchwire up`) has no dead-letter topic: its worker logs each dead-lettered "
            "task at ERROR, and keeps the letter in the process's memory only"
        ) from err
    try:
        return asyncio.run(_print_letters(bootstrap, shared.names, args.follow, args.limit))
    except NoDeadLetterTopic as err:
        raise SettingsError(
            f"{err}: a namespace's workers create it as they start over Kafka. Name the deployment's namespace with "
            "--namespace or BATCHWIRE_NAMESPACE, and its brokers with --kafka-bootstrap or BATCHWIRE_KAFKA_BOOTSTRAP"
        ) from err
    except TransportError as err:  # no broker answers
        raise SettingsError(
            f"{err}: check --kafka-bootstrap / BATCHWIRE_KAFKA_BOOTSTRAP, and that the brokers run"
        ) from err


async def _print_letters(bootstrap: str, names: Names, follow: bool, limit: int | None) -> int:
    reader = KafkaDeadLetterReader(bootstrap, names)
    try:
        await reader.start()
        printing = asyncio.create_task(_print(reader, follow, limit))
        loop = asyncio.get_running_loop()
        for stop in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(stop, printing.cancel)
        await asyncio.wait({printing})
    finally:
        await reader.close()
    if printing.cancelled() and not follow:
        return 130
    if not printing.cancelled():
        printing.result()  # its failure, if it failed
    if reader.undecodable:
        print(
            f"batchwire dead-letters: {reader.undecodable} record(s) of {reader.topic} did not decode", file=sys.stderr
        )
        return EXIT_UNDECODABLE
    return 0


async def _print(reader: KafkaDeadLetterReader, follow: bool, limit: int | None) -> None:
    printed = 0
    async with aclosing(reader.letters(follow=follow)) as letters:
        async for delivered in letters:
            if delivered.value is None:
                continue
            try:
                sys.stdout.write(json.dumps(as_json(delivered.value, delivered.partition, delivered.offset)) + "\n")
                sys.stdout.flush()
            except BrokenPipeError:  # the reader went away (`| head`): nothing is left to print to
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's own flush is quiet
                return
            printed += 1
            if printed == limit:
                return


def as_json(letter: DeadLetter, partition: int, offset: int) -> dict[str, Any]:
    """Every field of the letter, times as ISO-8601 UTC, with its Kafka partition and offset."""
    fields = _readable(asdict(letter))
    fields["items"] = [_readable(item) for item in fields["items"]]
    return {**fields, "partition": partition, "offset": offset}


def _readable(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with each time in ms since the epoch (``..._at_ms``) as ISO-8601 UTC, named without ``_ms``."""
    readable = {}
    for name, value in record.items():
        if name.endswith("_at_ms"):
            name, value = name.removesuffix("_ms"), _iso(value)
        readable[name] = value
    return readable


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")
