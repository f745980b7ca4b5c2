"""The task store's Lua scripts: each write is one atomic round trip that checks, stores and publishes.

Doing the check and the PUBLISH in the same script is what makes "a terminal state is written
once" hold across processes: two workers finishing the same task cannot both pass the check, and
only the one that wrote publishes. The hash keeps ``rank`` next to ``status`` so the scripts never
need to know the status names (a newer writer's statuses still order correctly).
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.records import TaskState, TaskStatus

TERMINAL_RANK = min(status.rank for status in TaskStatus if status.terminal)

# KEYS[1] task hash. ARGV: ttl ms, status, rank, doc, task channel. Returns 1 if created.
CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'rank', ARGV[3], 'doc', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PUBLISH', ARGV[5], ARGV[4])
return 1
"""

# KEYS[i] task hash of update i. ARGV[1] ttl ms, ARGV[2] lowest terminal rank, then per update 5
# values: status, rank, doc, task channel, reply channel ('' = no reply). Returns 1/0 per update.
# A missing hash (never created, or expired) accepts any update: a worker that finishes a task
# whose queued entry expired still stores the result.
APPLY = """
local ttl = ARGV[1]
local terminal = tonumber(ARGV[2])
local applied = {}
for i, key in ipairs(KEYS) do
  local at = 3 + (i - 1) * 5
  local rank = tonumber(ARGV[at + 1])
  local current = tonumber(redis.call('HGET', key, 'rank'))
  if current ~= nil and (current >= terminal or rank <= current) then
    applied[i] = 0
  else
    redis.call('HSET', key, 'status', ARGV[at], 'rank', ARGV[at + 1], 'doc', ARGV[at + 2])
    redis.call('PEXPIRE', key, ttl)
    redis.call('PUBLISH', ARGV[at + 3], ARGV[at + 2])
    if ARGV[at + 4] ~= '' then
      redis.call('PUBLISH', ARGV[at + 4], ARGV[at + 2])
    end
    applied[i] = 1
  end
end
return applied
"""


def create_args(ttl_ms: int, state: TaskState, doc: bytes, task_channel: str) -> list[str | int | bytes]:
    return [ttl_ms, state.status.value, state.status.rank, doc, task_channel]


def apply_args(ttl_ms: int, updates: Sequence[tuple[TaskState, bytes, str, str]]) -> list[str | int | bytes]:
    """ARGV for ``APPLY`` from (state, encoded doc, task channel, reply channel or '') per update."""
    args: list[str | int | bytes] = [ttl_ms, TERMINAL_RANK]
    for state, doc, task_channel, reply_channel in updates:
        args.extend((state.status.value, state.status.rank, doc, task_channel, reply_channel))
    return args
