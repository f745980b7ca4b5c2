"""Loading: only from the local directory, with errors that name the path and what was expected."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, cast

import pytest
import torch
import transformers

from batchwire.bench.tiny_models import build_tiny_encoder, byte_tokenizer
from gpu_worker.backends.hf import WARMUP_PROMPT, HFBackend
from gpu_worker.backends.hf_load import (
    ModelLoadError,
    _load_weights,
    resolve_device,
    resolve_dtype,
    resolve_max_input_tokens,
)


def load(path: Path, **kwargs: Any) -> HFBackend:
    backend = HFBackend(path, warmup=False, **kwargs)
    backend.load()
    return backend


def broken_copy(tiny_models: dict[str, Path], tmp_path: Path, *, remove: tuple[str, ...] = ()) -> Path:
    path = Path(shutil.copytree(tiny_models["gpt2"], tmp_path / "model"))
    for name in remove:
        (path / name).unlink()
    return path


def test_missing_directory_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="does not exist") as caught:
        load(missing)
    assert str(missing) in str(caught.value)
    assert "config.json" in str(caught.value)
    assert "never downloads" in str(caught.value)


def test_a_file_is_not_a_model_directory(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="is a file; expected a directory"):
        load(path)


def test_a_directory_without_config_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"not a Hugging Face model directory: config\.json is missing") as caught:
        load(tmp_path)
    assert str(tmp_path) in str(caught.value)


def test_missing_weights(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    path = broken_copy(tiny_models, tmp_path, remove=("model.safetensors",))
    with pytest.raises(ModelLoadError, match="cannot load the generate model") as caught:
        load(path)
    assert str(path) in str(caught.value)


def test_corrupt_weights(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    path = broken_copy(tiny_models, tmp_path)
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="cannot load the generate model"):
        load(path)


def test_an_encoder_asked_to_generate_is_refused_not_served_with_a_random_head(tiny_models: dict[str, Path]) -> None:
    """``--hf-task generate`` is the default: an embedding model loaded for it gets a language-model head the
    checkpoint has no weights for, which transformers fills at random, and would answer noise."""
    with pytest.raises(ModelLoadError, match="has no weights for") as caught:
        load(tiny_models["bert"], task="generate")
    message = str(caught.value)
    assert "cls.predictions" in message and "--hf-task embed" in message, message
    assert str(tiny_models["bert"]) in message, message


def test_missing_tokenizer_is_refused_not_replaced_by_an_empty_one(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    path = broken_copy(tiny_models, tmp_path, remove=("tokenizer.json", "tokenizer_config.json"))
    with pytest.raises(ModelLoadError, match="has no vocabulary: tokenizer files are missing"):
        load(path)


@pytest.mark.parametrize(("arch", "task"), [("gpt2", "generate"), ("bert", "embed"), ("t5", "embed")])
def test_a_tokenizer_with_ids_past_the_embedding_table_is_refused(
    arch: str, task: str, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """A token added to the tokenizer, the model not resized: each input holding it would fail its call
    (an IndexError on CPU; on a GPU, a device-side assert that fails every later call of the process)."""
    path = Path(shutil.copytree(tiny_models[arch], tmp_path / "model"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    rows = len(tokenizer)
    tokenizer.add_tokens(["<tool>"])
    tokenizer.save_pretrained(path)
    with pytest.raises(ModelLoadError) as caught:
        load(path, task=task)
    assert str(caught.value) == (
        f"the tokenizer in {path} has token ids up to {rows}, but the model's input embeddings have {rows} rows "
        f"(ids 0 to {rows - 1}): an input with a token past them would fail; use the tokenizer the model was "
        "trained with, or resize the model's embeddings to the tokenizer (resize_token_embeddings)"
    )


def test_an_embedding_table_larger_than_the_tokenizer_loads(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """Tables padded past the vocabulary (to a multiple of 64, say) are common, and fine."""
    path = Path(shutil.copytree(tiny_models["gpt2"], tmp_path / "padded"))
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(320)
    model.save_pretrained(path)
    backend = load(path)
    assert backend.loaded is not None
    assert backend.loaded.model.get_input_embeddings().num_embeddings == 320
    assert len(backend.batchstring(["a", "longer input"])) == 2


@pytest.mark.parametrize(
    ("config_text", "message"), [("{not json", "not a valid JSON"), ('{"model_type": "nosuch"}', "nosuch")]
)
def test_unreadable_config(tiny_models: dict[str, Path], tmp_path: Path, config_text: str, message: str) -> None:
    path = broken_copy(tiny_models, tmp_path)
    (path / "config.json").write_text(config_text)
    with pytest.raises(ModelLoadError, match="cannot read the config or tokenizer") as caught:
        load(path)
    assert message in str(caught.value)


def test_load_opens_no_network_connection(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object) -> None:
        raise AssertionError("load() tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    for name in ("gpt2", "t5"):
        backend = load(tiny_models[name])
        assert backend.batchstring(["x"])
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_detects_encoder_decoder_from_config(tiny_models: dict[str, Path]) -> None:
    decoder_only, encoder_decoder = load(tiny_models["gpt2"]), load(tiny_models["t5"])
    assert decoder_only.loaded is not None
    assert encoder_decoder.loaded is not None
    assert not decoder_only.loaded.is_encoder_decoder
    assert decoder_only.loaded.tokenizer.padding_side == "left"
    assert encoder_decoder.loaded.is_encoder_decoder
    assert encoder_decoder.loaded.tokenizer.padding_side == "right"


def test_pad_token_falls_back_to_eos(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    path = broken_copy(tiny_models, tmp_path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["pad_token"]
    config_path.write_text(json.dumps(config))
    backend = load(path)
    assert backend.loaded is not None
    assert backend.loaded.tokenizer.pad_token == "</s>"
    assert len(backend.batchstring(["a", "longer input"])) == 2


def test_asked_input_limit_above_the_model_positions_fails(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ModelLoadError, match=r"at most 96 \(128 positions less max_new_tokens=32\)"):
        load(tiny_models["gpt2"], max_input_tokens=500, max_new_tokens=32)
    with pytest.raises(ModelLoadError, match="max_new_tokens=128 leaves no room for input"):
        load(tiny_models["gpt2"], max_new_tokens=128)


def test_an_input_limit_that_only_the_special_tokens_fill_fails_at_the_load(tmp_path: Path) -> None:
    path = build_tiny_encoder(tmp_path / "roberta", positions=64, arch="roberta")
    with pytest.raises(ModelLoadError, match="adds 2 special tokens to each; set at least 3"):
        load(path, task="embed", max_input_tokens=2)
    backend = load(path, task="embed", max_input_tokens=3)
    assert len(backend.batchstring(["x"])) == 1, "<s> x </s>"


def test_an_encoder_that_numbers_positions_after_the_padding_takes_fewer_tokens_than_them(tmp_path: Path) -> None:
    """RoBERTa's 514 positions hold 512 tokens (its padding id is 1; the tiny one's is 0: 65 hold 64); an
    input as long as its config's positions would crash it."""
    path = build_tiny_encoder(tmp_path / "roberta", positions=64, arch="roberta")
    with pytest.raises(ModelLoadError, match=r"at most 64 \(65 positions, the first 1 of which hold no token\)"):
        load(path, task="embed", max_input_tokens=65)
    backend = load(path, task="embed", max_input_tokens=64)
    assert len(backend.batchstring(["x" * 62, "short"])) == 2, "62 bytes and <s> </s>: the whole 64"


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("roberta-prelayernorm", {}),
        ("longformer", {"attention_window": [4, 4]}),
        ("ibert", {}),
        ("xmod", {"languages": ["en_XX"], "default_language": "en_XX"}),
        ("luke", {}),
        ("markuplm", {}),
        ("esm", {}),
    ],
)
def test_each_encoder_that_numbers_positions_after_the_padding_gets_its_limit_from_them(
    tmp_path: Path, model_type: str, extra: dict[str, Any]
) -> None:
    """RoBERTa's relatives number positions as it does: with a tokenizer that states no limit, the default
    (and the most asked for) is the positions less the padding's, and an input that long runs."""
    tokenizer = byte_tokenizer(template="bos_eos", max_length=10**30)
    shape = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), pad_token_id=0, max_position_embeddings=34, **shape, **extra
    )
    path = tmp_path / model_type
    model = transformers.AutoModel.from_config(config)  # type: ignore[no-untyped-call]  # unannotated upstream
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with pytest.raises(ModelLoadError, match=r"at most 33 \(34 positions, the first 1 of which hold no token\)"):
        load(path, task="embed", max_input_tokens=34)
    backend = load(path, task="embed")
    assert backend.max_input_tokens == 33
    assert len(backend.batchstring(["x" * 31, "short"])) == 2, "31 bytes and <s> </s>: the whole 33"


