"""Admission: whether the deployment takes one more request, decided before anything is stored or sent.
The input's checks, the caller's priority tier and rate limit, and the wait its model's queue predicts
(drain rate, workers' own rates, tier mix, fair shares) live together so that every refusal is made in
one place and names the setting that raises its limit.
"""
