"""A latency curve as a picture (``batchwire profile`` draws one when the bench extra is installed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only

import matplotlib.pyplot as plt

from batchwire.capacity.curve import Curve


def plot_curve(curve: Curve, path: Path) -> None:
    """Writes p50 and p99 call latency by batch size as a PNG, and the p50 at each input length profiled."""
    figure, axes = plt.subplots(figsize=(6, 4))
    sizes = [p.size for p in curve.points]
    tokens = curve.meta.get("input_tokens")
    at = f", {tokens} tokens" if tokens is not None else ""
    axes.plot(sizes, [p.p50_ms for p in curve.points], marker="o", label=f"p50{at}")
    axes.plot(sizes, [p.p99_ms for p in curve.points], marker="x", label=f"p99{at}")
    for length in curve.by_tokens:
        lengths_sizes = [p.size for p in length.points]
        axes.plot(
            lengths_sizes, [p.p50_ms for p in length.points], linestyle="--", label=f"p50, {length.tokens} tokens"
        )
    axes.set_xlabel("batch size")
    axes.set_ylabel("call latency (ms)")
    axes.set_title(f"{curve.backend} backend")
    axes.legend()
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)
