"""Answers several requests share: the result cache, one computation for identical requests in flight,
and the scoped key that says which requests may share. Only deterministic models' requests come here;
a shared computation answers its callers through ``gateway.answers``, so this room sits above it.
"""
