"""``Idempotency-Key``: the rules for a key (its fingerprint, its format) and its binding to a task in
the store, so that a retried submit finds the task of its first attempt instead of queueing a second
computation.
"""
