"""This process's counts in ``batchwire_tasks_ended`` (the registry is the process's: tests read
differences, or counts of a model of their own), and the readiness a ``/metrics`` page shows."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from schemas.records import TaskStatus
from telemetry.metrics import REGISTRY


def tasks_ended(status: str, model: str = "sim") -> float:
    """The ends of ``model``'s tasks as ``status`` counted in this process; 0 before the first."""
    return REGISTRY.get_sample_value("batchwire_tasks_ended_total", {"model": model, "status": status}) or 0.0


def ends_by_status(model: str) -> dict[str, float]:
    """The ends counted for ``model`` in this process, by status (those above zero)."""
    counts = {status.value: tasks_ended(status.value, model) for status in TaskStatus if status.terminal}
    return {status: count for status, count in counts.items() if count}


def ready_series(exposition: str) -> dict[str, float]:
    """``batchwire_ready``'s series in a ``/metrics`` page, by check."""
    return {
        sample.labels["check"]: sample.value
        for family in text_string_to_metric_families(exposition)
        if family.name == "batchwire_ready"
        for sample in family.samples
    }
