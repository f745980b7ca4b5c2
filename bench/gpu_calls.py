"""What one hf call on a GPU costs beyond its profile: a batch size or input length seen for the
first time (with cuDNN's attention, which plans each new shape, and without it, as the backend
runs), inputs of mixed lengths (padded to the longest), and a second Python thread that wants the
GIL while the call launches its kernels (in embedded mode the event loop is that thread).

    python3 bench/gpu_calls.py MODEL_DIR [DEVICE] > calls.json

bench/device.sh runs it on a lent GPU; docs/capacity.md reads its figures.
"""

from __future__ import annotations

import json
import random
import statistics
import string
import sys
import threading
import time

import torch

from batchwire.capacity.profile import phrase_text
from gpu_worker.backends.hf import HFBackend


def timed_ms(backend: HFBackend, inputs: list[str]) -> float:
    started = time.perf_counter()
    backend.batchstring(inputs)
    return round((time.perf_counter() - started) * 1000.0, 3)


def main() -> None:
    path, device = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cuda"
    backend = HFBackend(path, task="embed", max_batch=100, device=device)
    backend.load()  # warms sizes 1 and 100 with one short input, as the worker does; cuDNN attention off
    rng = random.Random(1)
    alphabet = string.ascii_letters + string.digits
    fixed = phrase_text(160)
    out: dict[str, object] = {"device": device}

    for cudnn, sizes in ((True, (3, 5, 7, 9, 11, 13, 15, 17)), (False, (19, 21, 23, 25, 27, 29, 31, 33))):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)  # load() turned it off; on is torch's default
        first, second = [], []
        for size in sizes:
            first.append(timed_ms(backend, [fixed] * size))
            second.append(timed_ms(backend, [fixed] * size))
        out["new_batch_size" + ("_cudnn_attention" if cudnn else "")] = {"first_ms": first, "second_ms": second}

    first, second = [], []
    for chars in (20, 40, 60, 80, 100, 120, 140):
        text = phrase_text(chars)
        first.append(timed_ms(backend, [text]))
        second.append(timed_ms(backend, [text]))
    out["new_length_batch_1"] = {"first_ms": first, "second_ms": second}

    def randoms(size: int) -> list[str]:
        return ["".join(rng.choices(alphabet, k=32)) for _ in range(size)]

    batches = [randoms(100) for _ in range(15)]
    tokens = [max(backend.count_tokens(b)) for b in batches]
    mixed = [timed_ms(backend, b) for b in batches]
    mixed_again = [timed_ms(backend, b) for b in batches]
    same = [timed_ms(backend, [fixed] * 100) for _ in range(15)]
    out["batch_100"] = {
        "fixed_160_chars_tokens": backend.count_tokens([fixed])[0],
        "fixed_p50_ms": statistics.median(same),
        "random_32_chars_longest_tokens": tokens,
        "random_first_ms": mixed,
        "random_again_ms": mixed_again,
    }

    def calls(size: int, count: int) -> list[float]:
        return [timed_ms(backend, [fixed] * size) for _ in range(count)]

    stop = threading.Event()

    def spin() -> None:  # pure Python, as an event loop parsing HTTP is
        n = 0
        while not stop.is_set():
            n += sum(range(200))

    for interval in (0.005, 0.0005):
        sys.setswitchinterval(interval)
        alone = calls(8, 30)
        spinner = threading.Thread(target=spin)
        spinner.start()
        busy = calls(8, 30)
        stop.set()
        spinner.join()
        stop.clear()
        out[f"gil_switch_{interval * 1000:g}ms"] = {
            "alone_p50_ms": statistics.median(alone),
            "beside_a_busy_thread_p50_ms": statistics.median(busy),
            "beside_a_busy_thread_max_ms": max(busy),
        }
    sys.setswitchinterval(0.005)

    from torch.profiler import ProfilerActivity, profile

    torch.backends.cuda.enable_cudnn_sdp(True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        took = timed_ms(backend, [fixed] * 37)  # a size not seen yet, with cuDNN's attention
    out["profiled_new_size_37_cudnn_attention_ms"] = took
    out["profiled_top_ops"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    backend.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
