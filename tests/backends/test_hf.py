"""HFBackend on tiny random models, loaded the way users load theirs: ``HFBackend(path).load()``."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, BertModel, LlamaForCausalLM, PreTrainedTokenizerFast

from batchwire.bench.tiny_models import MAX_POSITIONS
from gpu_worker.backends.base import BackendError, BatchSizeError, InputError, PartialOutputs
from gpu_worker.backends.hf import HFBackend, batch_bucket, plan_free_attention
from gpu_worker.backends.hf_load import ModelLoadError
from gpu_worker.backends.sim import ReentryError
from gpu_worker.calls import BackendCalls, Failure
from gpu_worker.runner import BackendRunner
from telemetry.metrics import REGISTRY

# Lengths from 1 to 60 tokens, multi-byte characters, a leading space: padding has work to do.
MIXED = [
    "a",
    "hello there",
    "The quick brown fox jumps over the lazy dog",
    "xyz " * 15,
    "ß∂ƒ© naïve café",
    " leading space",
    "Hi",
    "0123456789",
]


TEST_DEVICE = os.environ.get("BATCHWIRE_TEST_DEVICE", "cpu")
"""Where the backends under test run: ``cpu`` here and in CI; ``cuda`` on a machine with a GPU."""


@pytest.fixture
def make_backend() -> Iterator[Callable[..., HFBackend]]:
    """Loaded backends (no warm-up unless asked), closed after the test. float32 unless a test
    asks otherwise: batched output equals one-by-one output exactly only there."""
    made: list[HFBackend] = []

    def make(path: Path, **kwargs: Any) -> HFBackend:
        kwargs.setdefault("warmup", False)
        kwargs.setdefault("max_new_tokens", 8)
        kwargs.setdefault("device", TEST_DEVICE)
        kwargs.setdefault("dtype", "float32")
        backend = HFBackend(path, **kwargs)
        backend.load()
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


# batched equals one-by-one ---------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["gpt2", "llama", "t5"])
def test_batched_generation_equals_one_by_one(
    arch: str, tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend]
) -> None:
    backend = make_backend(tiny_models[arch])
    one_by_one = [backend.batchstring([text])[0] for text in MIXED]
    batched = backend.batchstring(MIXED)
    assert batched == one_by_one, f"{arch}: padding changed the answers\nbatched:  {batched}\nsingly:   {one_by_one}"
    assert len(set(one_by_one)) > len(MIXED) // 2, f"{arch}: answers barely depend on the prompt: {one_by_one}"


@pytest.mark.parametrize("arch", ["gpt2", "t5"])
def test_answer_does_not_depend_on_batch_neighbours(
    arch: str, tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend]
) -> None:
    """A full batch, shuffled, with the longest input in different places: same answer per input."""
    backend = make_backend(tiny_models[arch], max_batch=32)
    inputs = (MIXED * 4)[:32]
    reference = dict(zip(MIXED, backend.batchstring(MIXED), strict=True))
    shuffled = inputs[::-1]
    assert backend.batchstring(inputs) == [reference[text] for text in inputs]
    assert backend.batchstring(shuffled) == [reference[text] for text in shuffled]


def test_generation_is_deterministic_across_calls_and_loads(
    tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend]
) -> None:
    first = make_backend(tiny_models["gpt2"])
    second = make_backend(tiny_models["gpt2"])
    answers = first.batchstring(MIXED)
    assert first.batchstring(MIXED) == answers
    assert second.batchstring(MIXED) == answers


def test_decoder_only_returns_only_new_text(
    tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend]
) -> None:
    backend = make_backend(tiny_models["gpt2"], max_new_tokens=4)
    prompt = "The quick brown fox jumps over the lazy dog"
    (answer,) = backend.batchstring([prompt])
    assert not answer.startswith(prompt[:10]), f"the prompt came back with the answer: {answer!r}"
    # Byte-level vocabulary: 4 new tokens are at most 4 bytes of text.
    assert len(answer.encode("utf-8", "replace")) <= 4 * 3, f"more than 4 tokens came back: {answer!r}"


def _metaspace_llama(tiny_llama: Path, target: Path) -> Path:
    """The tiny Llama with a SentencePiece-style (Metaspace) tokenizer, as Llama 2 and Mistral have: each
    word a token that starts with ``▁``, and the decoder drops the ``▁`` of a text's first token."""
    path = Path(shutil.copytree(tiny_llama, target))
    words = [f"\u2581w{index}" for index in range(len(AutoTokenizer.from_pretrained(path)) - 4)]
    vocab = {token: index for index, token in enumerate(["<pad>", "<s>", "</s>", "<unk>", *words])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers leaves __init__ unannotated
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(path)
    return path


def test_an_answer_keeps_the_space_it_starts_with(
    tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend], tmp_path: Path
) -> None:
    """With a SentencePiece tokenizer the new tokens decoded alone lose their first space ("Paris" for
    "The capital is" + " Paris"): the answer is the whole sequence's text after the prompt's, as
    transformers' text-generation pipeline gives it, so prompt + answer reads as the model wrote it."""
    path = _metaspace_llama(tiny_models["llama"], tmp_path / "metaspace")
    prompts = ["w5 w6", "w7", "w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = LlamaForCausalLM.from_pretrained(path)
    expected = []
    for prompt in prompts:
        ids = tokenizer([prompt], return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            full = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)[0]
        whole, start = tokenizer.batch_decode([full, ids[0]], skip_special_tokens=True)
        expected.append(whole[len(start) :])
    assert any(answer.startswith(" w") for answer in expected), f"pick prompts the model answers: {expected}"
    backend = make_backend(path)
    assert backend.batchstring(prompts) == expected
    assert [backend.batchstring([prompt])[0] for prompt in prompts] == expected


def test_sampling_settings_shipped_with_the_model_are_ignored(
    tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend], tmp_path: Path
) -> None:
    """Llama 3 and others ship temperature/top-p with do_sample=true; batchwire answers greedily, one
    answer per input."""
    path = Path(shutil.copytree(tiny_models["gpt2"], tmp_path / "sampling"))
    config_path = path / "generation_config.json"
    config = json.loads(config_path.read_text())
    config.update(do_sample=True, temperature=0.7, top_p=0.9, top_k=5, max_length=20)
    config.update(num_return_sequences=2, return_dict_in_generate=True)  # one answer per input, as a tensor
    config_path.write_text(json.dumps(config))
    greedy = make_backend(tiny_models["gpt2"]).batchstring(MIXED)
    assert make_backend(path).batchstring(MIXED) == greedy
    assert make_backend(path).batchstring(MIXED) == greedy


