"""Each client's fair share of a model's capacity, while its queue builds.

Batches take a model's requests first in, first out within a tier, so one API key that sends more
than the model drains fills the queue, and every other key's requests wait behind its flood. While
a model's queue holds more than ``FAIR_AFTER_S`` of work, admission refuses a client whose recent
rate is above its max-min fair share of the model's drain rate: clients that send less than an
equal share keep their rate, and the rest of the capacity is split evenly among the others. A flood
from one key is then refused before another key's requests wait behind it. A lone client's share is
the whole drain: alone, it may not queue faster than the model drains either, so a key that floods
first holds about a second of work ahead of the next key to come, not its own deadline's worth, which
would refuse every request of a key with a shorter deadline for as long as the flood went on (the
newcomer, refused, would never count as sending).

Rates are this gateway's own admissions, decayed with a half-life of ``HALF_LIFE_S``: with several
gateways, a client spread over them is held to a share at each. Pure: time is passed in.

Under a token budget a request weighs its tokens: a batch's cost goes with its padded tokens, so a
long input costs the model what many short ones do. Rates are then tokens/s, and the drain, measured
in requests, is taken at the mean weight of the model's recent admissions, so that a client of long
inputs is held to its share of the model's work, not of its count of requests.
"""

from __future__ import annotations

import math

HALF_LIFE_S = 1.0
FAIR_AFTER_S = 1.0
"""The queue's predicted wait past which shares apply: below it, every request is served soon."""
ACTIVE_PER_S = 0.5
"""A client whose rate has decayed below this is no longer counted as sending (in requests/s, or in
tokens/s where requests weigh their tokens: a client of short inputs still sending counts)."""
PRUNE_AT = 1024
"""Clients of one model remembered before those no longer sending are first dropped; after that, once
they are twice as many as the last pruning left, so each admission pays for a walk of them only
once in a while, however many clients are sending."""
LEVEL_FOR_S = 0.1
"""How long a model's share, worked out from all its clients' rates, judges admissions: rates decay over
seconds, so a share this fresh still holds, and a crowd of senders costs one walk of them per interval,
not one per admission."""


class FairShare:
    """Per lane (a model's, or a model's tier and those above it: ``Admission``'s ``_share_lane``), each
    client's decayed rate of admitted requests. The parameters named ``model`` name a lane."""

    def __init__(self, half_life_s: float = HALF_LIFE_S) -> None:
        self.half_life_s = half_life_s
        self._step = math.log(2) / half_life_s
        """What one admission of weight one adds to its client's decayed rate."""
        self._rates: dict[str, dict[str, tuple[float, float]]] = {}
        """model -> client -> (rate per second, when it was last brought up to date)."""
        self._prune_at: dict[str, int] = {}
        """model -> how many clients it may remember before the next pruning."""
        self._levels: dict[str, tuple[float, float, float, int]] = {}
        """model -> (when, for which drain, the share, how many clients were sending)."""
        self._weighed: dict[str, tuple[float, float, float]] = {}
        """model -> (decayed rate of requests, of their weight, when), kept only for weighed admissions."""

    def admitted(self, model: str, client: str, now_s: float, weight: int | None = None) -> None:
        """``weight``: what the request costs the model (its tokens, under a token budget); None: one."""
        clients = self._rates.setdefault(model, {})
        rate = self._decayed(clients.get(client), now_s)
        step = self._step
        if weight is None:
            clients[client] = (rate + step, now_s)
        else:
            clients[client] = (rate + weight * step, now_s)
            requests, weights, at_s = self._weighed.get(model, (0.0, 0.0, now_s))
            decay = 0.5 ** (max(0.0, now_s - at_s) / self.half_life_s)
            self._weighed[model] = (requests * decay + step, weights * decay + weight * step, now_s)
        if len(clients) >= self._prune_at.get(model, PRUNE_AT):  # clients that stopped sending are forgotten
            for name, entry in list(clients.items()):
                if self._decayed(entry, now_s) < ACTIVE_PER_S:
                    del clients[name]
            self._prune_at[model] = max(PRUNE_AT, 2 * len(clients))

    def remembered(self, model: str) -> int:
        """How many of ``model``'s clients are remembered (those sending, and some that stopped)."""
        return len(self._rates.get(model, ()))

    def over_share(self, model: str, client: str, drain_per_s: float, now_s: float) -> tuple[float, float, int] | None:
        """``(rate, share, clients)`` when ``client`` sends ``model`` more than its fair share of
        ``drain_per_s`` (requests) among the clients sending now (alone: the whole drain); None when it
        does not.
        With weighed admissions, rates and shares are weight per second, and the drain is taken at the
        mean weight of the model's recent admissions."""
        clients = self._rates.get(model)
        mine = self._decayed(clients.get(client), now_s) if clients else 0.0
        if not clients or mine < ACTIVE_PER_S:
            return None
        level = self._levels.get(model)
        if level is None or level[3] < 2 or level[1] != drain_per_s or now_s - level[0] >= LEVEL_FOR_S:
            level = self._levels[model] = self._level(model, clients, drain_per_s, now_s)
        _, _, share, sending = level
        return (mine, share, sending) if mine > share else None

    def _level(
        self, model: str, clients: dict[str, tuple[float, float]], drain_per_s: float, now_s: float
    ) -> tuple[float, float, float, int]:
        """The share of ``drain_per_s`` (in weight, with weighed admissions) among the clients sending now,
        forgetting those that stopped."""
        weighed = self._weighed.get(model)
        mean = 1.0 if weighed is None else weighed[1] / weighed[0]
        rates = []
        for name, entry in list(clients.items()):
            rate = self._decayed(entry, now_s)
            if rate < ACTIVE_PER_S:
                del clients[name]
            else:
                rates.append(rate)
        return (now_s, drain_per_s, water_level(sorted(rates), drain_per_s * mean), len(rates))

    def _decayed(self, entry: tuple[float, float] | None, now_s: float) -> float:
        if entry is None:
            return 0.0
        rate, at_s = entry
        decay: float = 0.5 ** (max(0.0, now_s - at_s) / self.half_life_s)
        return rate * decay


def water_level(ascending: list[float], capacity: float) -> float:
    """The max-min fair share of ``capacity`` among demands ``ascending``: the demands below an equal
    share are met whole, and what is left is split evenly among the rest."""
    left = capacity
    for index, demand in enumerate(ascending):
        level = left / (len(ascending) - index)
        if demand > level:
            return level
        left -= demand
    return math.inf