@pytest.mark.parametrize(("asked", "task"), [(None, "generate"), (None, "embed"), (40, "generate")])
def test_a_model_whose_positions_its_text_config_states_gets_its_limit_from_them(
    tmp_path: Path, asked: int | None, task: Literal["generate", "embed"]
) -> None:
    """A multimodal checkpoint (Gemma 3, Llama 4, Mllama) states its positions in its ``text_config``, not at
    the top of its config: read there, as for any model, not the 512 of a model that states nothing."""
    tokenizer = byte_tokenizer(max_length=10**30)
    text = {"max_position_embeddings": 64, "vocab_size": len(tokenizer), "hidden_size": 32, "num_hidden_layers": 1}
    config = transformers.AutoConfig.for_model("gemma3", text_config=text)
    assert getattr(config, "max_position_embeddings", None) is None, "the case: positions in text_config only"
    limit = resolve_max_input_tokens(tmp_path, config, tokenizer, task=task, max_new_tokens=16, asked=asked)
    assert limit == (asked or (48 if task == "generate" else 64)), limit
    with pytest.raises(ModelLoadError, match=r"at most 48 \(64 positions less max_new_tokens=16\)"):
        resolve_max_input_tokens(tmp_path, config, tokenizer, task="generate", max_new_tokens=16, asked=49)