def test_stop_strings_shipped_with_the_model_end_each_answer(
    tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend], tmp_path: Path
) -> None:
    """Gemma ships ``stop_strings`` in its generation config; each answer ends after its first one,
    whoever shares the batch. Token healing, which the tokenizer would make possible, stays off."""
    stop = "7"
    unstopped = make_backend(tiny_models["gpt2"]).batchstring(MIXED)
    assert sum(stop in answer[:-1] for answer in unstopped) >= 2, f"pick a stop string the answers hold: {unstopped}"
    path = Path(shutil.copytree(tiny_models["gpt2"], tmp_path / "stops"))
    config_path = path / "generation_config.json"
    config_path.write_text(
        json.dumps({**json.loads(config_path.read_text()), "stop_strings": [stop], "token_healing": True})
    )
    backend = make_backend(path)
    expected = [answer[: answer.index(stop) + 1] if stop in answer else answer for answer in unstopped]
    assert backend.batchstring(MIXED) == expected
    assert [backend.batchstring([text])[0] for text in MIXED] == expected


# the contract ----------------------------------------------------------------------------------
def test_zero_or_too_many_inputs_is_a_batch_size_error(
    tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend]
) -> None:
    backend = make_backend(tiny_models["gpt2"], max_batch=4)
    with pytest.raises(BatchSizeError, match="1 to 4 inputs, got 0"):
        backend.batchstring([])
    with pytest.raises(BatchSizeError, match="1 to 4 inputs, got 5"):
        backend.batchstring(["x"] * 5)
    assert len(backend.batchstring(["x"] * 4)) == 4


