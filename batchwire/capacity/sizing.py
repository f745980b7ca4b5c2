"""The closed-form part of a plan: processes, partitions, Kafka and Redis from the request rate.

Each figure comes with its formula in words. The inputs' defaults are round, documented guesses;
``--cpu-file`` and the flags of ``batchwire plan`` replace them with measured values.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

DEFAULT_HEADROOM = 0.7


class SizingError(ValueError):
    """An input of the sizing cannot be used; the message names it."""


@dataclass(frozen=True, slots=True)
class SizingInputs:
    """What the sizing needs besides the rate and the GPU count."""

    headroom: float = DEFAULT_HEADROOM
    """The share of every resource (GPU, core, broker, Redis) a plan fills at the planned rate."""
    gateway_us_per_request: float = 400.0
    """CPU per request of a gateway over Kafka and Redis (``batchwire bench``'s per-process figure)."""
    batcher_us_per_request: float = 240.0
    """CPU per request of a batcher."""
    kafka_bytes_per_request: float = 2048.0
    """Bytes the brokers append per request over every topic, before replication: the request record,
    its share of a batch record, offsets (``batchwire bench``'s ``kafka_writes``)."""
    kafka_records_per_request: float = 2.0
    """Records the brokers append per request over every topic."""
    result_bytes: int = 1024
    """A result as stored in Redis."""
    key_overhead_bytes: int = 300
    """Redis's per-task cost beyond the result: the task record's other fields and the key's own overhead."""
    replication_factor: int = 3
    broker_core_bytes_per_s: float = 6.25e6
    """Replicated bytes one core of a broker takes in per second (``--costs``: the bytes the brokers
    appended per request over their CPU per request)."""
    broker_cores: float = 8.0
    """Cores of one broker: hardware chosen, not measured."""
    result_ttl_s: float = 3600.0
    """How long a result stays in Redis (the store's TTL)."""
    redis_commands_per_request: float = 3.0
    """Commands per request: the task's creation, its result, its read."""
    redis_commands_per_s: float = 100_000.0
    """Commands a Redis shard serves per second (``--costs``: one core over Redis's CPU per command, as
    Redis runs its commands on one thread)."""
    redis_shard_bytes: float = 25e9
    """Memory of one Redis shard."""

    def __post_init__(self) -> None:
        if not 0 < self.headroom <= 1:
            raise SizingError(f"headroom must be within (0, 1], got {self.headroom} (--headroom)")
        if self.replication_factor < 1:
            raise SizingError(
                f"replication factor must be at least 1, got {self.replication_factor} (--replication-factor)"
            )
        if not self.result_ttl_s > 0:
            raise SizingError(f"result TTL must be positive, got {self.result_ttl_s:g} s (--result-ttl-s)")
        for item in fields(self):
            value = getattr(self, item.name)
            least = "more than 0" if item.name in DIVISORS else "0 or more"
            if not math.isfinite(value) or value < 0 or (value == 0 and item.name in DIVISORS):
                raise SizingError(
                    f"{item.name} is {value:g}; it must be a finite number, {least} "
                    "(its key in --cpu-file, or measured by --costs)"
                )


DIVISORS = frozenset({"broker_core_bytes_per_s", "broker_cores", "redis_commands_per_s", "redis_shard_bytes"})
"""The inputs the sizing divides by: a capacity of 0 sizes nothing."""


def with_values(inputs: SizingInputs, values: Mapping[str, Any]) -> SizingInputs:
    """``inputs`` with these fields replaced, each converted to its field's type (int or float)."""
    return replace(inputs, **{name: type(getattr(inputs, name))(value) for name, value in values.items()})


def load_cpu_file(path: str | Path, inputs: SizingInputs) -> SizingInputs:
    """``inputs`` with values from a JSON object of ``SizingInputs`` fields (``gateway_us_per_request``, ...)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SizingError(f"--cpu-file {path}: cannot read it: {err}") from err
    known = {f.name for f in fields(SizingInputs)}
    if not isinstance(data, dict) or not set(data) <= known:
        raise SizingError(f"--cpu-file {path}: it must be a JSON object with keys among {sorted(known)}")
    try:
        # int() reads a replication factor of 2.5 as 2
        parts = [n for n, value in data.items() if isinstance(getattr(inputs, n), int) and float(value) % 1 != 0]
        updated = with_values(inputs, data)
    except SizingError as err:
        raise SizingError(f"--cpu-file {path}: {err}") from err
    except (TypeError, ValueError, OverflowError) as err:
        raise SizingError(f"--cpu-file {path}: it holds a value that is not a finite number: {err}") from err
    if parts:
        raise SizingError(f"--cpu-file {path}: {', '.join(parts)} take whole numbers, got {data[parts[0]]!r}")
    return updated


@dataclass(frozen=True, slots=True)
class Figure:
    name: str
    value: float
    formula: str


def processes(rate: float, us_per_request: float, headroom: float) -> int:
    """One core per process (Python): cores needed at the headroom, at least one."""
    return max(1, math.ceil(rate * us_per_request / 1e6 / headroom))


def size(rate: float, inputs: SizingInputs, models: int = 1) -> list[Figure]:
    """Every figure besides the GPUs, for ``rate`` requests/s in all over ``models`` models."""
    try:
        return [
            *_processes_figures(rate, inputs, models),
            *_kafka_figures(rate, inputs),
            *_redis_figures(rate, inputs),
        ]
    except (OverflowError, ValueError) as err:  # finite inputs whose product is not (then NaN, times 0)
        raise SizingError(
            f"the figures for {rate:g} req/s overflow ({err}): an input is far too large "
            "(--result-ttl-s, or a value from --cpu-file or --costs)"
        ) from err


def _processes_figures(rate: float, inputs: SizingInputs, models: int) -> list[Figure]:
    gateways = processes(rate, inputs.gateway_us_per_request, inputs.headroom)
    batchers = processes(rate, inputs.batcher_us_per_request, inputs.headroom)
    partitions = 2 * max(gateways, batchers)
    why = "every batcher reads one, and the count can double without growing the topic (growing re-routes keys)"
    if models > 1:
        # The service splits the request topic evenly among the models: each model's share is what one gets.
        partitions_figure = Figure(
            "request_partitions",
            models * partitions,
            f"{models} models x 2 x the larger of gateways and batchers: the topic is split evenly among the "
            f"models, and in each model's share {why}",
        )
    else:
        partitions_figure = Figure("request_partitions", partitions, f"2 x the larger of gateways and batchers: {why}")
    return [
        Figure(
            "gateways",
            gateways,
            f"rate x gateway CPU per request ({inputs.gateway_us_per_request:g} us) / one core per process / headroom",
        ),
        Figure(
            "batchers",
            batchers,
            f"rate x batcher CPU per request ({inputs.batcher_us_per_request:g} us) / one core per process / headroom",
        ),
        partitions_figure,
    ]


def _kafka_figures(rate: float, inputs: SizingInputs) -> list[Figure]:
    replicated = rate * inputs.kafka_bytes_per_request * inputs.replication_factor
    per_broker = inputs.broker_core_bytes_per_s * inputs.broker_cores
    brokers = max(inputs.replication_factor, math.ceil(replicated / (per_broker * inputs.headroom)))
    return [
        Figure(
            "kafka_records_per_s",
            round(rate * inputs.kafka_records_per_request),
            f"rate x records per request ({inputs.kafka_records_per_request:g}), before replication",
        ),
        Figure(
            "kafka_bytes_per_s",
            round(replicated),
            f"rate x bytes per request x replication factor "
            f"({inputs.kafka_bytes_per_request:g} B x {inputs.replication_factor})",
        ),
        Figure(
            "kafka_brokers",
            brokers,
            f"replicated bytes/s / ({inputs.broker_core_bytes_per_s / 1e6:.3g} MB/s per core x "
            f"{inputs.broker_cores:g} cores per broker x headroom), at least the replication factor",
        ),
    ]


def _redis_figures(rate: float, inputs: SizingInputs) -> list[Figure]:
    memory = rate * inputs.result_ttl_s * (inputs.result_bytes + inputs.key_overhead_bytes)
    commands = rate * inputs.redis_commands_per_request
    shards = max(
        math.ceil(commands / (inputs.redis_commands_per_s * inputs.headroom)),
        math.ceil(memory / (inputs.redis_shard_bytes * inputs.headroom)),
    )
    return [
        Figure(
            "redis_commands_per_s",
            round(commands),
            f"rate x {inputs.redis_commands_per_request:g} commands per request",
        ),
        Figure(
            "redis_memory_bytes",
            round(memory),
            f"rate x result TTL ({inputs.result_ttl_s:g} s) x (result {inputs.result_bytes} B + "
            f"{inputs.key_overhead_bytes} B per task record and key)",
        ),
        Figure(
            "redis_shards",
            shards,
            f"the larger of commands/s / ({inputs.redis_commands_per_s:g}/s per shard x headroom) and "
            f"memory / ({inputs.redis_shard_bytes / 1e9:g} GB per shard x headroom)",
        ),
    ]


def as_dict(figures: list[Figure]) -> dict[str, Any]:
    return {f.name: f.value for f in figures}