def test_a_limit_under_the_warm_up_prompt_warms_up_with_less(tiny_models: dict[str, Path]) -> None:
    limit = len(WARMUP_PROMPT) - 1  # a token a byte: the prompt is one over
    backend = HFBackend(tiny_models["gpt2"], max_input_tokens=limit, max_new_tokens=4, max_batch=2)
    backend.load()
    assert backend.batchstring(["hi"])


def test_impossible_limits_fail_before_the_weights_load(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    path = broken_copy(tiny_models, tmp_path, remove=("model.safetensors",))
    with pytest.raises(ModelLoadError, match="max_input_tokens=500 is more than"):
        load(path, max_input_tokens=500)


def test_resolve_device_and_dtype() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ModelLoadError, match="not a torch device"):
        resolve_device("tpu9")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ModelLoadError, match="torch sees no CUDA GPU"):
            resolve_device("cuda")


@pytest.mark.parametrize("device", ["meta", "mps", "xpu"])
def test_a_device_the_backend_does_not_run_on_is_refused_naming_those_it_does(device: str) -> None:
    """torch names more device types than the backend runs on (cpu, cuda): one of the others would pass
    the check before the role starts and fail only in the load, in a message about the model's files."""
    with pytest.raises(ModelLoadError, match="use auto, cpu, cuda or cuda:N") as caught:
        resolve_device(device)
    assert repr(device) in str(caught.value), caught.value


def test_a_gpu_index_past_those_torch_sees_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda:1 on a machine of one GPU would pass the check and fail in the load, as a model that cannot load."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ModelLoadError, match=r"'cuda:1' asked for, but torch sees 1 CUDA GPU \(cuda:0\)"):
        resolve_device("cuda:1")


