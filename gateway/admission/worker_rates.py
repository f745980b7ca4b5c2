"""A model's capacity by its workers' own word, for admission before its drain rate is measured.

Each idle worker's credit says how many inputs its backend takes per call and how long its recent
calls took (``Credit.rate_per_s``). Summed over the model's workers, that bounds from above the rate
at which its queue can drain: a gateway's first burst for a model is held against it, instead of
being admitted whole, until ``gateway.admission.drain`` has measured the real rate. A credit shows only while
it waits unclaimed, so each worker's latest one is kept until it expires (a gone worker's does).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from schemas.records import Credit


@dataclass(frozen=True, slots=True)
class Stated:
    """What a model's live workers say of themselves, summed or bounded over them."""

    rate_per_s: float
    """Requests/s they take together in full batches at their recent call times."""
    call_s: float
    """The longest of their recent call times: the least an answer takes, while none is measured."""


class WorkerRates:
    """The latest credit of each worker of each model, as the gateway reads them from the pool."""

    def __init__(self) -> None:
        self._latest: dict[str, dict[str, Credit]] = {}

    def seen(self, model: str, credits: Iterable[Credit]) -> None:
        latest = self._latest.setdefault(model, {})
        for credit in credits:
            known = latest.get(credit.worker_id)
            if known is None or credit.issued_at_ms >= known.issued_at_ms:
                latest[credit.worker_id] = credit

    def stated(self, model: str, now_ms: int) -> Stated | None:
        """None while any live worker has not told its rate (a worker before its first call): a
        partial sum would refuse what the model can answer."""
        latest = self._latest.get(model)
        if not latest:
            return None
        for worker, credit in list(latest.items()):
            if credit.expires_at_ms <= now_ms:
                del latest[worker]
        rates = [credit.rate_per_s for credit in latest.values()]
        if not rates or None in rates:
            return None
        return Stated(
            sum(rate for rate in rates if rate is not None),
            max(credit.busy_ms for credit in latest.values()) / 1000,
        )
