"""Answers: how each caller learns its task's outcome from the task store. Synchronous callers wait on
futures fed by the reply subscription (with the lost-reply sweep and the recheck after a feed outage);
polls, long-polls and change streams read the store; ``outcomes`` is what a submit returns.
Nothing here decides what is admitted.
"""
