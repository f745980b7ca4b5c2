"""A process's heartbeat: which role it plays, what it is doing, and its figures of the last second.

Every role publishes one about once a second (``batchwire.fleet``), and ``batchwire status`` and the
gateway's ``/dashboard`` read them all. A beat is JSON, not Avro: it is small, read by people's tools
as much as by batchwire, and a field added later must not break a reader of an older release.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ROLES = ("gateway", "batcher", "worker")
"""The roles, in the order the fleet views list them; a role a later release adds comes after them."""
GONE_AFTER_BEATS = 3
"""A member that missed this many beats is shown as gone: its process died or cannot reach the store."""
FORGET_AFTER_S = 60.0
"""A gone member is dropped from the fleet this long after its last beat."""


@dataclass(frozen=True, slots=True)
class Beat:
    """One member of the fleet at ``at_ms`` (Unix ms), in ``state`` starting, idle, busy, draining, hung,
    failed or stopped.

    ``figures`` are the member's rates and levels over the last ``interval_s`` (``requests_per_s``,
    ``p99_ms``, ``busy_fraction``...), ``breakdowns`` the rates it splits by a label (refusals by
    status, flushes by reason), and ``per_model`` its figures for each model it serves. ``final`` marks
    the last beat of a member that stopped (``stopped``, or ``hung``/``failed``): it is never live, and
    shows that state, not ``gone``, until it is dropped, so a planned stop reads apart from a crash.
    ``result_ttl_s`` is the member's ``--result-ttl-s`` (None: not stated), which a role starting beside it
    checks its own against: every role sets the expiry of the task states it writes.
    """

    role: str
    id: str
    host: str
    pid: int
    version: str
    models: tuple[str, ...]
    state: str
    at_ms: int
    interval_s: float
    figures: Mapping[str, float] = field(default_factory=dict)
    breakdowns: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    per_model: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    final: bool = False
    result_ttl_s: float | None = None

    @property
    def key(self) -> str:
        """The member's name in the fleet: its role and id, and the process that beats (host and pid), so
        that two live processes given one id are two members, not two writers of one beat."""
        return f"{self.role}:{self.id}@{self.host}:{self.pid}"

    def live(self, now_ms: int) -> bool:
        """False once the member missed ``GONE_AFTER_BEATS`` beats, or stopped (its last beat)."""
        return not self.final and now_ms - self.at_ms <= GONE_AFTER_BEATS * self.interval_s * 1000

    def forgotten(self, now_ms: int) -> bool:
        return now_ms - self.at_ms > FORGET_AFTER_S * 1000

    def to_public(self, now_ms: int) -> dict[str, Any]:
        """The JSON shape of ``/v1/fleet`` and ``batchwire status --json``: the beat, its state ``gone`` once
        it missed ``GONE_AFTER_BEATS`` beats (a last beat keeps the state it stopped in), and its age."""
        doc = self._doc()
        del doc["at_ms"], doc["interval_s"]
        doc["state"] = self.state if self.final or self.live(now_ms) else "gone"
        doc["age_s"] = round(max(0, now_ms - self.at_ms) / 1000, 1)
        return doc

    def encode(self) -> bytes:
        return json.dumps(self._doc(), separators=(",", ":")).encode()

    def _doc(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "id": self.id,
            "host": self.host,
            "pid": self.pid,
            "version": self.version,
            "models": list(self.models),
            "state": self.state,
            "at_ms": self.at_ms,
            "interval_s": self.interval_s,
            "figures": _rounded(self.figures),
            "breakdowns": {name: _rounded(values) for name, values in self.breakdowns.items()},
            "per_model": {model: _rounded(values) for model, values in self.per_model.items()},
            "final": self.final,
            "result_ttl_s": self.result_ttl_s,
        }


def decode_beat(raw: bytes | str) -> Beat | None:
    """The beat ``raw`` holds, or None for bytes that are not one (a reader skips them, never fails)."""
    try:
        doc = json.loads(raw)
        return Beat(
            role=str(doc["role"]),
            id=str(doc["id"]),
            host=str(doc["host"]),
            pid=int(doc["pid"]),
            version=str(doc["version"]),
            models=tuple(str(model) for model in doc["models"]),
            state=str(doc["state"]),
            at_ms=int(doc["at_ms"]),
            interval_s=float(doc["interval_s"]),
            figures=_floats(doc.get("figures")),
            breakdowns=_groups(doc.get("breakdowns")),
            per_model=_groups(doc.get("per_model")),
            final=doc.get("final") is True,  # absent from an earlier release's beats
            result_ttl_s=_ttl(doc.get("result_ttl_s")),
        )
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError):
        # OverflowError: ``Infinity`` or ``1e400`` as an int; RecursionError: nesting past Python's limit.
        return None


def _number(value: Any) -> float | None:
    """``value`` as a float; None for what is no number (a bool, text, an integer past a float's range)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):
            return float(value)
    return None


def _ttl(value: Any) -> float | None:
    """A stated TTL; what is none (absent from an earlier release's beats, or of another kind) is None."""
    number = _number(value)
    return number if number is not None and math.isfinite(number) and number > 0 else None


def _floats(values: Any) -> dict[str, float]:
    """The numbers of ``values``; what is no number (a later release's figure of another kind) is left
    out, not the beat: a reader drops a beat it cannot read from the fleet, for every process."""
    if not isinstance(values, Mapping):
        return {}
    return {str(name): number for name, value in values.items() if (number := _number(value)) is not None}


def _groups(groups: Any) -> dict[str, dict[str, float]]:
    """``_floats`` of each group (a breakdown, a model); a group that is no map of numbers is left out."""
    if not isinstance(groups, Mapping):
        return {}
    read = {str(name): _floats(values) for name, values in groups.items() if isinstance(values, Mapping)}
    return {name: values for name, values in read.items() if values or not groups[name]}


def _rounded(values: Mapping[str, float]) -> dict[str, float]:
    """Three decimals: a rate of 0.001/s, a millisecond to a microsecond; shorter beats."""
    return {name: round(value, 3) for name, value in values.items()}