def test_entering_twice_at_once_fails_loudly(
    tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend]
) -> None:
    backend = make_backend(tiny_models["gpt2"], max_new_tokens=1)
    assert backend.loaded is not None
    entered, release = threading.Event(), threading.Event()

    def hold(_module: torch.nn.Module, _args: Any) -> None:
        entered.set()
        assert release.wait(10), "the test never released the first call"

    handle = backend.loaded.model.register_forward_pre_hook(hold)
    results: list[list[str]] = []
    first = threading.Thread(target=lambda: results.append(backend.batchstring(["first"])))
    first.start()
    try:
        assert entered.wait(10), "the first call never reached the model"
        with pytest.raises(ReentryError, match="entered twice"):
            backend.batchstring(["second"])
    finally:
        release.set()
        first.join(10)
        handle.remove()
    assert len(results) == 1, "the first call did not finish after the second was refused"
    assert len(backend.batchstring(["third"])) == 1, "the guard was not released"


def test_input_errors_is_safe_while_a_batch_runs(
    tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend]
) -> None:
    """The worker calls input_errors on a thread of its own while batchstring runs in the model thread.
    One shared fast tokenizer breaks there (its padding state is changed under the batch)."""
    backend = make_backend(tiny_models["gpt2"], max_new_tokens=1)
    failures: list[BaseException] = []
    done = threading.Event()

    def run_batches() -> None:
        try:
            for _ in range(30):
                backend.batchstring(["hello there friend"] * 8 + ["x"])
        except BaseException as err:
            failures.append(err)
        finally:
            done.set()

    thread = threading.Thread(target=run_batches)
    thread.start()
    counted = 0
    while not done.is_set():
        assert backend.input_errors(["some input text " * 3] * 16) == {}
        counted += 1
    thread.join(10)
    assert not failures, f"batchstring failed while input_errors ran: {failures[0]!r}"
    assert counted > 0


async def test_the_worker_checks_long_inputs_off_its_event_loop(
    tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend]
) -> None:
    """Counting the tokens of a batch of long inputs takes a while; in one process (up) the HTTP server,
    the heartbeats and the hang detection share the worker's loop, so it must not stall there."""
    backend = make_backend(tiny_models["bert"], task="embed")
    inputs = [f"word {index} " * 9000 for index in range(32)]  # 64k characters each, all too long
    began = time.perf_counter()
    backend.input_errors(inputs)
    check_s = time.perf_counter() - began
    runner = BackendRunner("test-hf")
    calls = BackendCalls(backend, runner, "bert", "w")
    gaps: list[float] = []
    checking = asyncio.create_task(calls.run(inputs))
    last = time.perf_counter()
    try:
        while not checking.done():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        outputs = (await checking).outputs
    finally:
        runner.close()
    codes = {output.code for output in outputs.values() if isinstance(output, Failure)}
    assert len(outputs) == 32 and codes == {"input_too_long"}, f"expected 32 input_too_long, got {outputs}"
    assert max(gaps) < check_s / 2, (
        f"the event loop stalled {max(gaps):.2f} s while a batch that takes {check_s:.2f} s to check was checked"
    )


def test_too_long_input_is_a_per_request_error(
    tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend]
) -> None:
    backend = make_backend(tiny_models["gpt2"], max_input_tokens=20)
    errors = backend.input_errors(["short", "y" * 21, "z" * 20, ""])
    assert sorted(errors) == [1, 3], f"expected inputs 1 (too long) and 3 (empty) refused, got {errors}"
    assert errors[1].code == "input_too_long"
    assert str(errors[1]) == "input is 21 tokens; the model accepts at most 20 (BATCHWIRE_HF_MAX_INPUT_TOKENS)"
    assert errors[3].code == "input_empty"
    # A worker that skipped input_errors gets an InputError naming the input, not a model crash.
    with pytest.raises(InputError, match="input is 21 tokens") as caught:
        backend.batchstring(["short", "y" * 21])
    assert caught.value.index == 1