def test_a_gpu_load_needs_no_package_the_hf_extra_leaves_out(tiny_models: dict[str, Path]) -> None:
    """transformers loads weights straight onto a GPU (``device_map``) only with ``accelerate``, which the
    hf extra installs: without a GPU the load fails for want of CUDA, never of a package."""

    def load_on_gpu() -> None:
        path, cuda = tiny_models["gpt2"], torch.device("cuda")
        _load_weights(path, task="generate", device=cuda, dtype=torch.float32, is_encoder_decoder=False)

    if torch.cuda.is_available():
        load_on_gpu()
        return
    with pytest.raises(ModelLoadError) as caught:
        load_on_gpu()
    assert "accelerate" not in str(caught.value), caught.value


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        ((), "does not exist; expected a local Hugging Face model directory"),
        (("--device", "tpu9"), "not a torch device"),
        (("--device", "meta"), "use auto, cpu, cuda or cuda:N"),
        (("--dtype", "fp8"), "dtype must be auto or one of"),
        (("--dtype", "fp8"), "(--dtype, BATCHWIRE_DTYPE)"),
    ],
)
def test_a_model_path_or_device_that_cannot_load_is_one_line_before_anything_starts(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], said: str
) -> None:
    """Not a traceback from the worker's start, after the service began to come up: a flag to change."""
    from batchwire.cli import main

    model_path = tmp_path / "no-such-model" if not flags else tiny_models["gpt2"]
    argv = ["up", "--port", "0", "--backend", "hf", "--model-path", str(model_path), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("batchwire up: ") and said in err and "Traceback" not in err, err
    assert err.count("\n") == 1, err
    flag = flags[0] if flags else "--model-path"
    assert flag.removeprefix("--") in err, f"the message does not name {flag}: {err}"


def test_up_loads_its_models_before_it_serves_and_one_that_does_not_load_is_one_line(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What only the load finds (here, no tokenizer files) ends ``up`` as a flag would: one line, exit 2,
    not uvicorn's startup traceback."""
    from batchwire.cli import main

    path = broken_copy(tiny_models, tmp_path, remove=("tokenizer.json", "tokenizer_config.json"))
    assert main(["up", "--port", "0", "--backend", "hf", "--device", "cpu", "--model-path", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("batchwire up: the model did not load: ") and "Traceback" not in err, err
    assert "has no vocabulary" in err and err.count("\n") == 1, err


def test_a_second_load_keeps_the_loaded_model(tiny_models: dict[str, Path]) -> None:
    """``up`` loads before it serves, and the worker's start loads again: once is the load."""
    backend = load(tiny_models["gpt2"])
    first = backend.loaded
    backend.load()
    assert first is not None and backend.loaded is first


def test_loads_on_several_threads_at_once_leave_each_model_whole_and_the_process_as_it_was(
    tiny_models: dict[str, Path],
) -> None:
    """An embedded process's workers start together, each loading on its backend's thread; transformers
    swaps process-wide state while it loads, which two loads at once could leave swapped for good."""
    tie, default = transformers.PreTrainedModel.tie_weights, torch.get_default_dtype()
    for _ in range(5):
        backends = [HFBackend(tiny_models["gpt2"], device="cpu", dtype="bf16", warmup=False) for _ in range(6)]
        with ThreadPoolExecutor(max_workers=len(backends)) as pool:
            for loading in [pool.submit(backend.load) for backend in backends]:
                loading.result()
        assert torch.get_default_dtype() == default and transformers.PreTrainedModel.tie_weights is tie
        for backend in backends:
            assert backend.loaded is not None
            model = cast(Any, backend.loaded.model)
            assert model.lm_head.weight is model.transformer.wte.weight, "the output layer was left untied"


def test_a_model_that_fails_its_warm_up_did_not_load_and_up_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An encoder whose weights hold an infinity (in the row of the warm-up prompt's first byte) loads,
    then the warm-up batch's embeddings are not finite: the load failed, said as one line, not the
    model's traceback."""
    from batchwire.cli import main

    path = build_tiny_encoder(tmp_path / "infinite")
    model = transformers.BertModel.from_pretrained(path)
    row = transformers.AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(WARMUP_PROMPT[0])
    with torch.no_grad():
        model.embeddings.word_embeddings.weight[row] = math.inf
    model.save_pretrained(path)
    backend = HFBackend(path, task="embed", device="cpu")
    with pytest.raises(ModelLoadError, match=r"warm-up batch failed: PartialOutputs: .* not finite") as caught:
        backend.load()
    assert str(path) in str(caught.value), caught.value
    assert backend.loaded is None, "a backend whose warm-up failed still says it is loaded"
    up = ["up", "--port", "0", "--backend", "hf", "--hf-task", "embed", "--device", "cpu", "--model-path", str(path)]
    assert main(up) == 2
    err = capsys.readouterr().err  # transformers, imported here already, shows its progress bars as well
    said = err.splitlines()[-1]
    assert said.startswith("batchwire up: the model did not load: ") and "warm-up" in said, err
    assert "Traceback" not in err, err


@pytest.mark.parametrize(
    ("failing_size", "said"),
    [
        (8, r"batch of 8 inputs does not fit in the memory of cpu: set a smaller --max-batch \(BATCHWIRE_MAX_BATCH\)"),
        (1, r"one input does not fit in the memory of cpu: set --dtype bfloat16 or float16 \(BATCHWIRE_DTYPE\)"),
    ],
)
def test_a_warm_up_batch_out_of_memory_names_the_setting_to_change(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, failing_size: int, said: str
) -> None:
    """A GPU's out-of-memory in the warm-up is the load failure a larger --max-batch brings: the message
    names it, not only the allocator's figures. (The device's allocator is stood in for: the error is
    raised for batches of ``failing_size`` inputs and more.)"""
    run = HFBackend._run

    def out_of_memory(self: HFBackend, loaded: Any, inputs: list[str]) -> Any:
        if len(inputs) >= failing_size:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return run(self, loaded, inputs)

    monkeypatch.setattr(HFBackend, "_run", out_of_memory)
    backend = HFBackend(tiny_models["gpt2"], device="cpu", max_batch=8)
    with pytest.raises(ModelLoadError, match=r"warm-up batch failed: OutOfMemoryError: CUDA out of memory") as caught:
        backend.load()
    assert re.search(said, str(caught.value)), caught.value
    assert backend.loaded is None, "a backend whose warm-up failed still says it is loaded"
