"""Loading a Hugging Face model directory for ``HFBackend``: local files only, clear errors.

Everything here runs once, at start-up. It decides the device and dtype, the model class
(decoder-only or encoder-decoder, from ``config.is_encoder_decoder``), the padding side, and how
many input tokens the model takes; ``hf.py`` only runs batches.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from gpu_worker.backends.base import BackendError

log = logging.getLogger(__name__)

Task = Literal["generate", "embed"]
TASKS: tuple[Task, ...] = ("generate", "embed")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

FALLBACK_MAX_INPUT_TOKENS = 512
"""Used when neither the config nor the tokenizer states a limit (T5's relative positions, say)."""

# Tokenizers without a limit report this sentinel (transformers' VERY_LARGE_INTEGER is 1e30).
_NO_LIMIT = 10**9

EXPECTED_FILES = "config.json, model.safetensors (or pytorch_model.bin) and tokenizer files, as save_pretrained writes"


class ModelLoadError(BackendError):
    """The model directory is missing, is not a model, or does not fit the settings asked for."""


Pooling = Literal["mean", "cls"]


@dataclass(frozen=True)
class LoadedModel:
    """What ``HFBackend`` needs to run batches; ``tokenizer`` and ``counter`` are separate instances."""

    model: torch.nn.Module
    """The module called: the LM for ``generate``, the encoder for ``embed``."""
    tokenizer: PreTrainedTokenizerBase
    counter: PreTrainedTokenizerBase
    """A second tokenizer for ``input_errors``: fast tokenizers mutate their padding/truncation
    state on every call, so one instance shared by two threads fails ("Already borrowed")."""
    device: torch.device
    dtype: torch.dtype
    is_encoder_decoder: bool
    max_input_tokens: int
    generation_config: GenerationConfig | None
    pooling: Pooling = "mean"
    """How ``embed`` turns token states into one vector (``sentence_transformers_layout``)."""
    normalize: bool = True
    """Whether ``embed`` makes each vector unit length (``sentence_transformers_layout``)."""


def resolve_device(device: str) -> torch.device:
    """``auto`` is the first CUDA GPU when there is one, else the CPU. Only cpu and cuda: torch names
    other device types (meta, mps, xpu) that the backend does not run on, and a GPU index must be one
    torch sees; either would otherwise fail only in the load, as a model that cannot load."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as err:
        raise ModelLoadError(f"device {device!r} is not a torch device; use auto, cpu, cuda or cuda:N") from err
    if resolved.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device {device!r} is not one the hf backend runs on; use auto, cpu, cuda or cuda:N")
    if resolved.type != "cuda":
        return resolved
    if not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but torch sees no CUDA GPU; use device=cpu or auto")
    if resolved.index is not None and resolved.index >= (count := torch.cuda.device_count()):
        seen = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise ModelLoadError(
            f"device {device!r} asked for, but torch sees {count} CUDA GPU{'s' if count > 1 else ''} ({seen}); "
            "use one of those, or cuda (the first)"
        )
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on GPUs that have it (fp16 range problems gone), else fp16; fp32 on CPU,
    where half precision is slow and poorly covered."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def check_model_dir(model_path: Path) -> None:
    """Fails before transformers does, with a message that names the path and what belongs there."""
    if not model_path.exists():
        raise ModelLoadError(
            f"model directory {model_path} does not exist; expected a local Hugging Face model directory "
            f"({EXPECTED_FILES}). batchwire never downloads models: save or copy the model there first"
        )
    if not model_path.is_dir():
        raise ModelLoadError(f"model path {model_path} is a file; expected a directory holding {EXPECTED_FILES}")
    if not (model_path / "config.json").is_file():
        raise ModelLoadError(
            f"{model_path} is not a Hugging Face model directory: config.json is missing (expected {EXPECTED_FILES})"
        )


def load_model_dir(
    model_path: Path,
    *,
    task: Task,
    device: torch.device,
    dtype: torch.dtype,
    max_new_tokens: int,
    max_input_tokens: int | None,
    truncate: bool,
) -> LoadedModel:
    """Loads config, tokenizer (twice) and weights from ``model_path``, never from the network.

    ``local_files_only=True`` is the guarantee; ``HF_HUB_OFFLINE`` is set as well for any
    huggingface_hub code imported after this point (it reads the variable at import time).
    ``trust_remote_code`` stays off: a model directory must never run its own Python.
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    check_model_dir(model_path)
    try:
        config = cast(
            PretrainedConfig, AutoConfig.from_pretrained(model_path, local_files_only=True, trust_remote_code=False)
        )
        tokenizer = _load_tokenizer(model_path)
        counter = _load_tokenizer(model_path)
    except Exception as err:  # transformers raises many types here; all mean "not a usable model dir"
        raise ModelLoadError(f"cannot read the config or tokenizer in {model_path} ({EXPECTED_FILES}): {err}") from err
    _check_vocabulary(tokenizer, model_path)
    is_encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    _set_padding(tokenizer, task=task, is_encoder_decoder=is_encoder_decoder, model_path=model_path)
    if truncate:
        # Generation keeps the end of a long prompt (the part the answer follows); embeddings
        # and encoder-decoder models keep the start, as sentence-transformers does.
        tokenizer.truncation_side = "left" if task == "generate" and not is_encoder_decoder else "right"

    # Before the weights: a setting that cannot work should fail in a second, not after minutes of loading.
    limit = resolve_max_input_tokens(
        model_path, config, tokenizer, task=task, max_new_tokens=max_new_tokens, asked=max_input_tokens
    )
    pooling, normalize = sentence_transformers_layout(model_path) if task == "embed" else ("mean", True)

    pretrained = _load_weights(model_path, task=task, device=device, dtype=dtype, is_encoder_decoder=is_encoder_decoder)
    _check_embedding_rows(tokenizer, pretrained, model_path)
    model: torch.nn.Module = pretrained
    if task == "embed" and is_encoder_decoder:
        model = cast(torch.nn.Module, pretrained.get_encoder())  # sentence-T5 style: embed with the encoder alone
    generation = None
    if task == "generate":
        generation = greedy_generation_config(pretrained, tokenizer, max_new_tokens=max_new_tokens)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        counter=counter,
        device=device,
        dtype=dtype,
        is_encoder_decoder=is_encoder_decoder,
        max_input_tokens=limit,
        generation_config=generation,
        pooling=pooling,
        normalize=normalize,
    )