def test_special_tokens_count_towards_the_limit(
    tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend]
) -> None:
    backend = make_backend(tiny_models["t5"], max_input_tokens=10)  # T5 appends </s>
    assert backend.input_errors(["x" * 9]) == {}
    assert backend.input_errors(["x" * 10])[0].code == "input_too_long"


def test_default_limit_leaves_room_for_the_answer(
    tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend]
) -> None:
    assert make_backend(tiny_models["gpt2"], max_new_tokens=8).max_input_tokens == MAX_POSITIONS - 8
    assert make_backend(tiny_models["t5"], max_new_tokens=8).max_input_tokens == MAX_POSITIONS
    longest = "q" * (MAX_POSITIONS - 8)
    backend = make_backend(tiny_models["gpt2"], max_new_tokens=8)
    assert backend.input_errors([longest]) == {}
    assert len(backend.batchstring([longest, "a"])) == 2


def test_truncate_keeps_the_end_of_a_long_prompt(
    tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend]
) -> None:
    backend = make_backend(tiny_models["gpt2"], max_input_tokens=20, truncate=True)
    long = "".join(chr(ord("a") + i % 26) for i in range(50))
    assert backend.input_errors([long]) == {}
    assert backend.batchstring([long]) == backend.batchstring([long[-20:]])


# lifecycle and metrics -------------------------------------------------------------------------
def test_warm_up_records_latency_per_batch_size(
    tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend]
) -> None:
    backend = make_backend(tiny_models["gpt2"], warmup=True, max_batch=6, model="warmup-test", max_new_tokens=2)
    assert sorted(backend.latency_by_batch_s) == [1, 8], backend.latency_by_batch_s
    for bucket, seconds in backend.latency_by_batch_s.items():
        sample = REGISTRY.get_sample_value(
            "batchwire_backend_batch_latency_seconds",
            {"model": "warmup-test", "backend": "hf", "batch_size": str(bucket)},
        )
        assert sample == seconds, f"gauge for batch size {bucket}: expected {seconds}, got {sample}"
    backend.batchstring(["a", "b", "c"])
    assert sorted(backend.latency_by_batch_s) == [1, 4, 8]
    assert backend.load_s is not None
    assert backend.load_s > 0


@pytest.mark.parametrize(("size", "bucket"), [(1, 1), (2, 2), (3, 4), (5, 8), (32, 32), (33, 64)])
def test_batch_bucket_is_the_power_of_two_at_or_above(size: int, bucket: int) -> None:
    assert batch_bucket(size) == bucket


def test_calls_before_load_or_after_close_say_so(tiny_models: dict[str, Path]) -> None:
    backend = HFBackend(tiny_models["gpt2"], warmup=False)
    with pytest.raises(BackendError, match="not loaded"):
        backend.batchstring(["x"])
    with pytest.raises(BackendError, match="not loaded"):
        backend.input_errors(["x"])
    backend.load()
    assert backend.batchstring(["x"])
    backend.close()
    with pytest.raises(BackendError, match="not loaded"):
        backend.batchstring(["x"])


def test_half_precision_on_cpu_runs(tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend]) -> None:
    backend = make_backend(tiny_models["llama"], device="cpu", dtype="bfloat16")
    assert backend.loaded is not None
    assert backend.loaded.dtype == torch.bfloat16
    assert len(backend.batchstring(MIXED)) == len(MIXED)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"task": "classify"}, "task must be one of generate, embed"),
        ({"max_batch": 0}, "max_batch must be at least 1"),
        ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
        ({"max_input_tokens": 0}, "max_input_tokens must be at least 1"),
        ({"dtype": "float8"}, "dtype must be auto or one of"),
        ({"num_threads": 0}, "num_threads must be at least 1"),
    ],
)
def test_bad_settings_fail_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HFBackend("/nowhere", **kwargs)


