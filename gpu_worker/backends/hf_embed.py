"""Sentence embeddings from a token encoder: attention-mask-weighted mean (or the first token's state),
L2-normalized unless the model's layout leaves that out, as JSON.

The mean is the pooling all-MiniLM-L6-v2 and most sentence-transformers models were trained with
(``1_Pooling/config.json``: ``pooling_mode_mean_tokens``); BAAI's bge models pool by the CLS token
(``pooling_mode_cls_token``). Dot-product models (msmarco-distilbert-dot-v5) leave out the L2
norm. The model directory says which (``hf_load.sentence_transformers_layout``), so the vectors match
the model's own.
"""

from __future__ import annotations

import json

import torch

from gpu_worker.backends.base import InputError

NON_FINITE_EMBEDDING = "non_finite_embedding"
"""The error code of an input whose vector holds NaN or infinity (float16's range overflowed, say)."""

DECIMALS = 6
"""Rounding of each component. float32 holds about 7 significant digits anyway; a cosine of two
rounded unit vectors moves by at most sqrt(dim) * 1e-6 (2e-5 for 384 dimensions), far below what
ranking by similarity notices, and the JSON is much shorter than with full float repr."""


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor, *, normalize: bool = True) -> torch.Tensor:
    """(batch, tokens, dim) -> (batch, dim) vectors, unit length with ``normalize``; padding positions
    count for nothing.

    Pooled in float32 whatever the model's dtype: a sum over hundreds of fp16 tokens loses digits.
    """
    mask = attention_mask.unsqueeze(-1).to(torch.float32)
    summed = (hidden.to(torch.float32) * mask).sum(dim=1)
    counts = mask.sum(dim=1).clamp(min=1e-9)
    return _unit(summed / counts) if normalize else summed / counts


def cls_pool(hidden: torch.Tensor, *, normalize: bool = True) -> torch.Tensor:
    """(batch, tokens, dim) -> (batch, dim) vectors, unit length with ``normalize``: each input's first
    (CLS) token's state; padding is on the right, so it is every input's own first token."""
    first = hidden[:, 0].to(torch.float32)
    return _unit(first) if normalize else first


def _unit(vectors: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(vectors, p=2.0, dim=1)


def to_json(vectors: torch.Tensor) -> list[str]:
    """One JSON array of floats per row, e.g. ``[0.012345,-0.5,...]``, rounded to ``DECIMALS``."""
    rows: list[list[float]] = vectors.detach().to("cpu", torch.float64).round(decimals=DECIMALS).tolist()
    return [json.dumps(row, separators=(",", ":")) for row in rows]


def embedding_outputs(vectors: torch.Tensor, dtype: torch.dtype) -> list[str | InputError]:
    """``to_json`` of each row, or for a row that is not finite (which JSON cannot carry, and no
    similarity can use) an ``InputError`` saying what to change; ``dtype`` is the model's."""
    finite: list[bool] = torch.isfinite(vectors).all(dim=1).tolist()
    return [
        row if ok else _not_finite(index, dtype)
        for index, (row, ok) in enumerate(zip(to_json(vectors), finite, strict=True))
    ]


def _not_finite(index: int, dtype: torch.dtype) -> InputError:
    if dtype == torch.float16:
        why = "the model's activations likely overflowed float16; run it in bfloat16 or float32"
        why += " (--dtype, BATCHWIRE_DTYPE)"
    elif dtype != torch.float32:
        why = f"the model computes in {str(dtype).removeprefix('torch.')}; run it in float32 (--dtype, BATCHWIRE_DTYPE)"
    else:
        why = "the model computes in float32, so its weights may hold NaN or infinity"
    return InputError(
        index, NON_FINITE_EMBEDDING, f"the embedding of this input is not finite (NaN or infinity): {why}"
    )
