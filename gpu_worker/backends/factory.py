"""Builds the backend a worker was configured with."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.backends.base import Backend
from gpu_worker.backends.sim import SimBackend


class BackendConfigError(ValueError):
    """The backend settings do not fit together; the message says which flag to change."""


@dataclass(frozen=True, slots=True)
class BackendSettings:
    backend: str = "sim"
    sim_latency_ms: float = 100.0
    max_batch: int = 100
    model_path: str | None = None
    hf_task: str = "generate"
    max_new_tokens: int = 32
    device: str = "auto"
    dtype: str = "auto"


def make_backend(settings: BackendSettings, model: str) -> Backend:
    if settings.backend == "sim":
        return SimBackend(latency_ms=settings.sim_latency_ms, max_batch=settings.max_batch)
    if settings.backend == "hf":
        if not settings.model_path:
            raise BackendConfigError(
                "the hf backend needs --model-path (BATCHWIRE_MODEL_PATH): a local directory with the "
                "checkpoint saved by save_pretrained; nothing is downloaded at run time"
            )
        from gpu_worker.backends.hf import HFBackend

        return HFBackend(
            settings.model_path,
            task=settings.hf_task,  # type: ignore[arg-type]  # validated by HFBackend
            max_batch=settings.max_batch,
            max_new_tokens=settings.max_new_tokens,
            device=settings.device,
            dtype=settings.dtype,
            name=model,
        )
    raise BackendConfigError(f"unknown backend {settings.backend!r}: use sim or hf (--backend / BATCHWIRE_BACKEND)")
