"""Tiny Hugging Face models, built once per session into a temporary directory (no network).

torch and transformers come with the ``hf`` extra, which ``make install`` always installs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from batchwire.bench.tiny_models import build_tiny_causal_lm, build_tiny_encoder, build_tiny_seq2seq


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model directories by name: ``gpt2`` and ``llama`` (decoder-only), ``t5`` (encoder-decoder),
    ``bert`` (encoder, for embeddings). Tests must not write into them; copy first."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        "gpt2": build_tiny_causal_lm(root / "gpt2", arch="gpt2"),
        "llama": build_tiny_causal_lm(root / "llama", arch="llama"),
        "t5": build_tiny_seq2seq(root / "t5"),
        "bert": build_tiny_encoder(root / "bert"),
    }
