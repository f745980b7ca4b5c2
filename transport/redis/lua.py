"""The task store's Lua scripts: each write is one atomic round trip that checks, stores and publishes.

Doing the check and the PUBLISH in the same script is what makes "a terminal state is written
once" hold across processes: two workers finishing the same task cannot both pass the check, and
only the one that wrote publishes. A gateway's reply channel gets one message per write, however
many of its tasks the write ended: the states as frames, each a 4-byte big-endian length and the
doc (``reply_frames`` reads them). The hash keeps ``rank`` next to ``status`` so the scripts never
need to know the status names (a newer writer's statuses still order correctly).
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.records import TaskState, TaskStatus
from transport.ports import KeyClaim

ROW = 5
"""Values per task in ``CREATE``'s and ``APPLY``'s ARGV, after their leading values."""
PUBLISH = "PUBLISH"
SPUBLISH = "SPUBLISH"
"""Each write script's last ARGV: ``PUBLISH`` (one Redis: the script publishes the task's channel and
the gateways' reply frames) or ``SPUBLISH`` (Redis Cluster: the task's channel, in the task's slot,
with SPUBLISH; the reply frames, whose channels live in other slots, returned for the caller to send)."""
TERMINAL_RANK = min(status.rank for status in TaskStatus if status.terminal)
CANCELLABLE_RANK = TaskStatus.BATCHED.rank

# KEYS[i] task hash of task i. ARGV[1] ttl ms, then per task 5 values: status, rank, doc, task
# channel, owner ('' = none), then PUBLISH or SPUBLISH. Returns per task 1 if created, 2 if a later
# status got there first (the gateway produces while it creates, so a batcher may write "batched"
# before "queued" lands): the owner is then filled in, nothing else changes. 0 if the task exists at
# this rank or lower (a duplicate id). The owner is a field of its own, written once here: later writers (batcher,
# workers) replace ``doc`` without knowing it, and readers merge it back (``RedisTaskStore.get``).
CREATE = """
local publish = ARGV[#ARGV]
local created = {}
for i, key in ipairs(KEYS) do
  local at = 2 + (i - 1) * 5
  local current = tonumber(redis.call('HGET', key, 'rank'))
  if current ~= nil then
    if current <= tonumber(ARGV[at + 1]) then
      created[i] = 0
    else
      if ARGV[at + 4] ~= '' and redis.call('HEXISTS', key, 'owner') == 0 then
        redis.call('HSET', key, 'owner', ARGV[at + 4])
      end
      created[i] = 2
    end
  else
    redis.call('HSET', key, 'status', ARGV[at], 'rank', ARGV[at + 1], 'doc', ARGV[at + 2])
    if ARGV[at + 4] ~= '' then
      redis.call('HSET', key, 'owner', ARGV[at + 4])
    end
    redis.call('PEXPIRE', key, ARGV[1])
    redis.call(publish, ARGV[at + 3], ARGV[at + 2])
    created[i] = 1
  end
end
return created
"""

# KEYS[i] task hash of update i. ARGV[1] ttl ms, ARGV[2] lowest terminal rank, then per update 5
# values: status, rank, doc, task channel, reply channel ('' = none: not a synchronous task; a
# terminal update is sent there as a frame), then PUBLISH or SPUBLISH. Returns 1/0 per update, then
# under SPUBLISH a reply channel and its frames for each reply channel written to. A missing hash (never created,
# or expired) accepts any update: a worker that finishes a task whose queued entry expired still
# stores the result. The TTL is set where this
# write creates the hash and where it ends the task, not at the steps between (a PEXPIRE each would
# renew what the first one set): a task is kept ``ttl`` after it ended.
# A synchronous task no one stored (no key, no owner: ``Gateway._answer_when_done``) is one no one
# else knows the id of: only its caller waits, and for its end. Its progress is checked (has it
# ended?) and not written, and its end is not published on its task channel, which no one watches.
# Most synchronous tasks are such, so one EXISTS over a write's synchronous steps answers for all
# of them; only where one is stored is each checked (and written, as any task's).
APPLY = """
local publish = ARGV[#ARGV]
local ttl = ARGV[1]
local terminal = tonumber(ARGV[2])
local applied = {}
local replies = {}
local channels = {}
local probed = {}
for i, key in ipairs(KEYS) do
  local at = 3 + (i - 1) * 5
  if ARGV[at + 4] ~= '' and tonumber(ARGV[at + 1]) < terminal then
    probed[#probed + 1] = key
  end
end
local none_stored = #probed > 0 and redis.call('EXISTS', unpack(probed)) == 0
for i, key in ipairs(KEYS) do
  local at = 3 + (i - 1) * 5
  local rank = tonumber(ARGV[at + 1])
  local channel = ARGV[at + 4]
  local progress = channel ~= '' and rank < terminal
  if progress and none_stored then
    applied[i] = 1
  else
    local current = tonumber(redis.call('HGET', key, 'rank'))
    if current ~= nil and (current >= terminal or rank <= current) then
      applied[i] = 0
    elseif progress and current == nil then
      applied[i] = 1
    else
      redis.call('HSET', key, 'status', ARGV[at], 'rank', ARGV[at + 1], 'doc', ARGV[at + 2])
      if current == nil or rank >= terminal then
        redis.call('PEXPIRE', key, ttl)
      end
      if current ~= nil or channel == '' then
        redis.call(publish, ARGV[at + 3], ARGV[at + 2])
      end
      if channel ~= '' and rank >= terminal then
        local frames = replies[channel]
        if frames == nil then
          frames = {}
          replies[channel] = frames
          channels[#channels + 1] = channel
        end
        frames[#frames + 1] = struct.pack('>I4', string.len(ARGV[at + 2])) .. ARGV[at + 2]
      end
      applied[i] = 1
    end
  end
end
for _, channel in ipairs(channels) do
  if publish == 'PUBLISH' then
    redis.call('PUBLISH', channel, table.concat(replies[channel]))
  else
    applied[#applied + 1] = channel
    applied[#applied + 1] = table.concat(replies[channel])
  end
end
return applied
"""


# KEYS[1] task hash. ARGV: ttl ms, highest cancellable rank, status, rank, doc, task channel, reply
# channel ('' = none), PUBLISH or SPUBLISH. The caller built ``doc`` from a state it read just
# before; whether that task may still be cancelled is decided here, atomically with the write.
# Returns {1} when cancelled (under SPUBLISH with a reply channel: {1, reply channel, frame}),
# {0, doc, owner} when it is too late (doc: the stored state), {-1} when there is no such task.
CANCEL = """
local current = tonumber(redis.call('HGET', KEYS[1], 'rank'))
if current == nil then
  return {-1}
end
if current > tonumber(ARGV[2]) then
  local stored = redis.call('HMGET', KEYS[1], 'doc', 'owner')
  return {0, stored[1], stored[2]}
end
redis.call('HSET', KEYS[1], 'status', ARGV[3], 'rank', ARGV[4], 'doc', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call(ARGV[8], ARGV[6], ARGV[5])
if ARGV[7] ~= '' then
  local frame = struct.pack('>I4', string.len(ARGV[5])) .. ARGV[5]
  if ARGV[8] ~= 'PUBLISH' then
    return {1, ARGV[7], frame}
  end
  redis.call('PUBLISH', ARGV[7], frame)
end
return {1}
"""

# KEYS[1] idempotency key. ARGV: ttl ms, "<fingerprint> <task id>". Returns the value that holds
# afterwards: ours when the key was free (SET NX), else the first claimer's.
CLAIM_KEY = """
if redis.call('SET', KEYS[1], ARGV[2], 'NX', 'PX', ARGV[1]) then
  return ARGV[2]
end
return redis.call('GET', KEYS[1])
"""

# KEYS[1] idempotency key. ARGV: ttl ms, the ended task's id, "<fingerprint> <task id>". Replaces the
# binding only while it still names the ended task (or the key is gone), so of two retries racing to
# replace one ended task exactly one wins. Returns the value that holds afterwards.
REBIND_KEY = """
local held = redis.call('GET', KEYS[1])
if held then
  local suffix = ' ' .. ARGV[2]
  if string.sub(held, -string.len(suffix)) ~= suffix then
    return held
  end
end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[1])
return ARGV[3]
"""

# KEYS[1] idempotency key. ARGV[1] a task id: the key is deleted only while it still names that task.
RELEASE_KEY = """
local held = redis.call('GET', KEYS[1])
local suffix = ' ' .. ARGV[1]
if held and string.sub(held, -string.len(suffix)) == suffix then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS[1] a client's bucket (hash: tokens, at_us, op, op_wait). ARGV: rate per second, burst, tokens to
# take, the call's id. Uses the Redis server's clock, so gateways whose clocks disagree still share one
# bucket correctly. Returns 0 when the tokens were taken, else the microseconds until they will be there
# (nothing taken). A negative count gives that many back, up to the burst. A call made again with the
# same id (redis-py's retry after a reply lost once the script ran) gets the first answer and changes
# nothing, unless another call came between. The bucket expires once it would be full again: a client
# that stops costs nothing.
TOKEN_BUCKET = """
if redis.replicate_commands then
  redis.replicate_commands()  -- Redis 5 and 6: TIME before a write needs effects replication
end
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local count = tonumber(ARGV[3])
local op = ARGV[4]
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local held = redis.call('HMGET', KEYS[1], 'tokens', 'at_us', 'op', 'op_wait')
if held[3] == op then
  return tonumber(held[4])
end
local tokens = tonumber(held[1])
local at = tonumber(held[2])
if tokens == nil or at == nil then
  tokens = burst
  at = now
end
tokens = math.min(burst, tokens + math.max(0, now - at) * rate / 1000000)
local wait = 0
if count <= 0 or tokens >= count then
  tokens = math.min(burst, tokens - count)
else
  wait = math.ceil((count - tokens) * 1000000 / rate)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at_us', tostring(now), 'op', op, 'op_wait', wait)
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) * 1000 / rate) + 1000)
return wait
"""


def create_args(
    ttl_ms: int, rows: Sequence[tuple[TaskState, bytes, str]], publish: str = PUBLISH
) -> list[str | int | bytes]:
    """ARGV of ``CREATE`` for (state, doc, task channel) rows."""
    args: list[str | int | bytes] = [ttl_ms]
    for state, doc, task_channel in rows:
        args.extend((state.status.value, state.status.rank, doc, task_channel, state.owner or ""))
    args.append(publish)
    return args


def cancel_args(
    ttl_ms: int, cancelled: TaskState, doc: bytes, task_channel: str, reply_channel: str, publish: str = PUBLISH
) -> list[str | int | bytes]:
    return [
        ttl_ms,
        CANCELLABLE_RANK,
        cancelled.status.value,
        cancelled.status.rank,
        doc,
        task_channel,
        reply_channel,
        publish,
    ]


def apply_args(
    ttl_ms: int, updates: Sequence[tuple[TaskState, bytes, str, str]], publish: str = PUBLISH
) -> list[str | int | bytes]:
    """ARGV for ``APPLY`` from (state, encoded doc, task channel, reply channel or '') per update."""
    args: list[str | int | bytes] = [ttl_ms, TERMINAL_RANK]
    for state, doc, task_channel, reply_channel in updates:
        args.extend((state.status.value, state.status.rank, doc, task_channel, reply_channel))
    args.append(publish)
    return args


def binding(fingerprint: str, deadline_ms: int | None, task_id: str) -> str:
    """An idempotency key's value: ``"<fingerprint> [<deadline ms> ]<task id>"``, the task id last
    (``REBIND_KEY`` and ``RELEASE_KEY`` match on it)."""
    return f"{fingerprint} {task_id}" if deadline_ms is None else f"{fingerprint} {deadline_ms} {task_id}"


def parse_binding(text: str) -> KeyClaim | None:
    """The claim a key's value (``binding``) holds; None for a value that is not one."""
    parts = text.split(" ")
    if len(parts) == 2:
        return KeyClaim(parts[1], parts[0])
    if len(parts) == 3 and parts[1].isdigit():
        return KeyClaim(parts[2], parts[0], int(parts[1]))
    return None


def reply_frames(data: bytes) -> list[bytes]:
    """The docs of one reply-channel message (``APPLY``, ``CANCEL``); raises ValueError on a message
    that is not whole frames."""
    docs: list[bytes] = []
    at = 0
    while at < len(data):
        size = int.from_bytes(data[at : at + 4], "big")
        end = at + 4 + size
        if size == 0 or end > len(data):
            raise ValueError(f"a reply frame of {size} bytes at {at} overruns the message's {len(data)}")
        docs.append(data[at + 4 : end])
        at = end
    return docs
