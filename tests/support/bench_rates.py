"""One rate of ``batchwire bench`` run in process against a server, for the bench tests."""

from __future__ import annotations

from batchwire.bench.results import RateReport, RunReport
from batchwire.bench.runner import LoadConfig, Target, bench_run


async def one_rate(
    url: str, rate: float, *, duration: float = 1.0, warmup: float = 0.2, metrics: str = "", **load: object
) -> RateReport:
    """Sends at ``rate`` req/s to ``url`` for ``duration`` s after ``warmup`` s; ``load`` sets the rest."""
    config = LoadConfig(rates_rps=(rate,), duration_s=duration, warmup_s=warmup, **load)  # type: ignore[arg-type]
    run = RunReport(label="test", policy=None, sut=None, rates=[])
    target = Target(urls=(url,), metrics_urls=(metrics,) if metrics else ())
    await bench_run(config, target, run, progress=lambda line: None)
    return run["rates"][0]
