"""Heartbeats: every process publishes one beat per role it hosts, each second, into the fleet.

The composition root knows which roles a process hosts (embedded: all of them), so it builds the
beats; the services only expose their state. The figures come from the process's own metrics
(``telemetry.heartbeat``), so a heartbeat adds one registry read and one store write a second.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping

from batcher.service import Batcher
from gateway.service import Gateway
from gpu_worker.worker import Worker
from schemas.heartbeat import Beat
from telemetry import heartbeat
from telemetry.heartbeat import Reader, Window
from transport.background_loop import BackgroundLoop
from transport.ports import Fleet, TransportError

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
"""How often each role beats; it is shown as gone after ``GONE_AFTER_BEATS`` missed beats."""
LAST_BEAT_S = 1.0
"""How long a stopping process waits for its last beat to be stored: an unreachable store must not hold
up its exit (the fleet views then show it as gone, as after a crash)."""


def _version() -> str:
    try:
        return importlib.metadata.version("batchwire")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


_HOST, _PID, _VERSION = socket.gethostname(), os.getpid(), _version()


def _beat(
    role: str,
    member_id: str,
    models: Iterable[str],
    state: str,
    figures: Mapping[str, float],
    breakdowns: Mapping[str, Mapping[str, float]] | None = None,
    per_model: Mapping[str, Mapping[str, float]] | None = None,
) -> Beat:
    return Beat(
        role=role,
        id=member_id,
        host=_HOST,
        pid=_PID,
        version=_VERSION,
        models=tuple(models),
        state=state,
        at_ms=int(time.time() * 1000),
        interval_s=HEARTBEAT_S,
        figures=figures,
        breakdowns=breakdowns or {},
        per_model=per_model or {},
    )


def last_beat(beat: Beat) -> Beat:
    """``beat`` as its member's last, saying how it stopped: ``hung`` or ``failed`` as it says; ``failed``
    for a role still ``starting`` (its start did not finish); ``stopped`` for any other, a clean stop."""
    ended = {"hung": "hung", "failed": "failed", "starting": "failed"}
    return dataclasses.replace(beat, state=ended.get(beat.state, "stopped"), final=True)


def gateway_beat(gateway: Gateway, window: Window, draining: bool = False) -> Beat:
    models = gateway.settings.models
    figures, breakdowns, per_model = heartbeat.gateway_figures(window, models)
    state = "draining" if draining else ("busy" if figures["inflight"] > 0 else "idle")
    return _beat("gateway", gateway.settings.gateway_id, models, state, figures, breakdowns, per_model)


def batcher_beat(batcher: Batcher, models: Iterable[str], window: Window) -> Beat:
    models = tuple(models)
    figures, breakdowns, per_model = heartbeat.batcher_figures(window, models)
    return _beat("batcher", batcher.settings.batcher_id, models, batcher.state, figures, breakdowns, per_model)


def worker_beat(worker: Worker, window: Window) -> Beat:
    settings = worker.settings
    figures = heartbeat.worker_figures(window, settings.worker_id)
    return _beat("worker", settings.worker_id, (settings.model,), worker.state, figures)


class Heartbeats:
    """Publishes ``beats(window)`` into ``fleet`` at start and every ``HEARTBEAT_S`` after, until ``close``,
    which sends one last beat (``last_beat``). ``beat_soon`` has the next beat go out at once: a role that
    has just come up is shown serving without waiting a period.

    A beat that cannot be stored (or built) is logged once per outage and tried again at the next
    beat: the process goes on serving, and the fleet views show it as gone until its beats land again.
    """

    def __init__(
        self,
        fleet: Fleet,
        beats: Callable[[Window], list[Beat]],
        interval_s: float = HEARTBEAT_S,
        result_ttl_s: float | None = None,
    ) -> None:
        """``result_ttl_s``: stated in every beat, for roles starting beside this one to check theirs against."""
        self.fleet = fleet
        self._beats = beats
        self.interval_s = interval_s
        self.result_ttl_s = result_ttl_s
        self._loop = BackgroundLoop("heartbeats")
        self._soon = asyncio.Event()
        self._reader: Reader | None = None

    async def start(self) -> None:
        self._reader = Reader()
        self._loop.start(self._run(self._reader))

    async def close(self) -> None:
        """Stops the beats, then stores the last one within ``LAST_BEAT_S``: the fleet views show how each
        role stopped until its record is dropped, not ``gone`` as after a crash. Nothing is sent for
        heartbeats that never started (the role was never shown)."""
        reader, self._reader = self._reader, None
        await self._loop.close()
        if reader is not None:
            await self._last(reader.levels())

    async def _last(self, window: Window) -> None:
        try:
            beats = [last_beat(beat) for beat in self.beats(window)]
            async with asyncio.timeout(LAST_BEAT_S):
                await self.fleet.beat(beats)
        except TimeoutError:
            log.warning(
                "last heartbeat not stored within %.0f s (the fleet views show this process as gone)", LAST_BEAT_S
            )
        except TransportError as err:
            log.warning("last heartbeat not stored (the fleet views show this process as gone): %s", err)
        except Exception:  # a fault in the figures must not stop the shutdown, nor go unseen
            log.exception("last heartbeat not built (the fleet views show this process as gone)")

    def beats(self, window: Window) -> list[Beat]:
        beats = self._beats(window)
        if self.result_ttl_s is None:
            return beats
        return [dataclasses.replace(beat, result_ttl_s=self.result_ttl_s) for beat in beats]

    def beat_soon(self) -> None:
        """For a role that has just started: its beat carries the state and gauges, and no rates."""
        self._soon.set()

    async def _run(self, reader: Reader) -> None:
        window = reader.levels()  # the first beat: the state and the gauges, no rates over no time
        failing = False
        while True:
            self._soon.clear()
            try:
                await self.fleet.beat(self.beats(window))
            except TransportError as err:
                if not failing:
                    log.warning("heartbeat not stored (the fleet views show this process as gone): %s", err)
                failing = True
            except Exception:  # a fault in the figures must not stop the process, nor go unseen
                if not failing:
                    log.exception("heartbeat not built (the fleet views show this process as gone)")
                failing = True
            else:
                if failing:
                    log.info("heartbeats stored again")
                failing = False
            try:  # a timer: the beat's period, cut short by beat_soon
                async with asyncio.timeout(self.interval_s):
                    await self._soon.wait()
            except TimeoutError:
                window = reader.advance()
            else:
                window = reader.levels()  # the state now, no rates over the sliver since the last beat
