"""A request's checks before admission, each refusal saying what to change."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.errors import (
    EmptyInput,
    InputOverTokenBudget,
    InputTooLarge,
    TimeoutOutOfRange,
    UnknownModel,
    Untokenizable,
    shown,
)
from gateway.settings import GatewaySettings, env_name


def validated(settings: GatewaySettings, input: str, model: str | None, timeout_ms: int | None) -> tuple[str, int]:
    """The model and timeout a request runs with (its own, else the defaults), once its input, model
    and timeout are within what ``settings`` serve."""
    if model is None:
        model = settings.default_model
    elif model not in settings.models:
        raise UnknownModel(f"model {shown(model)} is not served here; served models: {', '.join(settings.models)}")
    if timeout_ms is None:
        timeout_ms = settings.default_timeout_ms
    elif not settings.min_timeout_ms <= timeout_ms <= settings.max_timeout_ms:
        raise TimeoutOutOfRange(
            f"timeout_ms is {timeout_ms}; send a value from {settings.min_timeout_ms} to "
            f"{settings.max_timeout_ms} ({env_name('max_timeout_ms')}), or leave it out for "
            f"{settings.default_timeout_ms}"
        )
    if not input:
        raise EmptyInput("input is empty; send the text to run the model on")
    if len(input) > settings.max_input_chars:
        raise InputTooLarge(
            f"input is {len(input)} characters; the limit is {settings.max_input_chars} ({env_name('max_input_chars')})"
        )
    return model, timeout_ms


LONG_INPUT_CHARS = 2_048
"""An input this long is counted on a thread: a tokenizer takes a while over a long text, and the one
``batcher.tokens`` builds releases the GIL meanwhile, so the event loop serves other requests; a
shorter input costs less to count than the hop to a thread."""


async def within_token_budget(settings: GatewaySettings, input: str, count_tokens: Callable[[str], int]) -> None:
    """Refuses an input that alone is over the token budget (no batch could hold it), or that the
    model's tokenizer cannot read: that input fails, and nothing else."""
    try:
        tokens = count_tokens(input) if len(input) < LONG_INPUT_CHARS else await asyncio.to_thread(count_tokens, input)
    except ValueError as err:
        raise Untokenizable(f"{err}; send text the model's tokenizer reads") from None
    if tokens > settings.max_batch_tokens:
        raise InputOverTokenBudget(
            f"input is {tokens} tokens; a batch holds at most {settings.max_batch_tokens} "
            f"({env_name('max_batch_tokens')}): send a shorter input"
        )