# embeddings ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["bert", "t5"])
def test_embed_returns_unit_vectors_of_the_hidden_size(
    arch: str, tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend]
) -> None:
    backend = make_backend(tiny_models[arch], task="embed")
    outputs = backend.batchstring(MIXED)
    vectors = [json.loads(output) for output in outputs]
    for text, vector in zip(MIXED, vectors, strict=True):
        assert len(vector) == 32, f"{text!r}: expected 32 dimensions, got {len(vector)}"
        assert math.isclose(math.hypot(*vector), 1.0, abs_tol=1e-4), f"{text!r}: norm {math.hypot(*vector)}"
    assert backend.batchstring(MIXED) == outputs, "same input, different embedding"
    assert len(set(outputs)) == len(MIXED), "different inputs, same embedding"


def test_embed_batched_matches_one_by_one(tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend]) -> None:
    """Right padding with the mask: padding must not leak into the mean (float noise only)."""
    backend = make_backend(tiny_models["bert"], task="embed")
    batched = [json.loads(output) for output in backend.batchstring(MIXED)]
    for text, vector in zip(MIXED, batched, strict=True):
        single = json.loads(backend.batchstring([text])[0])
        worst = max(abs(a - b) for a, b in zip(vector, single, strict=True))
        assert worst <= 2e-6, f"{text!r}: batched differs from single by {worst}"


def _overflowing_copy(path: Path, into: Path, char: str) -> Path:
    """A copy of the encoder in ``path`` whose embedding row for ``char`` is past float16's range (the
    overflow a model in float16 meets in its activations): finite in float32, inf in float16."""
    copy = Path(shutil.copytree(path, into))
    model = BertModel.from_pretrained(copy)
    row = AutoTokenizer.from_pretrained(copy).convert_tokens_to_ids(char)
    with torch.no_grad():
        model.embeddings.word_embeddings.weight[row] *= 1e7
    model.save_pretrained(copy)
    return copy


async def test_an_embedding_that_is_not_finite_fails_its_input_alone(
    tiny_models: dict[str, Path], make_backend: Callable[..., HFBackend], tmp_path: Path
) -> None:
    """NaN is not JSON (most parsers refuse it): such an input fails with a code of its own and what to
    change, while the rest of its batch gets its vectors from the same call."""
    path = _overflowing_copy(tiny_models["bert"], tmp_path / "overflow", "z")
    inputs = ["a", "lazy dog", "hello there", "xyz " * 5]
    in_float32 = make_backend(path, task="embed").batchstring(inputs)
    assert all(math.isfinite(x) for output in in_float32 for x in json.loads(output)), in_float32
    backend = make_backend(path, task="embed", dtype="float16")
    runner = BackendRunner("test-hf")
    calls = BackendCalls(backend, runner, "bert", "w")
    try:
        result = await calls.run(inputs)
    finally:
        runner.close()
    codes = {index: output.code if isinstance(output, Failure) else "ok" for index, output in result.outputs.items()}
    assert codes == {0: "ok", 1: "non_finite_embedding", 2: "ok", 3: "non_finite_embedding"}, result.outputs
    failure = cast(Failure, result.outputs[1])
    assert "overflowed float16; run it in bfloat16 or float32 (--dtype, BATCHWIRE_DTYPE)" in failure.message
    for index in (0, 2):
        vector = json.loads(cast(str, result.outputs[index]))
        assert len(vector) == 32 and all(math.isfinite(x) for x in vector), f"{inputs[index]!r}: {vector}"

    with pytest.raises(PartialOutputs) as caught:  # one call answered the others: no bisection
        backend.batchstring(inputs)
    assert caught.value.outputs[0] == result.outputs[0] and isinstance(caught.value.outputs[1], InputError)