_WEIGHTS = threading.Lock()
"""One weights load at a time in a process: transformers' ``from_pretrained`` swaps process-wide state
while it loads (torch's default dtype, ``PreTrainedModel.tie_weights``) and puts it back after, so two
loads on two threads (an embedded process's workers) could leave one's swap in place for good: every
later model in a wrong dtype, a GPT-2's output layer untied from its embeddings."""


def _load_weights(
    model_path: Path, *, task: Task, device: torch.device, dtype: torch.dtype, is_encoder_decoder: bool
) -> PreTrainedModel:
    """The weights, in the model class the task and the config call for, in eval mode."""
    auto_class = AutoModel if task == "embed" else AutoModelForSeq2SeqLM if is_encoder_decoder else AutoModelForCausalLM
    device_map = None if device.type == "cpu" else str(device)  # straight onto the GPU, without a CPU copy first
    try:
        with _WEIGHTS:
            pretrained, info = cast(
                tuple[PreTrainedModel, dict[str, Any]],
                auto_class.from_pretrained(
                    model_path,
                    local_files_only=True,
                    trust_remote_code=False,
                    dtype=dtype,
                    device_map=device_map,
                    output_loading_info=True,
                ),
            )
    except Exception as err:  # OSError, SafetensorError, ValueError, RuntimeError (shape mismatch)...
        raise ModelLoadError(
            f"cannot load the {task} model in {model_path} with {auto_class.__name__} ({EXPECTED_FILES}): {err}"
        ) from err
    missing = sorted(info.get("missing_keys") or ())
    if task == "generate" and missing:
        # An encoder's checkpoint (an embedding model) under a language-model class: its head is random.
        # Embed is not checked: it runs the encoder alone, and a checkpoint may lack a pooler it never uses.
        raise ModelLoadError(
            f"the checkpoint in {model_path} has no weights for {len(missing)} parameters of "
            f"{type(pretrained).__name__} ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}), which "
            "would answer from random values: it is not a generating model. For an embedding model pass "
            "--hf-task embed (BATCHWIRE_HF_TASK)"
        )
    # from_pretrained does this too; said again because equal answers in any batch depend on no dropout.
    pretrained.eval()  # type: ignore[no-untyped-call]  # transformers' override is unannotated
    return pretrained


def _load_tokenizer(model_path: Path) -> PreTrainedTokenizerBase:
    return cast(
        PreTrainedTokenizerBase,
        AutoTokenizer.from_pretrained(model_path, local_files_only=True, trust_remote_code=False),
    )


def _check_vocabulary(tokenizer: PreTrainedTokenizerBase, model_path: Path) -> None:
    """With its files missing, transformers builds an empty tokenizer from the model type instead of
    failing; every input would then be zero tokens. Refuse it here, where the cause is known."""
    probe = tokenizer("Hello", add_special_tokens=False)["input_ids"]
    if len(tokenizer) < 2 or not probe:
        raise ModelLoadError(
            f"the tokenizer in {model_path} has no vocabulary: tokenizer files are missing "
            "(tokenizer.json, or vocab/merges or sentencepiece model files, as save_pretrained writes)"
        )


