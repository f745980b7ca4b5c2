"""``Idempotency-Key``: a retried submit names the task its first attempt created.

The gateway binds the key to a new task id in the store (set-if-absent, kept as long as results);
a retry with the same key finds the first task and waits for it (or answers 202 with it) instead of
queueing a second computation. The binding carries a fingerprint of what the task computes (input
and model), so a key reused for another request is refused rather than answered with the wrong
output. ``timeout_ms`` is not part of it: a retry may wait longer or shorter than the first try.
"""

from __future__ import annotations

import hashlib
import json
import re

from gateway.errors import InvalidIdempotencyKey

MAX_KEY_CHARS = 255
# Visible ASCII: what clients put there in practice (UUIDs, base64, hex, dashes), and nothing that
# an HTTP stack could mangle.
KEY_PATTERN = re.compile(rf"[\x21-\x7e]{{1,{MAX_KEY_CHARS}}}")

# Scope of keys sent without an API key: one namespace shared by all anonymous callers.
ANONYMOUS_SCOPE = "-"


def check_key(key: str) -> str:
    """``key`` when it is usable, else ``InvalidIdempotencyKey`` saying what is allowed."""
    if not KEY_PATTERN.fullmatch(key):
        raise InvalidIdempotencyKey(
            f"the Idempotency-Key header must be 1 to {MAX_KEY_CHARS} visible ASCII characters (no spaces), "
            f"got {len(key)} characters; a UUID is a good key"
        )
    return key


def fingerprint(input: str, model: str) -> str:
    """What makes two submits the same request: the input and the (resolved) model."""
    canonical = json.dumps([model, input], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
