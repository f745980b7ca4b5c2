"""Mean pooling and its JSON form, on hand-made tensors."""

from __future__ import annotations

import json

import torch

from gpu_worker.backends.hf_embed import mean_pool, to_json


def test_mean_pool_ignores_padding_and_normalizes() -> None:
    hidden = torch.tensor(
        [
            [[3.0, 0.0], [1.0, 0.0], [999.0, -999.0]],  # last position is padding
            [[0.0, 2.0], [0.0, 4.0], [0.0, 6.0]],
        ]
    )
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    pooled = mean_pool(hidden, mask)
    assert torch.allclose(pooled, torch.tensor([[1.0, 0.0], [0.0, 1.0]])), pooled


def test_mean_pool_is_float32_whatever_the_model_dtype() -> None:
    hidden = torch.ones(1, 2, 4, dtype=torch.float16)
    pooled = mean_pool(hidden, torch.ones(1, 2, dtype=torch.long))
    assert pooled.dtype == torch.float32
    assert torch.allclose(pooled, torch.full((1, 4), 0.5))


def test_to_json_rounds_to_six_decimals() -> None:
    (text,) = to_json(torch.tensor([[0.1234567891, -0.5, 1e-9]]))
    assert text == "[0.123457,-0.5,0.0]"
    assert json.loads(text) == [0.123457, -0.5, 0.0]
