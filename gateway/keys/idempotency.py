"""``Idempotency-Key``: a retried submit names the task its first attempt created.

The gateway binds the key to a new task id in the store (set-if-absent, kept as long as results);
a retry with the same key finds the first task and waits for it (or answers 202 with it) instead of
queueing a second computation. The binding carries a fingerprint of what the task computes (input
and model), so a key reused for another request is refused rather than answered with the wrong
output. ``timeout_ms`` is not part of it: a retry may wait longer or shorter than the first try.

A key whose task ended without being computed (``starts_anew``) would only ever replay that end,
so a retry rebinds the key to a new task instead (atomically: of racing retries one creates it and
the others replay it).
"""

from __future__ import annotations

import hashlib
import json
import re

from gateway.errors import InvalidIdempotencyKey
from schemas.records import TaskState, TaskStatus

MAX_KEY_CHARS = 255
# Visible ASCII: what clients put there in practice (UUIDs, base64, hex, dashes), and nothing that
# an HTTP stack could mangle.
KEY_PATTERN = re.compile(rf"[\x21-\x7e]{{1,{MAX_KEY_CHARS}}}")

# Scope of keys sent without an API key: one namespace shared by all anonymous callers.
ANONYMOUS_SCOPE = "-"

UNCOMPUTED_FAILURES = frozenset({"unavailable", "unknown_model", "deadline_exceeded"})
"""Error codes of a ``failed`` task that no model saw: the bus refused it, no batcher serves its model,
or its deadline passed first."""


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


def starts_anew(state: TaskState) -> bool:
    """Whether a retry with this task's key starts a new task: the task ended without being computed
    (expired, cancelled, or refused before a worker took it). A task still queued, batched or
    running, or one a model answered (with an output or with its own error), is replayed."""
    if state.status in (TaskStatus.EXPIRED, TaskStatus.CANCELLED):
        return True
    return state.status is TaskStatus.FAILED and state.error_code in UNCOMPUTED_FAILURES
