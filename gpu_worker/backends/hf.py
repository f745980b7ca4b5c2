"""Hugging Face transformers backend: greedy generation or sentence embeddings, one batch per call.

Inputs are padded into one tensor batch with attention masks (left padding for decoder-only
models, so each prompt ends where its answer starts), decoded greedily, and only the answer's text
comes back: batched output equals one-by-one output up to rounding (kernels may round differently
for different batch shapes, by a step in float32 and more in half precision; a greedy choice between
near-tied tokens can follow it).

Inputs longer than ``max_input_tokens`` are per-request errors (``input_too_long``) reported by
``input_errors``, not silently truncated: a cut prompt gives a confident answer to a question
nobody asked. ``truncate=True`` chooses truncation instead.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, cast

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase

from gpu_worker.backends.base import BackendError, BatchSizeError, InputError, answered
from gpu_worker.backends.hf_embed import cls_pool, embedding_outputs, mean_pool
from gpu_worker.backends.hf_load import (
    DTYPES,
    TASKS,
    LoadedModel,
    ModelLoadError,
    Task,
    load_model_dir,
    resolve_device,
    resolve_dtype,
)
from gpu_worker.backends.sim import ReentryError
from schemas.records import INPUT_EMPTY, INPUT_TOO_LONG
from telemetry.metrics import BACKEND_BATCH_LATENCY, BACKEND_TOKENS

log = logging.getLogger(__name__)

WARMUP_PROMPT = "Hello, how are you?"
MAX_INPUT_TOKENS_SETTING = "BATCHWIRE_HF_MAX_INPUT_TOKENS"


class _Generates(Protocol):
    """What ``_run`` uses of a generative model: ``GenerationMixin.generate`` without dict outputs."""

    def generate(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        generation_config: GenerationConfig | None,
        tokenizer: PreTrainedTokenizerBase,
    ) -> torch.Tensor: ...


def batch_bucket(size: int) -> int:
    """The power of two at or above ``size``: latency is recorded per bucket, not per exact size."""
    return 1 << (size - 1).bit_length()


class HFBackend:
    """A local Hugging Face model behind ``batchstring``.

    ``task="generate"``: greedy continuation (decoder-only) or output (encoder-decoder), at most
    ``max_new_tokens`` tokens, special tokens dropped. ``task="embed"``: one JSON float array per
    input (pooled, and unit length, as the model's sentence-transformers layout says). ``name`` is what
    the worker reports as the ``backend`` label; ``model`` labels the latency gauge (the worker's model
    name; default: the directory name).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        task: Task = "generate",
        max_batch: int = 32,
        max_new_tokens: int = 32,
        max_input_tokens: int | None = None,
        truncate: bool = False,
        device: str = "auto",
        dtype: str = "auto",
        num_threads: int | None = None,
        warmup: bool = True,
        name: str | None = None,
        model: str | None = None,
    ) -> None:
        if task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if max_input_tokens is not None and max_input_tokens < 1:
            raise ValueError("max_input_tokens must be at least 1")
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(
                f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r} (--dtype, BATCHWIRE_DTYPE)"
            )
        if num_threads is not None and num_threads < 1:
            raise ValueError("num_threads must be at least 1")
        self.model_path = Path(model_path).expanduser()
        self.task: Task = task
        self.max_batch = max_batch
        self.max_new_tokens = max_new_tokens
        self.truncate = truncate
        self.device = device
        self.dtype = dtype
        self.num_threads = num_threads
        self.warmup = warmup
        self.name = name or "hf"
        self.model = model or self.model_path.name
        self._asked_max_input_tokens = max_input_tokens
        self.latency_by_batch_s: dict[int, float] = {}
        """Latest measured ``batchstring`` latency by batch-size bucket (see ``batch_bucket``)."""
        self.load_s: float | None = None
        self._loaded: LoadedModel | None = None
        self._busy = threading.Lock()
        self._counting = threading.Lock()

    @property
    def loaded(self) -> LoadedModel | None:
        """Model, tokenizers, device and limits once loaded (None before ``load`` and after ``close``)."""
        return self._loaded

    @property
    def max_input_tokens(self) -> int:
        """The longest input accepted, in tokens with special tokens; known once loaded."""
        return self._require_loaded().max_input_tokens

    # lifecycle -------------------------------------------------------------------------------
    def load(self) -> None:
        """Loads from the local directory only, then runs a warm-up batch of 1 and of ``max_batch``
        so that CUDA kernels, allocator pools and lazy inits are paid for before the first user, and a
        model that cannot run a batch fails here (``ModelLoadError``). Once: a loaded backend stays as it
        is (``up`` loads before it serves, and the worker's start again)."""
        if self._loaded is not None:
            return
        start = time.perf_counter()
        torch_device = resolve_device(self.device)
        torch_dtype = resolve_dtype(self.dtype, torch_device)
        if torch_device.type == "cuda":
            plan_free_attention()
        threads = self.num_threads or _default_threads(torch_device)
        if threads is not None:
            torch.set_num_threads(threads)
        self._loaded = load_model_dir(
            self.model_path,
            task=self.task,
            device=torch_device,
            dtype=torch_dtype,
            max_new_tokens=self.max_new_tokens,
            max_input_tokens=self._asked_max_input_tokens,
            truncate=self.truncate,
        )
        self.load_s = time.perf_counter() - start
        log.info(
            "hf backend: %s loaded for %s on %s as %s in %.2f s (max %d input tokens, %d torch threads)",
            self.model_path,
            self.task,
            torch_device,
            str(torch_dtype).removeprefix("torch."),
            self.load_s,
            self._loaded.max_input_tokens,
            torch.get_num_threads(),
        )
        if self.warmup:
            try:
                self._warm_up()
            except Exception as err:  # whatever the model raised: it cannot serve, which is a load that failed
                self.close()
                raise ModelLoadError(
                    f"the model in {self.model_path} loaded, but its warm-up batch failed: {type(err).__name__}: {err}"
                ) from err
            log.info("hf backend: warm-up latency by batch size %s", self.latency_by_batch_s)

    def _warm_up(self) -> None:
        # a limit shorter than the usual prompt (``max_input_tokens``) is warmed up with a character
        prompt = WARMUP_PROMPT if not self.input_errors([WARMUP_PROMPT]) else WARMUP_PROMPT[0]
        for size in sorted({1, self.max_batch}):
            try:
                self.batchstring([prompt] * size)
            except torch.OutOfMemoryError as err:  # the allocator's figures alone do not say which setting to change
                raise torch.OutOfMemoryError(f"{err}; {self._does_not_fit(size)}") from err

    def _does_not_fit(self, size: int) -> str:
        loaded = self._require_loaded()
        where = f"the memory of {loaded.device}"
        if size > 1:
            return f"a batch of {size} inputs does not fit in {where}: set a smaller --max-batch (BATCHWIRE_MAX_BATCH)"
        if loaded.dtype == torch.float32:
            return f"one input does not fit in {where}: set --dtype bfloat16 or float16 (BATCHWIRE_DTYPE)"
        return f"one input does not fit in {where}: use a device with more memory (--device, BATCHWIRE_DEVICE)"

    def close(self) -> None:
        """Drops the model; a call still running keeps its own reference until it returns."""
        loaded, self._loaded = self._loaded, None
        if loaded is not None and loaded.device.type == "cuda":
            del loaded
            torch.cuda.empty_cache()

    # the contract ----------------------------------------------------------------------------
    def input_errors(self, inputs: Sequence[str]) -> dict[int, InputError]:
        """``input_too_long`` for inputs over ``max_input_tokens`` (unless truncating) and
        ``input_empty`` for inputs with no tokens at all (a decoder has nothing to continue).

        Safe to call from another thread while ``batchstring`` runs: it counts with its own
        tokenizer instance.
        """
        loaded = self._require_loaded()
        if not inputs:
            return {}
        counts = self.count_tokens(inputs)
        return {
            index: error
            for index, count in enumerate(counts)
            if (error := self._length_error(index, count, loaded.max_input_tokens)) is not None
        }

    def count_tokens(self, inputs: Sequence[str]) -> list[int]:
        """Each input's length in tokens as the model sees it, special tokens included (thread-safe)."""
        loaded = self._require_loaded()
        if not inputs:
            return []
        with self._counting:
            encoded = loaded.counter(
                list(inputs), add_special_tokens=True, padding=False, truncation=False, verbose=False
            )
        return [len(ids) for ids in encoded["input_ids"]]

    def batchstring(self, inputs: list[str]) -> list[str]:
        """One output per input, in order: generated text, or a JSON embedding for ``embed``;
        ``PartialOutputs`` when some embeddings are not finite."""
        if not inputs or len(inputs) > self.max_batch:
            raise BatchSizeError(f"batchstring takes 1 to {self.max_batch} inputs, got {len(inputs)}")
        if not self._busy.acquire(blocking=False):
            raise ReentryError("batchstring entered twice at once: a GPU runs one call at a time")
        try:
            loaded = self._require_loaded()
            start = time.perf_counter()
            outputs = self._run(loaded, inputs)
            self._record_latency(len(inputs), time.perf_counter() - start)
            return answered(outputs)
        finally:
            self._busy.release()

    # batches ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def _run(self, loaded: LoadedModel, inputs: list[str]) -> Sequence[str | InputError]:
        encoded = loaded.tokenizer(
            inputs,
            padding=True,
            truncation=self.truncate,
            max_length=loaded.max_input_tokens if self.truncate else None,
            return_tensors="pt",
            return_attention_mask=True,
            verbose=False,
        )
        input_ids = cast(torch.Tensor, encoded["input_ids"])
        attention_mask = cast(torch.Tensor, encoded["attention_mask"])
        # input_errors is the place to catch these; checking again costs nothing and keeps a
        # worker that skipped it from crashing the model (or a CUDA context) on a bad index.
        for index, count in enumerate(attention_mask.sum(dim=1).tolist()):
            error = self._length_error(index, int(count), loaded.max_input_tokens)
            if error is not None:
                raise error
        tokens = int(attention_mask.sum())
        BACKEND_TOKENS.labels(model=self.model, kind="input").inc(tokens)
        BACKEND_TOKENS.labels(model=self.model, kind="padding").inc(attention_mask.numel() - tokens)
        input_ids = input_ids.to(loaded.device)
        attention_mask = attention_mask.to(loaded.device)
        if self.task == "embed":
            hidden = loaded.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            states = cast(torch.Tensor, hidden)
            if loaded.pooling == "cls":
                vectors = cls_pool(states, normalize=loaded.normalize)
            else:
                vectors = mean_pool(states, attention_mask, normalize=loaded.normalize)
            return embedding_outputs(vectors, loaded.dtype)
        # The tokenizer is for the stop strings a model's generation config may name (Gemma's
        # <end_of_turn>): without it generate refuses every batch.
        generated = cast(_Generates, loaded.model).generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=loaded.generation_config,
            tokenizer=loaded.tokenizer,
        )
        if loaded.is_encoder_decoder:
            return loaded.tokenizer.batch_decode(generated.tolist(), skip_special_tokens=True)
        return continuations(loaded.tokenizer, generated.tolist(), input_ids.shape[1])

    def _length_error(self, index: int, count: int, limit: int) -> InputError | None:
        if count == 0:
            return InputError(index, INPUT_EMPTY, "input has no tokens; the model needs at least one")
        if count > limit and not self.truncate:
            return InputError(
                index,
                INPUT_TOO_LONG,
                f"input is {count} tokens; the model accepts at most {limit} ({MAX_INPUT_TOKENS_SETTING})",
            )
        return None

    def _record_latency(self, size: int, seconds: float) -> None:
        bucket = batch_bucket(size)
        self.latency_by_batch_s[bucket] = seconds
        BACKEND_BATCH_LATENCY.labels(model=self.model, backend=self.name, batch_size=str(bucket)).set(seconds)

    def _require_loaded(self) -> LoadedModel:
        loaded = self._loaded
        if loaded is None:
            raise BackendError(f"the hf backend for {self.model_path} is not loaded (call load(); or it was closed)")
        return loaded


