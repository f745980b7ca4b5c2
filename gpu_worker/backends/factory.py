"""Builds the backend a worker was configured with."""

from __future__ import annotations

import os
from dataclasses import dataclass

from gpu_worker.backends.base import Backend
from gpu_worker.backends.sim import SimBackend


class BackendConfigError(ValueError):
    """The backend settings do not fit together; the message says which flag to change."""


@dataclass(frozen=True, slots=True)
class BackendSettings:
    backend: str = "sim"
    sim_latency_ms: float = 100.0
    sim_hang_on: str | None = None
    """sim: hang forever on a batch holding an input that contains this (fault tests)."""
    sim_crash_on: str | None = None
    """sim: kill the process (exit 70) on a batch holding an input that contains this (fault tests)."""
    max_batch: int | None = None
    """None: the backend's own default (sim: 100, hf: 32)."""
    model_path: str | None = None
    hf_task: str = "generate"
    hf_max_new_tokens: int = 32
    hf_max_input_tokens: int | None = None
    hf_truncate: bool = False
    hf_num_threads: int | None = None
    device: str = "auto"
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.sim_latency_ms < 0:
            raise BackendConfigError(
                f"--sim-latency-ms must be >= 0, got {self.sim_latency_ms} (BATCHWIRE_SIM_LATENCY_MS)"
            )
        counts = {
            "--max-batch (BATCHWIRE_MAX_BATCH)": self.max_batch,
            "--hf-max-new-tokens (BATCHWIRE_HF_MAX_NEW_TOKENS)": self.hf_max_new_tokens,
            "--hf-max-input-tokens (BATCHWIRE_HF_MAX_INPUT_TOKENS)": self.hf_max_input_tokens,
            "--hf-num-threads (BATCHWIRE_HF_NUM_THREADS)": self.hf_num_threads,
        }
        for flag, count in counts.items():
            if count is not None and count < 1:
                raise BackendConfigError(f"{flag} must be at least 1, got {count}")


def make_backend(settings: BackendSettings, model: str) -> Backend:
    if settings.backend == "sim":
        return SimBackend(
            latency_ms=settings.sim_latency_ms,
            max_batch=settings.max_batch or 100,
            hang_on=settings.sim_hang_on,
            crash_on=settings.sim_crash_on,
        )
    if settings.backend == "hf":
        if not settings.model_path:
            raise BackendConfigError(
                "the hf backend needs --model-path (BATCHWIRE_MODEL_PATH): a local directory with the "
                "checkpoint saved by save_pretrained; nothing is downloaded at run time"
            )
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # one log line per load, not a bar
        try:
            from gpu_worker.backends.hf import HFBackend
            from gpu_worker.backends.hf_load import ModelLoadError, check_model_dir, resolve_device
        except ModuleNotFoundError as err:
            raise BackendConfigError(
                f"the hf backend needs the hf extra: pip install 'batchwire[hf]' (missing module: {err.name})"
            ) from err

        if settings.hf_task not in ("generate", "embed"):
            raise BackendConfigError(f"--hf-task is {settings.hf_task!r}; use generate or embed (BATCHWIRE_HF_TASK)")
        try:
            backend = HFBackend(
                settings.model_path,
                task="embed" if settings.hf_task == "embed" else "generate",
                max_batch=settings.max_batch or 32,
                max_new_tokens=settings.hf_max_new_tokens,
                max_input_tokens=settings.hf_max_input_tokens,
                truncate=settings.hf_truncate,
                num_threads=settings.hf_num_threads,
                device=settings.device,
                dtype=settings.dtype,
                model=model,
            )
        except ValueError as err:
            raise BackendConfigError(f"the hf backend: {err}") from err
        # The cheap part of the load, checked before the role starts: a wrong path or device is a flag
        # to change, said in one line, not in a traceback from the worker's start.
        try:
            check_model_dir(backend.model_path)
        except ModelLoadError as err:
            raise BackendConfigError(f"{err} (--model-path, BATCHWIRE_MODEL_PATH)") from err
        try:
            resolve_device(settings.device)
        except ModelLoadError as err:
            raise BackendConfigError(f"{err} (--device, BATCHWIRE_DEVICE)") from err
        return backend
    raise BackendConfigError(f"unknown backend {settings.backend!r}: use sim or hf (--backend / BATCHWIRE_BACKEND)")
