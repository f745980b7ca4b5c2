"""Token counts of inputs, for the token budget (``FlushPolicy.max_batch_tokens``).

A backend pads a batch to its longest input, so what a batch costs goes with its inputs' lengths in
the model's own tokens. With the model's ``tokenizer.json`` (the ``tokenizers`` package, in the
``hf`` extra) the count is exact; without it, an estimate of one token per four UTF-8 bytes, the
rule of thumb for English text under BPE and WordPiece vocabularies. The gateway counts to refuse an
input over the budget (413); the batcher counts again when it reads the request: one more pass of a
fast tokenizer per input costs less than carrying the count in every record. Both count a long input
on a thread, so that its tokenizing holds up no other request.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

TokenCounter = Callable[[str], int]
"""An input's length in tokens; raises ``ValueError`` for an input the tokenizer cannot read."""

BYTES_PER_TOKEN = 4


def estimated(text: str) -> int:
    """One token per four UTF-8 bytes, at least one."""
    return max(1, math.ceil(len(text.encode()) / BYTES_PER_TOKEN))


def token_counter(path: str | None) -> TokenCounter:
    """The counter of the tokenizer at ``path`` (a ``tokenizer.json``, or a model directory holding
    one), or the estimate when ``path`` is None."""
    if path is None:
        return estimated
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"no tokenizer at {path}: name a tokenizer.json, or a model directory holding one")
    try:
        from tokenizers import Tokenizer  # in the hf extra: the core install has no tokenizer
    except ImportError as err:
        raise ValueError("counting tokens with a tokenizer needs the `tokenizers` package (the hf extra)") from err
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as err:  # the Rust tokenizer's errors are plain Exceptions
        raise ValueError(f"{file} is not a tokenizer.json the tokenizers package reads: {err}") from err
    tokenizer.no_truncation()  # a tokenizer.json may pad or cut (sentence-transformers pads to 128)
    tokenizer.no_padding()

    def count(text: str) -> int:
        try:
            # encode_batch, unlike encode, releases the GIL: a caller that counts a long text on a thread
            # leaves the event loop free meanwhile.
            return len(tokenizer.encode_batch([text])[0].ids)
        except Exception as err:  # the Rust tokenizer's errors are plain Exceptions
            raise ValueError(f"the tokenizer cannot read this input: {err}") from err

    return count
