"""``batchwire profile``: a backend's call latency by batch size, alone, written as a curve file.

It builds the backend the worker would (``gpu_worker.backends.factory``), loads it, warms it up,
then times ``batchstring`` for each batch size over several repeats and keeps p50 and p99. A plot
beside the curve comes when matplotlib is installed (the bench extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from batchwire.capacity.curve import Curve, CurvePoint, percentile
from gpu_worker.backends.base import Backend, BackendError
from gpu_worker.backends.factory import BackendConfigError, BackendSettings, make_backend


class ProfileError(ValueError):
    """The profile cannot run as asked; the message says what to change."""


def ladder(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to ``max_batch``, which is always measured: the curve interpolates between."""
    sizes = [1]
    while sizes[-1] * 2 < max_batch:
        sizes.append(sizes[-1] * 2)
    return sorted({*sizes, max_batch})


def parse_sizes(text: str, max_batch: int) -> list[int]:
    """``all`` (every size 1..max), ``ladder`` (powers of two and the max), or a comma-separated list."""
    if text == "all":
        return list(range(1, max_batch + 1))
    if text == "ladder":
        return ladder(max_batch)
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as err:
        raise ProfileError(f"--sizes takes all, ladder or comma-separated sizes, got {text!r}") from err
    if not sizes or sizes[0] < 1 or sizes[-1] > max_batch:
        raise ProfileError(f"--sizes must lie within 1..{max_batch} (the backend's max batch), got {text!r}")
    return sizes


def profile_backend(
    backend: Backend,
    sizes: Sequence[int],
    repeats: int,
    input_chars: int = 64,
    clock: Callable[[], float] = time.perf_counter,
) -> Curve:
    """Times ``backend.batchstring`` at each size ``repeats`` times (after one warm-up call)."""
    if repeats < 1:
        raise ProfileError(f"--repeats must be at least 1, got {repeats}")
    inputs = [("profile input " * (input_chars // 14 + 1))[:input_chars] for _ in range(max(sizes))]
    for warm_up in (1, max(sizes)):
        backend.batchstring(inputs[:warm_up])
    points: list[CurvePoint] = []
    for size in sizes:
        took_ms: list[float] = []
        for _ in range(repeats):
            started = clock()
            backend.batchstring(inputs[:size])
            took_ms.append((clock() - started) * 1000.0)
        took_ms.sort()
        p50, p99 = percentile(took_ms, 0.5), percentile(took_ms, 0.99)
        points.append(CurvePoint(size, round(p50, 3), round(max(p99, p50), 3)))
    meta = {"repeats": repeats, "input_chars": input_chars, "host": platform.node()}
    return Curve(tuple(points), backend.name, meta)


def plot(curve: Curve, path: Path) -> bool:
    """Writes the curve as a PNG when the bench extra (matplotlib) is installed; returns whether it did."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    from batchwire.bench.curve_plot import plot_curve  # the bench extra: optional

    plot_curve(curve, path)
    return True


# the command ------------------------------------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("profile", help="time a backend's calls by batch size and write a curve file")
    parser.add_argument("--backend", default="sim", choices=["sim", "hf"], help="model backend to time")
    parser.add_argument("--sim-latency-ms", type=float, default=100.0, help="sim backend: latency of one call")
    parser.add_argument("--model-path", default=None, help="hf backend: local checkpoint directory")
    parser.add_argument("--hf-task", default="generate", help="hf backend: generate or embed")
    parser.add_argument("--device", default="auto", help="hf backend: auto, cpu, cuda or cuda:N")
    parser.add_argument("--max-batch", type=int, default=None, help="largest batch (default: the backend's)")
    parser.add_argument("--sizes", default="ladder", help="all, ladder (1, 2, 4, ... and the max) or a list")
    parser.add_argument("--repeats", type=int, default=5, help="calls per size (p50 and p99 over them)")
    parser.add_argument("--input-chars", type=int, default=64, help="length of each input in characters")
    parser.add_argument("--out", required=True, help="curve file to write (JSON); a .png beside it if it can")
    parser.add_argument("--log-level", default="warning", help="debug, info, warning or error")


def _backend(args: argparse.Namespace) -> Backend:
    if args.backend == "hf" and importlib.util.find_spec("torch") is None:
        raise ProfileError("the hf backend needs torch and transformers: install the hf extra, pip install -e '.[hf]'")
    settings = BackendSettings(
        backend=args.backend,
        sim_latency_ms=args.sim_latency_ms,
        max_batch=args.max_batch,
        model_path=args.model_path,
        hf_task=args.hf_task,
        device=args.device,
    )
    return make_backend(settings, "profile")


def run(args: argparse.Namespace) -> int:
    """``batchwire profile``."""
    try:
        backend = _backend(args)
        backend.load()
        try:
            curve = profile_backend(backend, parse_sizes(args.sizes, backend.max_batch), args.repeats, args.input_chars)
        finally:
            backend.close()
    except (ProfileError, BackendConfigError, BackendError) as err:
        print(f"batchwire profile: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    curve.save(out)
    plotted = plot(curve, out.with_suffix(".png"))
    note = f" and {out.with_suffix('.png')}" if plotted else " (no plot: matplotlib is not installed)"
    print(f"wrote {out}{note}")
    for point in curve.points:
        print(f"  {point.size:>5} items: p50 {point.p50_ms:.1f} ms, p99 {point.p99_ms:.1f} ms")
    return 0