def _check_embedding_rows(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel, model_path: Path) -> None:
    """A token id past the model's input embedding rows fails each batch it is in (on a GPU, a device-side
    assert that breaks the process's CUDA context for every later call too): a tokenizer with ids past the
    table (tokens added, the model not resized) is refused. A smaller one is common (padded tables)."""
    try:
        rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    except NotImplementedError:  # a model class that does not say where its embeddings are
        return
    top = max(tokenizer.get_vocab().values(), default=0)
    if isinstance(rows, int) and top >= rows:
        raise ModelLoadError(
            f"the tokenizer in {model_path} has token ids up to {top}, but the model's input embeddings have "
            f"{rows} rows (ids 0 to {rows - 1}): an input with a token past them would fail; use the tokenizer "
            "the model was trained with, or resize the model's embeddings to the tokenizer (resize_token_embeddings)"
        )


def _set_padding(tokenizer: PreTrainedTokenizerBase, *, task: Task, is_encoder_decoder: bool, model_path: Path) -> None:
    """Left padding for decoder-only generation, so every prompt ends where generation starts;
    right padding otherwise (encoders with absolute positions expect their text at position 0)."""
    if task == "generate" and not is_encoder_decoder:
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise ModelLoadError(
                    f"the tokenizer in {model_path} has neither a pad token nor an eos token; batched "
                    "generation needs one of them to pad the shorter prompts"
                )
            tokenizer.pad_token = tokenizer.eos_token
    else:
        tokenizer.padding_side = "right"
        if tokenizer.pad_token is None:
            raise ModelLoadError(f"the tokenizer in {model_path} has no pad token; batching needs one")


def resolve_max_input_tokens(
    model_path: Path,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    task: Task,
    max_new_tokens: int,
    asked: int | None,
) -> int:
    """How many input tokens (special tokens included) one input may have.

    The hard limit is the positions the model has (``max_position_embeddings``, of its text config in a
    multimodal model); a decoder-only model must also fit the ``max_new_tokens`` it generates into them.
    The default is the tightest limit the model directory states (tokenizer ``model_max_length``, sentence-transformers'
    ``max_seq_length`` for embeddings); ``asked`` may go above that but not above the hard limit.
    """
    # A multimodal model (Gemma 3, Llama 4) states its language model's positions in its text config.
    text = config.get_text_config()
    positions = getattr(text, "max_position_embeddings", None)
    hard = positions if isinstance(positions, int) and positions > 0 else None
    why = ""  # how ``hard`` comes from ``positions``, for the error that names it
    pad = getattr(text, "pad_token_id", None)
    if hard is not None and getattr(text, "model_type", None) in _POSITIONS_AFTER_PADDING and isinstance(pad, int):
        hard -= pad + 1  # 514 positions hold 512 tokens: position ids start after the padding's
        why = f" ({positions} positions, the first {pad + 1} of which hold no token)"
    if hard is not None and task == "generate" and not getattr(config, "is_encoder_decoder", False):
        hard -= max_new_tokens
        why = (
            f"{why[:-1]}, less max_new_tokens={max_new_tokens})"
            if why
            else f" ({positions} positions less max_new_tokens={max_new_tokens})"
        )
        if hard < 1:
            raise ModelLoadError(
                f"max_new_tokens={max_new_tokens} leaves no room for input: the model in {model_path} has "
                f"{positions} positions for prompt and answer together (BATCHWIRE_HF_MAX_NEW_TOKENS)"
            )
    # An encoder-decoder's decoder has its own positions: the start token plus the answer.
    is_seq2seq_generation = task == "generate" and getattr(config, "is_encoder_decoder", False)
    if hard is not None and is_seq2seq_generation and max_new_tokens >= hard:
        raise ModelLoadError(
            f"max_new_tokens={max_new_tokens} is more than the decoder of the model in {model_path} can "
            f"produce: at most {hard - 1} (BATCHWIRE_HF_MAX_NEW_TOKENS)"
        )
    stated = [hard] if hard is not None else []
    if isinstance(tokenizer.model_max_length, int) and tokenizer.model_max_length < _NO_LIMIT:
        stated.append(tokenizer.model_max_length)
    if task == "embed":
        stated.extend(_sentence_transformers_max_seq_length(model_path))
    default = min(stated) if stated else FALLBACK_MAX_INPUT_TOKENS
    if asked is None:
        return default
    if hard is not None and asked > hard:
        raise ModelLoadError(
            f"max_input_tokens={asked} is more than the model in {model_path} can take: at most {hard}{why} "
            "(BATCHWIRE_HF_MAX_INPUT_TOKENS)"
        )
    specials = tokenizer.num_special_tokens_to_add(pair=False)
    if asked <= specials:  # else only the warm-up, or the first input, would find that no input fits
        raise ModelLoadError(
            f"max_input_tokens={asked} leaves no room for input: the tokenizer of the model in {model_path} adds "
            f"{specials} special tokens to each; set at least {specials + 1} (BATCHWIRE_HF_MAX_INPUT_TOKENS)"
        )
    return asked


