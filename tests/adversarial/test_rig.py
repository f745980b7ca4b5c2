"""The rig's own honesty: a harmless attack passes its bounds, and a harmful one fails them."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.support.adversarial_rig import ProbeStats, ServiceFactory, unharmed

pytestmark = [pytest.mark.slow, pytest.mark.timing]


def test_a_harmless_attack_passes(embedded_service_factory: ServiceFactory) -> None:
    """The rig's own bounds, on one mode: every attack test runs the same rig over both."""
    harm = unharmed(embedded_service_factory(), lambda: None)
    assert harm.baseline.count >= 30, harm
    assert 95 <= harm.baseline.p50_ms <= 200, harm


def test_a_paused_service_fails_the_latency_bound(embedded_service_factory: ServiceFactory) -> None:
    service = embedded_service_factory()

    def pause() -> None:  # the service is stopped for 300 ms: every request in that window waits
        os.kill(service.pid, signal.SIGSTOP)
        try:
            time.sleep(0.3)
        finally:
            os.kill(service.pid, signal.SIGCONT)

    with pytest.raises(AssertionError, match="p99 rose too much"):
        unharmed(service, pause)


def test_a_windows_p99_is_interpolated_between_ranks() -> None:
    """One slow answer among 30 moves the p99 most of the way to it, not all: the bound is not
    the one slowest answer, which a single stall of the shared machine would decide."""
    stats = ProbeStats([100.0] * 29 + [200.0], [])
    assert stats.p99_ms == pytest.approx(171.0)
    assert stats.p50_ms == pytest.approx(100.0)
    assert ProbeStats([], []).p99_ms == float("inf")
