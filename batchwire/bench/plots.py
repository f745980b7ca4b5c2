"""The figures users choose a batching server by, drawn from the result structures.

latency.png: p50/p99/p99.9 against offered load (the knee shows where queueing starts);
throughput.png: achieved against offered (where the service stops keeping up);
batch_sizes.png: how batches filled at each rate (why the two curves look as they do).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: a bench run may have no display

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogFormatter

from batchwire.bench.results import RunReport

_STYLES = ("-", "--", ":", "-.")
_PERCENTILES = (("p50", "o"), ("p99", "s"), ("p99.9", "^"))


def _name(run: RunReport) -> str:
    return run["policy"] or run["label"]


def latency_plot(runs: Sequence[RunReport], path: Path, backend_latency_ms: float | None = None) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    for index, run in enumerate(runs):
        offered = [rate["offered_rps"] for rate in run["rates"]]
        for key, marker in _PERCENTILES:
            values = [rate["latency_ms"].get(key, float("nan")) for rate in run["rates"]]
            ax.plot(offered, values, _STYLES[index % len(_STYLES)], marker=marker, label=f"{_name(run)} {key}")
    if backend_latency_ms is not None:
        ax.axhline(backend_latency_ms, color="grey", linewidth=1, label=f"backend latency {backend_latency_ms:g} ms")
    ax.set_xlabel("offered load (req/s, Poisson)")
    ax.set_ylabel("latency from scheduled send (ms)")
    ax.set_yscale("log")
    # Plain numbers (50, 200) read faster than 5x10^1 on a latency axis.
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title("Latency vs offered load")
    return _save(fig, path)


def throughput_plot(runs: Sequence[RunReport], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    top = 0.0
    for index, run in enumerate(runs):
        offered = [rate["offered_rps"] for rate in run["rates"]]
        achieved = [rate["throughput_rps"] for rate in run["rates"]]
        top = max(top, *offered, *achieved)
        ax.plot(offered, achieved, _STYLES[index % len(_STYLES)], marker="o", label=_name(run))
    ax.plot([0, top], [0, top], color="grey", linewidth=1, label="achieved = offered")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("answers per second in the window")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title("Achieved vs offered throughput")
    return _save(fig, path)


def batch_size_plot(runs: Sequence[RunReport], path: Path) -> Path:
    """One panel per run; per rate, the share of batches in each batch-size bucket."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 3.5 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        rates = [rate for rate in run["rates"] if rate["server"] is not None and rate["server"]["batches"]]
        labels: list[str] = []
        for rate in rates:
            server = rate["server"]
            assert server is not None  # filtered above
            for bucket in server["batch_size_buckets"]:
                if bucket["le"] not in labels:
                    labels.append(bucket["le"])
        width = 0.8 / max(len(rates), 1)
        for index, rate in enumerate(rates):
            server = rate["server"]
            assert server is not None
            counts = {bucket["le"]: bucket["count"] for bucket in server["batch_size_buckets"]}
            shares = [counts.get(le, 0.0) / server["batches"] for le in labels]
            ax.bar(
                [i + index * width for i in range(len(labels))],
                shares,
                width=width,
                label=f"{rate['offered_rps']:g}/s (mean {server['batch_size_mean'] or 0:.1f})",
            )
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
        ax.set_xticklabels([f"≤{_short(le)}" for le in labels], fontsize="small")
        ax.set_ylabel("share of batches")
        ax.set_title(f"Batch sizes: {_name(run)}" + ("" if rates else " (no batchwire_batch_size metrics)"))
        if rates:
            ax.legend(fontsize="small")
    fig.tight_layout()
    return _save(fig, path)


def _short(le: str) -> str:
    return le[:-2] if le.endswith(".0") else le


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(runs: Sequence[RunReport], out_dir: Path, backend_latency_ms: float | None = None) -> list[Path]:
    return [
        latency_plot(runs, out_dir / "latency.png", backend_latency_ms),
        throughput_plot(runs, out_dir / "throughput.png"),
        batch_size_plot(runs, out_dir / "batch_sizes.png"),
    ]