def _sentence_transformers_layout(path: Path, into: Path, pooling: dict[str, bool], *extra: str) -> Path:
    """A copy of ``path`` in ``into``, laid out as sentence-transformers saves a model: modules.json, and
    its pooling's config."""
    copy = Path(shutil.copytree(path, into))
    (copy / "1_Pooling").mkdir()
    (copy / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **pooling}))
    layers = ["Transformer", "Pooling", *extra]
    modules = [
        {"idx": i, "path": "1_Pooling" if kind == "Pooling" else "", "type": f"sentence_transformers.models.{kind}"}
        for i, kind in enumerate(layers)
    ]
    (copy / "modules.json").write_text(json.dumps(modules))
    return copy


def test_embed_pools_as_the_model_directory_says(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """BAAI's bge models pool by the CLS token: their vectors are that token's state, not the mean."""
    cls = _sentence_transformers_layout(
        tiny_models["bert"], tmp_path / "cls", {"pooling_mode_cls_token": True}, "Normalize"
    )
    mean = _sentence_transformers_layout(
        tiny_models["bert"], tmp_path / "mean", {"pooling_mode_mean_tokens": True}, "Normalize"
    )
    text = "A man is eating food."
    by_cls, by_mean = (HFBackend(path, task="embed", device="cpu", warmup=False) for path in (cls, mean))
    by_cls.load()
    by_mean.load()
    encoded = by_cls.loaded.tokenizer([text], return_tensors="pt")
    with torch.no_grad():
        first = by_cls.loaded.model(**encoded).last_hidden_state[0, 0]
    want = torch.nn.functional.normalize(first, dim=0)
    got = torch.tensor(json.loads(by_cls.batchstring([text])[0]))
    assert torch.allclose(got, want, atol=1e-5), f"cosine to the CLS state: {float(got @ want):.3f}"
    assert by_mean.batchstring([text]) != by_cls.batchstring([text])


def test_embed_keeps_the_length_of_a_model_that_does_not_normalize(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """Dot-product models (msmarco-distilbert-dot-v5: a Transformer and a Pooling, no Normalize) score by
    the vectors' length as well: their vectors are the pooled states as they are (here the CLS token's)."""
    dot = _sentence_transformers_layout(tiny_models["bert"], tmp_path / "dot", {"pooling_mode_cls_token": True})
    texts = ["A man is eating food.", "Hi"]
    backend = HFBackend(dot, task="embed", device="cpu", warmup=False)
    backend.load()
    encoded = backend.loaded.tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = backend.loaded.model(**encoded).last_hidden_state[:, 0]
    got = torch.tensor([json.loads(vector) for vector in backend.batchstring(texts)])
    assert torch.allclose(got, want, atol=1e-5), (
        f"lengths {got.norm(dim=1).tolist()}, the model's {want.norm(dim=1).tolist()}"
    )
    assert not torch.allclose(want.norm(dim=1), torch.ones(2), atol=1e-2), "the tiny model's CLS states are unit length"


@pytest.mark.parametrize(
    ("pooling", "extra", "message"),
    [
        ({"pooling_mode_max_tokens": True}, (), "pools by pooling_mode_max_tokens"),
        ({"pooling_mode_mean_tokens": True}, ("Dense",), "layers the hf backend does not run"),
    ],
)
def test_a_layout_the_backend_would_get_wrong_is_refused_at_load(
    tiny_models: dict[str, Path], tmp_path: Path, pooling: dict[str, bool], extra: tuple[str, ...], message: str
) -> None:
    path = _sentence_transformers_layout(tiny_models["bert"], tmp_path / "model", pooling, *extra)
    with pytest.raises(ModelLoadError, match=message):
        HFBackend(path, task="embed", device="cpu", warmup=False).load()


def test_on_a_gpu_attention_needs_no_plan_per_shape(tiny_models: dict[str, Path]) -> None:
    """cuDNN attention plans each new shape on first use; a worker's batches keep changing shape."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        backend = HFBackend(tiny_models["bert"], task="embed", device="cpu", warmup=False)
        backend.load()
        backend.close()
        assert torch.backends.cuda.cudnn_sdp_enabled()  # a CPU backend leaves the process's setting alone
        plan_free_attention()  # what load() does on a CUDA device
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
