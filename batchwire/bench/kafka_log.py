"""Kafka records and bytes per request, read from the brokers' own logs on disk.

A broker appends each produced record batch to its partition's segment file (``*.log`` in the
partition's folder of its ``log.dirs``) in the v2 format: a 61-byte header that holds the batch's
length and its record count, then the records. Walking the batch headers appended between the
window's bounds counts every record and byte any role wrote (requests, batches, dead letters,
consumer offsets), as the broker stores them, compression and framing included. A follower's copy
of a partition is not counted again: each partition counts the most any of its replicas grew, and
``batchwire plan`` applies the replication factor itself.

The brokers are found by pid (the ones the bench counts CPU for): ``/proc/<pid>`` gives the
properties file on the command line and the folder it is relative to; a broker whose logs cannot
be read is left out, and the report says none were read. The aiokafka client has no
DescribeLogDirs, which would tell sizes but not record counts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

HEADER_BYTES = 61
"""A v2 record batch header: base offset, length, leader epoch, magic, CRC, attributes, last offset
delta, two timestamps, producer id and epoch, base sequence, record count."""
_LENGTH_AT = 8  # int32, the bytes after the offset and length fields
_MAGIC_AT = 16
_COUNT_AT = 57  # int32, records in the batch


class KafkaWrites(TypedDict):
    records: int
    bytes: int
    records_per_request: float | None
    bytes_per_request: float | None
    by_topic: dict[str, float]
    """Bytes per answered request by topic (all bytes when none answered)."""


def log_dirs(pid: int) -> list[Path]:
    """The ``log.dirs`` of the Kafka broker running as ``pid`` (empty when its process or properties
    cannot be read)."""
    proc = Path("/proc") / str(pid)
    try:
        argv = (proc / "cmdline").read_bytes().split(b"\0")
        cwd = Path(os.readlink(proc / "cwd"))
    except OSError:
        return []
    for arg in reversed(argv):
        if arg.endswith(b".properties"):
            properties = cwd / arg.decode()
            break
    else:
        return []
    try:
        lines = properties.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        name, _, value = line.partition("=")
        if name.strip() in ("log.dirs", "log.dir"):
            return [cwd / part.strip() for part in value.split(",") if part.strip()]
    return []


def _batches(data: bytes) -> Iterable[tuple[int, int]]:
    """(bytes, records) of each whole v2 batch at the start of ``data``; stops at a partial one."""
    at = 0
    while at + HEADER_BYTES <= len(data):
        size = 12 + int.from_bytes(data[at + _LENGTH_AT : at + _LENGTH_AT + 4], "big")
        if data[at + _MAGIC_AT] != 2 or at + size > len(data):
            return
        yield size, int.from_bytes(data[at + _COUNT_AT : at + _COUNT_AT + 4], "big")
        at += size


@dataclass(slots=True)
class KafkaLogs:
    """The brokers' segment files, and how far each has been read (``advance``)."""

    dirs: Sequence[Path]
    _read_to: dict[Path, int] = field(default_factory=dict)
    _started: bool = False

    @classmethod
    def of_brokers(cls, pids: Sequence[int]) -> KafkaLogs | None:
        dirs = [folder for pid in pids for folder in log_dirs(pid)]
        return cls(dirs) if dirs else None

    def advance(self) -> dict[str, tuple[int, int]]:
        """(records, bytes) appended per partition since the last call, the most of any replica; the
        first call reads nothing and marks where each file ends."""
        replicas: dict[tuple[Path, str], tuple[int, int]] = {}
        for folder in self.dirs:
            for segment in _segments(folder):
                try:
                    with segment.open("rb") as file:
                        if not self._started:
                            self._read_to[segment] = file.seek(0, os.SEEK_END)
                            continue
                        start = file.seek(self._read_to.get(segment, 0))
                        data = file.read()
                except OSError:  # a segment deleted by retention
                    continue
                records = size = 0
                for batch_bytes, batch_records in _batches(data):
                    size += batch_bytes
                    records += batch_records
                self._read_to[segment] = start + size
                replica = (folder, segment.parent.name)
                was_records, was_bytes = replicas.get(replica, (0, 0))
                replicas[replica] = (was_records + records, was_bytes + size)
        self._started = True
        grown: dict[str, tuple[int, int]] = {}
        for (_, partition), appended in replicas.items():
            if appended[1] >= grown.get(partition, (0, 0))[1]:
                grown[partition] = appended
        return grown


def _segments(folder: Path) -> list[Path]:
    """A log dir's segment files; a partition folder deleted while it is listed (its topic deleted) has none."""
    segments: list[Path] = []
    for partition in folder.iterdir():
        try:
            segments.extend(partition.glob("*.log"))
        except OSError:
            continue
    return segments


def writes(grown: dict[str, tuple[int, int]], answers: int) -> KafkaWrites:
    """A window's appends (``KafkaLogs.advance``), in all and per answered request."""
    records = sum(count for count, _ in grown.values())
    size = sum(size for _, size in grown.values())
    by_topic: dict[str, int] = {}
    for partition, (_, written) in grown.items():
        topic = partition.rpartition("-")[0]
        by_topic[topic] = by_topic.get(topic, 0) + written
    return KafkaWrites(
        records=records,
        bytes=size,
        records_per_request=round(records / answers, 3) if answers else None,
        bytes_per_request=round(size / answers, 1) if answers else None,
        by_topic={
            topic: round(written / answers, 1) if answers else float(written)
            for topic, written in sorted(by_topic.items(), key=lambda item: -item[1])
            if written
        },
    )