_POSITIONS_AFTER_PADDING = frozenset(
    {
        "roberta",
        "roberta-prelayernorm",
        "xlm-roberta",
        "xlm-roberta-xl",
        "camembert",
        "data2vec-text",
        "mpnet",
        "longformer",
        "ibert",
        "xmod",
        "luke",
        "markuplm",
        "esm",
    }
)
"""Encoders whose position ids start at ``pad_token_id + 1`` (RoBERTa's numbering, which embedders built on
them keep): the first ``pad_token_id + 1`` of their ``max_position_embeddings`` hold no token."""


_MODULES = "sentence_transformers.models."
_RUN_HERE = frozenset({f"{_MODULES}Transformer", f"{_MODULES}Pooling", f"{_MODULES}Normalize"})
"""The sentence-transformers layers the backend runs: the encoder, its pooling, and the L2 norm."""


def sentence_transformers_layout(model_path: Path) -> tuple[Pooling, bool]:
    """How the sentence-transformers model in ``model_path`` pools its token states, ``mean`` or ``cls``
    (``1_Pooling/config.json``, as BAAI's bge models use), and whether it then makes each vector unit
    length (a ``Normalize`` layer: dot-product models, as msmarco-distilbert-dot-v5, have none, and
    their scores use the length). A directory without ``modules.json``: the mean, unit length. A layout
    the backend would get wrong (another pooling, a Dense layer) is refused: its vectors would not be
    the model's."""
    modules_path = model_path / "modules.json"
    if not modules_path.is_file():
        return "mean", True
    try:
        modules = json.loads(modules_path.read_text())
        layers = [(str(module["type"]), str(module.get("path", ""))) for module in modules]
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise ModelLoadError(f"cannot read {modules_path}: {err}") from err
    others = [kind for kind, _ in layers if kind not in _RUN_HERE]
    if others:
        raise ModelLoadError(
            f"{modules_path} names layers the hf backend does not run ({', '.join(others)}): its embeddings would "
            "not be the model's; use a model of a Transformer, a Pooling (mean or CLS) and at most a Normalize"
        )
    normalize = any(kind == f"{_MODULES}Normalize" for kind, _ in layers)
    pooling_dirs = [path for kind, path in layers if kind == f"{_MODULES}Pooling"]
    if not pooling_dirs:
        return "mean", normalize
    config_path = model_path / pooling_dirs[0] / "config.json"
    try:
        modes = {
            key for key, on in json.loads(config_path.read_text()).items() if key.startswith("pooling_mode_") and on
        }
    except (OSError, ValueError, AttributeError) as err:
        raise ModelLoadError(f"cannot read {config_path}: {err}") from err
    if modes == {"pooling_mode_mean_tokens"}:
        return "mean", normalize
    if modes == {"pooling_mode_cls_token"}:
        return "cls", normalize
    raise ModelLoadError(
        f"{config_path} pools by {', '.join(sorted(modes)) or 'nothing'}; the hf backend pools by the mean of the "
        "tokens or by the first (CLS) token only: use a model that pools one of those ways"
    )


def _sentence_transformers_max_seq_length(model_path: Path) -> list[int]:
    """sentence-transformers models state the length they were trained for (256 for all-MiniLM-L6-v2)
    in ``sentence_bert_config.json``; it is tighter than the 512 positions BERT has."""
    path = model_path / "sentence_bert_config.json"
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text()).get("max_seq_length")
    except (OSError, ValueError, AttributeError):
        log.warning("ignoring unreadable %s", path)
        return []
    return [value] if isinstance(value, int) and value > 0 else []


def greedy_generation_config(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, max_new_tokens: int
) -> GenerationConfig:
    """The model's own generation config (eos ids, repetition penalty), made greedy.

    Sampling settings shipped with the model (Llama's temperature 0.6, top-p 0.9) are cleared:
    a batch must give the same answer whoever else is in it and however often it is retried. So are
    settings that change the answer's shape (several sequences per input, a dict of outputs) and token
    healing. Stop strings stay: the backend hands ``generate`` the tokenizer they need.
    """
    base = model.generation_config
    config = GenerationConfig.from_dict(base.to_dict()) if base is not None else GenerationConfig()
    config.do_sample = False
    config.num_beams = 1
    config.temperature = None
    config.top_p = None
    config.top_k = None
    config.num_return_sequences = 1  # one answer per input, as a plain tensor of ids
    config.return_dict_in_generate = False
    config.token_healing = False  # it rewrites the end of each prompt, in a batch by what else is in it
    config.max_new_tokens = max_new_tokens
    config.max_length = None
    config.pad_token_id = tokenizer.pad_token_id
    return config
