"""The tiny models: reproducible, and sensitive enough that the batching tests have teeth."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchwire.bench.tiny_models import build_tiny_causal_lm, byte_tokenizer


def test_same_seed_same_weights(tmp_path: Path) -> None:
    first = build_tiny_causal_lm(tmp_path / "a", seed=3)
    second = build_tiny_causal_lm(tmp_path / "b", seed=3)
    other = build_tiny_causal_lm(tmp_path / "c", seed=4)
    weights = "model.safetensors"
    assert (first / weights).read_bytes() == (second / weights).read_bytes()
    assert (first / weights).read_bytes() != (other / weights).read_bytes()


def test_building_leaves_the_global_random_stream_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_causal_lm(tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)


def test_byte_tokenizer_round_trips_any_text() -> None:
    tokenizer = byte_tokenizer()
    text = "ß∂ƒ© naïve café, 漢字 🙂"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text.encode())
    assert tokenizer.decode(ids) == text


def test_right_padding_would_change_the_answers(tiny_models: dict[str, Path]) -> None:
    """Guards the key batching test: on this model a padding mistake is visible."""
    path = tiny_models["gpt2"]
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert not model.training, "from_pretrained should hand back a model in eval mode"
    prompts = ["a", "hello there", "The quick brown fox"]

    def answers(side: str, texts: list[str]) -> list[str]:
        tokenizer.padding_side = side
        encoded = tokenizer(texts, padding=True, return_tensors="pt")
        # cast: transformers annotates generate's self with a Protocol that mypy cannot match.
        generate = cast(Any, model).generate
        out = generate(**encoded, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        return list(tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True))

    singly = [answers("left", [text])[0] for text in prompts]
    assert answers("left", prompts) == singly
    assert answers("right", prompts) != singly
