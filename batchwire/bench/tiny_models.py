"""Tiny Hugging Face models built on the spot, for the tests and the bench's figures: no download, no
network. A tool: it needs the hf extra, and nothing a role imports reaches it.

Each builder writes a complete model directory (config, seeded random weights, tokenizer) with
``save_pretrained``, so it loads through exactly the path users take:
``HFBackend(path).load()``. The outputs are gibberish, but deterministic: the same seed gives the
same weights, and the same weights give the same greedy output.

The tokenizer is byte-level with no merges: every UTF-8 byte is one token, so it needs no
training data, handles any text, and makes token counts easy to predict (``len(text.encode())``
plus the special tokens the model adds).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    RobertaConfig,
    RobertaModel,
    T5Config,
    T5ForConditionalGeneration,
)

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
MAX_POSITIONS = 128
"""Positions of every tiny model (and the tokenizer's ``model_max_length``)."""

WIDE_INIT = 0.5
"""Weight init std, 25x the usual 0.02: a near-uniform random model repeats one byte whatever its
prompt, which would hide a padding bug; wide weights make the output depend on the whole prompt."""

CausalArch = Literal["gpt2", "llama"]


def byte_tokenizer(
    *, template: Literal["none", "eos", "bos_eos"] = "none", max_length: int = MAX_POSITIONS
) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: ids 0-3 are ``<pad> <s> </s> <unk>``, then one id per byte.

    ``template`` says which special tokens wrap each input: none (GPT-2 style), a trailing
    ``</s>`` (T5 style), or ``<s> ... </s>`` (BERT style, as CLS/SEP).
    """
    specials = [PAD, BOS, EOS, UNK]
    vocab = {token: index for index, token in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if template == "eos":
        backend.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, EOS_ID)])
    elif template == "bos_eos":
        backend.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A {EOS}", special_tokens=[(BOS, BOS_ID), (EOS, EOS_ID)]
        )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers leaves __init__ unannotated
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        cls_token=BOS if template == "bos_eos" else None,
        sep_token=EOS if template == "bos_eos" else None,
        model_max_length=max_length,
    )


def build_tiny_causal_lm(path: str | Path, *, arch: CausalArch = "gpt2", seed: int = 0) -> Path:
    """A 2-layer decoder-only model: GPT-2 (learned absolute positions) or Llama (rotary).

    Both are offered because left padding shifts positions: GPT-2 needs ``position_ids``
    derived from the attention mask, Llama's rotary embeddings need the same; the batching
    tests run on both so that neither kind can regress silently.
    """
    tokenizer = byte_tokenizer(template="none")
    vocab_size = len(tokenizer)
    if arch == "gpt2":
        return _save(
            path,
            tokenizer,
            seed,
            lambda: GPT2LMHeadModel(
                GPT2Config(
                    vocab_size=vocab_size,
                    n_positions=MAX_POSITIONS,
                    n_embd=32,
                    n_layer=2,
                    n_head=2,
                    initializer_range=WIDE_INIT,
                    bos_token_id=BOS_ID,
                    eos_token_id=EOS_ID,
                    pad_token_id=PAD_ID,
                )
            ),
        )
    return _save(
        path,
        tokenizer,
        seed,
        lambda: LlamaForCausalLM(
            LlamaConfig(
                vocab_size=vocab_size,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=MAX_POSITIONS,
                initializer_range=WIDE_INIT,
                bos_token_id=BOS_ID,
                eos_token_id=EOS_ID,
                pad_token_id=PAD_ID,
            )
        ),
    )


def build_tiny_seq2seq(path: str | Path, *, seed: int = 0) -> Path:
    """A 2+2-layer T5 encoder-decoder; its tokenizer appends ``</s>`` to each input, as T5's does."""
    tokenizer = byte_tokenizer(template="eos")
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        initializer_factor=10.0,  # T5's scale for WIDE_INIT
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
    )
    config.decoder_start_token_id = PAD_ID  # T5 starts decoding from <pad>
    return _save(path, tokenizer, seed, lambda: T5ForConditionalGeneration(config))


def build_tiny_encoder(
    path: str | Path, *, seed: int = 0, positions: int = MAX_POSITIONS, arch: Literal["bert", "roberta"] = "bert"
) -> Path:
    """A 2-layer encoder, for the ``embed`` task (the shape of all-MiniLM-L6-v2, much smaller);
    ``positions`` is its longest input in tokens (bytes), for benchmarks of long inputs. A RoBERTa
    numbers positions after the padding's, so its config states ``PAD_ID + 1`` more, as roberta-base's
    514 for 512 tokens."""
    tokenizer = byte_tokenizer(template="bos_eos", max_length=positions)
    shape: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "pad_token_id": PAD_ID,
    }
    if arch == "roberta":
        roberta = RobertaConfig(**shape, max_position_embeddings=positions + PAD_ID + 1)
        return _save(path, tokenizer, seed, lambda: RobertaModel(roberta))
    bert = BertConfig(**shape, max_position_embeddings=positions)
    return _save(path, tokenizer, seed, lambda: BertModel(bert))


def _save(
    path: str | Path,
    tokenizer: PreTrainedTokenizerFast,
    seed: int,
    make: Callable[[], PreTrainedModel],
) -> Path:
    # Forked RNG: seeding must not change the random stream of whoever called us.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make()
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target
