"""What one request costs a deployment, as ``batchwire plan --costs`` takes it: measured by a
``batchwire bench`` run over Kafka (``--start kafka`` or ``--url`` with ``--redis-url``).

At each rate the bench measures, over its window and per answered request, each role's CPU (whole
process groups), the Redis commands (``INFO commandstats``), the Redis memory a request leaves
(``INFO memory``) and the records and bytes the brokers append (their logs on disk: ``kafka_log``).
The plan takes them from the run's busiest rate that kept up with what was sent: the costs under
load, without a queue's. Each input the plan sizes with names where it came from; what the run did
not measure keeps its default, and says so.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from batchwire.capacity.sizing import SizingError, SizingInputs

KEPT_UP = 0.97
"""A rate kept up when its throughput was at least this share of the rate sent."""


def _role_us(role: str) -> Callable[[Mapping[str, Any]], float | None]:
    def read(rate: Mapping[str, Any]) -> float | None:
        group = rate.get("processes", {}).get(f"batchwire.{role}")
        value: float | None = None if group is None else group.get("us_per_request")
        return value

    return read


def _commands(rate: Mapping[str, Any]) -> float | None:
    value: float | None = rate.get("redis_commands", {}).get("per_request")
    return value


def _memory(rate: Mapping[str, Any]) -> float | None:
    value: float | None = rate.get("redis_bytes_per_request")
    return value


def _per_core_second(
    amount: Callable[[Mapping[str, Any]], float | None], group: str
) -> Callable[[Mapping[str, Any]], float | None]:
    """``amount`` per request over the CPU the process group took per request: how much of it one core
    does in a second."""

    def read(rate: Mapping[str, Any]) -> float | None:
        per_request = amount(rate)
        us: float | None = rate.get("processes", {}).get(group, {}).get("us_per_request")
        return per_request / (us / 1e6) if per_request and us else None

    return read


def _kafka(figure: str) -> Callable[[Mapping[str, Any]], float | None]:
    def read(rate: Mapping[str, Any]) -> float | None:
        value: float | None = rate.get("kafka_writes", {}).get(figure)
        return value

    return read


MEASURED: dict[str, tuple[Callable[[Mapping[str, Any]], float | None], str]] = {
    "gateway_us_per_request": (_role_us("gateway"), "the gateways' CPU per request"),
    "batcher_us_per_request": (_role_us("batcher"), "the batchers' CPU per request"),
    "redis_commands_per_request": (_commands, "Redis commands per request (INFO commandstats)"),
    "result_bytes": (_memory, "Redis memory per task (used_memory's growth per request; record and keys in it)"),
    "kafka_bytes_per_request": (_kafka("bytes_per_request"), "Kafka bytes per request (the log appends)"),
    "kafka_records_per_request": (_kafka("records_per_request"), "Kafka records per request (the log appends)"),
    "redis_commands_per_s": (
        _per_core_second(_commands, "redis"),
        "Redis commands per request over Redis's CPU per request (one thread: one core per shard)",
    ),
    "broker_core_bytes_per_s": (
        _per_core_second(_kafka("bytes_per_request"), "kafka"),
        "Kafka bytes appended per request over the brokers' CPU per request (reads low over replicated "
        "topics, whose copies cost CPU too)",
    ),
}
"""The sizing inputs a bench run measures: how each is read from a rate of ``results.json``, and what it is.
The Redis and Kafka figures need the servers' CPU, which the bench measures only on its own machine."""


@dataclass(frozen=True, slots=True)
class Costs:
    values: dict[str, float]
    """``SizingInputs`` fields, as measured."""
    sources: dict[str, str]
    """Each field's source, in words."""


def read_costs(path: str | Path) -> Costs:
    """The costs a bench run over Kafka measured at its busiest rate that kept up (``path``: the run's
    directory or its ``results.json``)."""
    file = Path(path)
    file = file / "results.json" if file.is_dir() else file
    try:
        runs = json.loads(file.read_text())["runs"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SizingError(f"--costs: cannot read a bench run's results from {file}: {err}") from err
    try:
        return _busiest(file, runs)
    except SizingError:
        raise
    except (AttributeError, TypeError, ValueError) as err:  # a value of another type than the bench writes
        raise SizingError(f"--costs: {file} is not a batchwire bench run's results: {err}") from err


def _busiest(file: Path, runs: Any) -> Costs:
    """The costs measured at the busiest rate that kept up, of the runs in ``file``."""
    rates = [
        (run, rate)
        for run in runs
        if run.get("sut", {}).get("mode") == "kafka"
        for rate in run.get("rates", [])
        if rate.get("throughput_rps", 0.0) >= KEPT_UP * rate.get("sent", 0) / max(rate.get("window_s", 1.0), 1e-9)
    ]
    if not rates:
        raise SizingError(
            f"--costs: {file} holds no rate of a Kafka deployment that kept up with its load: "
            "measure one with batchwire bench --start kafka"
        )
    run, rate = max(rates, key=lambda pair: pair[1].get("offered_rps", 0.0))
    values: dict[str, float] = {}
    sources: dict[str, str] = {}
    where = f"{file.parent.name}, {rate.get('offered_rps', 0):g} req/s ({run.get('label') or 'kafka'})"
    for name, (read, what) in MEASURED.items():
        value = read(rate)
        if value is not None and value > 0:
            values[name] = float(value)
            sources[name] = f"measured: {what}, {where}"
    if "result_bytes" in values:
        values["key_overhead_bytes"] = 0.0
        sources["key_overhead_bytes"] = f"measured: in result_bytes, {where}"
    return Costs(values, sources)


def sources_for(costs: Costs | None, given: Mapping[str, str]) -> dict[str, str]:
    """Where each sizing input came from: measured (``costs``), a flag or file (``given``), else the default."""
    sources = {field.name: "default (docs/capacity.md)" for field in fields(SizingInputs)}
    sources.update(given)
    if costs is not None:
        sources.update(costs.sources)
    return sources