def continuations(tokenizer: PreTrainedTokenizerBase, sequences: list[list[int]], prompt_width: int) -> list[str]:
    """Each sequence's text after its prompt's (left padding lines every prompt up to end at
    ``prompt_width``), as transformers' text-generation pipeline cuts it.

    The new tokens decoded alone would lose a space: a SentencePiece decoder (Llama 2, Mistral) drops the
    space of a text's first token, so "The capital is" would get "Paris" for " Paris". Where the whole text
    does not start with the prompt's (a tokenizer's clean-up that joins across the seam), the new tokens
    are decoded alone.
    """
    prompts = tokenizer.batch_decode([sequence[:prompt_width] for sequence in sequences], skip_special_tokens=True)
    wholes = tokenizer.batch_decode(sequences, skip_special_tokens=True)
    return [
        whole[len(prompt) :]
        if whole.startswith(prompt)
        else tokenizer.batch_decode([sequence[prompt_width:]], skip_special_tokens=True)[0]
        for prompt, whole, sequence in zip(prompts, wholes, sequences, strict=True)
    ]


def plan_free_attention() -> None:
    """Turns cuDNN's scaled-dot-product attention off for this process (the worker's or profile's).

    cuDNN builds an execution plan the first time it meets an input shape, and a worker's batches
    keep bringing new shapes (batch size times padded length): each new one would stall its batch
    by tens of milliseconds (docs/capacity.md). Flash and memory-efficient attention need no plan.
    """
    torch.backends.cuda.enable_cudnn_sdp(False)


def _default_threads(device: torch.device) -> int | None:
    """On CPU, all cores but one: the worker's event loop keeps a core for heartbeats and Kafka
    while the model computes. On a GPU torch's default stands (its CPU threads mostly wait)."""
    if device.type != "cpu":
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus - 1)
