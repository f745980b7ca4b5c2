"""A request's checks before admission, each refusal saying what to change."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from gateway.errors import (
    EmptyInput,
    InputOverTokenBudget,
    InputTooLarge,
    NotReady,
    TimeoutOutOfRange,
    UnknownModel,
    Untokenizable,
    shown,
    shown_number,
)
from gateway.settings import GatewaySettings, env_name
from schemas.codec import MAX_INPUT_BYTES


def validated(
    settings: GatewaySettings, input: str, model: str | None, timeout_ms: int | None, *, name: str = "input"
) -> tuple[str, int]:
    """The model and timeout a request runs with (its own, else the defaults), once its input, model
    and timeout are within what ``settings`` serve. ``name`` is the input as a refusal names it: where
    the caller sent it (one string of an OpenAI-compatible request is ```prompt[2]```)."""
    if model is None:
        model = settings.default_model
    elif model not in settings.models:
        raise UnknownModel(f"model {shown(model)} is not served here; served models: {', '.join(settings.models)}")
    if timeout_ms is None:
        timeout_ms = settings.default_timeout_ms
    elif not settings.min_timeout_ms <= timeout_ms <= settings.max_timeout_ms:
        raise TimeoutOutOfRange(
            f"timeout_ms is {shown_number(timeout_ms)}; send a value from {settings.min_timeout_ms} to "
            f"{settings.max_timeout_ms} ({env_name('max_timeout_ms')}), or leave it out for "
            f"{settings.default_timeout_ms}"
        )
    if not input:
        raise EmptyInput(f"{name} is empty; send the text to run the model on")
    if len(input) > settings.max_input_chars:
        raise InputTooLarge(
            f"{name} is {len(input)} characters; the limit is {settings.max_input_chars} "
            f"({env_name('max_input_chars')})"
        )
    # Four bytes at most a character: only an input this long may be over a batch's record in UTF-8.
    if len(input) > MAX_INPUT_BYTES // 4 and (size := len(input.encode(errors="surrogatepass"))) > MAX_INPUT_BYTES:
        raise InputTooLarge(
            f"{name} is {size} bytes in UTF-8; a batch, one record on the request bus, carries at most "
            f"{MAX_INPUT_BYTES} of one input: send a shorter input"
        )
    return model, timeout_ms


LONG_INPUT_CHARS = 2_048
"""An input this long is counted on the budget's thread: a tokenizer's time grows with the text, and the
one ``batcher.tokens`` builds releases the GIL meanwhile, so the event loop serves other requests. A
shorter input is counted on the event loop, which it holds for well under a millisecond: it never waits
behind another client's long inputs on the one thread (docs/performance.md, the token budget)."""


class TokenBudget:
    """Refuses an input that alone is over the token budget (no batch could hold it), or that the
    model's tokenizer cannot read: that input fails, and nothing else.

    Long inputs are counted on one thread of the budget's own, not on the event loop's default
    executor: what clients send would otherwise queue there ahead of the hops that every request takes
    in an embedded process (the batcher's count of each read, the workers' input checks), so one
    client's flood of long inputs would hold up everyone's answers; and one thread leaves the event
    loop a core while the flood is counted."""

    def __init__(self, settings: GatewaySettings, count_tokens: Callable[[str], int]) -> None:
        self._settings = settings
        self._count_tokens = count_tokens
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-tokens")
        self._closed = False

    async def check(self, *inputs: str, names: Sequence[str] = ()) -> list[int]:
        """Refuses the first of ``inputs`` (those of one request) over the budget or unreadable, by its
        name in ``names`` (``validated``'s ``name``; "input" without one); returns each one's tokens, what
        it weighs in its client's fair share (``gateway.admission.fair_share``)."""
        counts = []
        for index, input in enumerate(inputs):
            if self._closed:
                raise NotReady("the gateway is shutting down; retry on another instance")
            name = names[index] if index < len(names) else "input"
            try:
                if len(input) < LONG_INPUT_CHARS:
                    tokens = self._count_tokens(input)
                else:
                    tokens = await asyncio.get_running_loop().run_in_executor(self._thread, self._count_tokens, input)
            except ValueError as err:
                where = f"{name}: " if index < len(names) else ""
                raise Untokenizable(f"{where}{err}; send text the model's tokenizer reads") from None
            if tokens > self._settings.max_batch_tokens:
                raise InputOverTokenBudget(
                    f"{name} is {tokens} tokens; a batch holds at most {self._settings.max_batch_tokens} "
                    f"({env_name('max_batch_tokens')}): send a shorter input"
                )
            counts.append(tokens)
        return counts

    def close(self) -> None:
        """Lets the thread end once the counts already asked for are done; a later one is refused."""
        self._closed = True
        self._thread.shutdown(wait=False)
