"""``batchwire profile``: a backend's call latency by batch size, alone, written as a curve file.

It builds the backend the worker would (``gpu_worker.backends.factory``), loads it, warms it up,
then times ``batchstring`` for each batch size over several repeats and keeps p50 and p99. A
backend with a tokenizer (hf) is timed again at each input length of ``--lengths``, in tokens as
the model counts them. A plot beside the curve comes when matplotlib is installed (the bench extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from batchwire.capacity.curve import Curve, CurvePoint, TokenCurve, percentile
from batchwire.settings import number
from gpu_worker.backends.base import Backend, BackendError
from gpu_worker.backends.factory import BackendConfigError, BackendSettings, make_backend
from telemetry.logs import LEVEL_NAMES

AUTO_LENGTHS = (16, 64, 256)
"""``--lengths auto``: input lengths in tokens, each within the model's longest input."""
MAX_INPUT_CHARS = 1 << 20
"""The longest input tried for a length: a tokenizer whose count stops growing is an error, not a hang."""
PHRASE = "profile input "
"""Profile inputs repeat this phrase: words a tokenizer splits the same way wherever they fall."""


def phrase_text(chars: int) -> str:
    """A profile input ``chars`` characters long: ``PHRASE`` repeated and cut."""
    return (PHRASE * (chars // len(PHRASE) + 1))[:chars]


class ProfileError(ValueError):
    """The profile cannot run as asked; the message says what to change."""


@runtime_checkable
class CountsTokens(Protocol):
    """A backend that can say how long an input is for its model (the hf backend)."""

    max_input_tokens: int

    def count_tokens(self, inputs: Sequence[str]) -> list[int]: ...


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
    lengths: Sequence[int] = (),
) -> Curve:
    """Times ``backend.batchstring`` at each size ``repeats`` times (after one untimed call), with
    inputs ``input_chars`` long, then again at each of ``lengths`` tokens (``by_tokens``)."""
    if repeats < 1:
        raise ProfileError(f"--repeats must be at least 1, got {repeats}")
    if input_chars < 1:
        raise ProfileError(f"--input-chars must be at least 1, got {input_chars}")
    meta: dict[str, object] = {"repeats": repeats, "input_chars": input_chars, "host": platform.node()}
    text = phrase_text(input_chars)
    counter = backend if isinstance(backend, CountsTokens) else None
    if counter is not None:
        meta["input_tokens"] = counter.count_tokens([text])[0]
    elif lengths:
        raise ProfileError(f"--lengths needs a backend with a tokenizer (hf); the {backend.name} backend has none")
    points = _time_sizes(backend, text, sizes, repeats, clock)
    by_tokens: dict[int, TokenCurve] = {}
    for tokens in lengths:
        assert counter is not None  # refused above
        long_text, counted = text_of_tokens(counter, tokens)
        by_tokens[counted] = TokenCurve(counted, _time_sizes(backend, long_text, sizes, repeats, clock))
    return Curve(points, backend.name, meta, tuple(by_tokens[t] for t in sorted(by_tokens)))


def _time_sizes(
    backend: Backend, text: str, sizes: Sequence[int], repeats: int, clock: Callable[[], float]
) -> tuple[CurvePoint, ...]:
    inputs = [text] * max(sizes)
    points: list[CurvePoint] = []
    for size in sizes:
        # A shape's first call pays one-off costs (an attention plan, a kernel's loading) that a
        # service pays once, not per call: it is not timed.
        backend.batchstring(inputs[:size])
        took_ms: list[float] = []
        for _ in range(repeats):
            started = clock()
            backend.batchstring(inputs[:size])
            took_ms.append((clock() - started) * 1000.0)
        took_ms.sort()
        p50, p99 = percentile(took_ms, 0.5), percentile(took_ms, 0.99)
        points.append(CurvePoint(size, round(p50, 3), round(max(p99, p50), 3)))
    return tuple(points)


def text_of_tokens(backend: CountsTokens, tokens: int) -> tuple[str, int]:
    """The longest run of ``PHRASE`` that the model reads as at most ``tokens`` tokens, and its count.

    Found by bisection on the length in characters: a tokenizer's count grows with the text.
    """
    if tokens > backend.max_input_tokens:
        raise ProfileError(f"--lengths {tokens} is longer than the model accepts ({backend.max_input_tokens} tokens)")

    def count(chars: int) -> int:
        return backend.count_tokens([phrase_text(chars)])[0]

    if count(1) > tokens:
        raise ProfileError(f"--lengths {tokens} is shorter than the shortest input ({count(1)} tokens with specials)")
    fits, over = 1, 2
    while count(over) <= tokens:
        if over > MAX_INPUT_CHARS:
            raise ProfileError(f"no input up to {MAX_INPUT_CHARS} characters reaches {tokens} tokens")
        fits, over = over, over * 2
    while over - fits > 1:
        middle = (fits + over) // 2
        fits, over = (middle, over) if count(middle) <= tokens else (fits, middle)
    return phrase_text(fits), count(fits)


def parse_lengths(text: str, backend: Backend) -> list[int]:
    """``auto`` (16, 64, 256 within the model's longest input; none for a backend without a
    tokenizer), ``none``, or comma-separated lengths in tokens."""
    if text == "none":
        return []
    if text == "auto":
        if not isinstance(backend, CountsTokens):
            return []
        return sorted({min(length, backend.max_input_tokens) for length in AUTO_LENGTHS})
    try:
        lengths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as err:
        raise ProfileError(f"--lengths takes auto, none or comma-separated token counts, got {text!r}") from err
    if not lengths or lengths[0] < 1:
        raise ProfileError(f"--lengths takes positive token counts, got {text!r}")
    return lengths


def plot(curve: Curve, path: Path) -> bool:
    """Writes the curve as a PNG when the bench extra (matplotlib) is installed; returns whether it did."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    from batchwire.bench.curve_plot import plot_curve  # the bench extra: optional

    plot_curve(curve, path)
    return True


# the command ------------------------------------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("profile")
    parser.add_argument("--backend", default="sim", choices=["sim", "hf"], help="model backend to time")
    parser.add_argument("--sim-latency-ms", type=number, default=100.0, help="sim backend: latency of one call")
    parser.add_argument("--model-path", default=None, help="hf backend: local checkpoint directory")
    parser.add_argument("--hf-task", default="generate", help="hf backend: generate or embed")
    parser.add_argument("--device", default="auto", help="hf backend: auto, cpu, cuda or cuda:N")
    parser.add_argument("--max-batch", type=int, default=None, help="largest batch (default: the backend's)")
    parser.add_argument("--sizes", default="ladder", help="all, ladder (1, 2, 4, ... and the max) or a list")
    parser.add_argument("--repeats", type=int, default=5, help="calls per size (p50 and p99 over them)")
    parser.add_argument("--input-chars", type=int, default=64, help="length of each input in characters")
    parser.add_argument(
        "--lengths",
        default="auto",
        help="hf backend: also time each batch size at these input lengths in tokens (auto: 16,64,256; none)",
    )
    parser.add_argument("--out", required=True, help="curve file to write (JSON); a .png beside it if it can")
    parser.add_argument("--log-level", default="warning", help=LEVEL_NAMES)


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


def check_out(out: Path) -> None:
    """Before the work (the timing takes minutes on a real model; validate-sim's simulations, a while):
    an output with nowhere to go would be lost in a traceback at the end."""
    folder = out.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ProfileError(f"--out {out}: {folder} is not a folder this can write into")
    if out.is_dir():
        raise ProfileError(f"--out {out} is a folder; name a file")


def run(args: argparse.Namespace) -> int:
    """``batchwire profile``."""
    out = Path(args.out)
    try:
        check_out(out)
        backend = _backend(args)
        backend.load()
        try:
            sizes = parse_sizes(args.sizes, backend.max_batch)
            lengths = parse_lengths(args.lengths, backend)
            curve = profile_backend(backend, sizes, args.repeats, args.input_chars, lengths=lengths)
        finally:
            backend.close()
    except (ProfileError, BackendConfigError, BackendError) as err:
        print(f"batchwire profile: {err}", file=sys.stderr)
        return 2
    curve.save(out)
    plotted = plot(curve, out.with_suffix(".png"))
    note = f" and {out.with_suffix('.png')}" if plotted else " (no plot: matplotlib is not installed)"
    print(f"wrote {out}{note}")
    tokens = curve.meta.get("input_tokens")
    print(f"inputs of {args.input_chars} characters" + (f" ({tokens} tokens)" if tokens is not None else ""))
    for point in curve.points:
        print(f"  {point.size:>5} items: p50 {point.p50_ms:.1f} ms, p99 {point.p99_ms:.1f} ms")
    for length in curve.by_tokens:
        shown = ", ".join(f"{p.size}: {p.p50_ms:.1f}" for p in length.points)
        print(f"inputs of {length.tokens} tokens, p50 ms by batch size: {shown}")
    return 0
