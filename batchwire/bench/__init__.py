"""``batchwire bench``: an open-loop load generator that measures a batching server honestly.

Open loop (Poisson arrivals at a fixed rate, sends never wait for earlier answers) so that queueing
shows up as latency instead of silently lowering the offered load; latency is taken from the
*scheduled* send time, and the generator reports its own lag so an overloaded client is visible.
"""
