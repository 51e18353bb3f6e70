"""The Lua scripts that write the index of dead letters (``broker.dead_letter_index``), each
run whole in Redis so that an entry, its copies and the counts never disagree.

KEYS are the index's parts, in the order of ``PARTS``. The per-key and per-reason sorted sets
are named from the index's prefix (ARGV[1]), in the same slot.
"""

from __future__ import annotations

# KEYS[1] .. KEYS[8] of every script, as ``StreamKeys.dead_letter_index`` names them.
PARTS = ("by-time", "by-id", "rows", "details", "copies", "added", "reasons", "counts")

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# Counts move by whole numbers; HINCRBY refuses "-0", so a zero move is skipped.
_BUMP = """
local function bump(field, delta)
  if delta ~= 0 then redis.call('HINCRBY', KEYS[8], field, delta) end
end
"""

# One new entry: ARGV at i: entry, score, row, detail, copies, reason.
_ADD_ONE = (
    _BUMP
    + """
local function add_one(prefix, i, now)
  local m, row, n = ARGV[i], ARGV[i + 2], tonumber(ARGV[i + 4])
  local meta = cjson.decode(row)
  if redis.call('HEXISTS', KEYS[3], m) == 0 then
    -- dead at (ms), and the order of indexing within one ms (a fraction of 4096ths)
    local order = redis.call('HINCRBY', KEYS[8], 'order', 1) % 4096
    local score = tonumber(ARGV[i + 1]) + order / 4096
    redis.call('HSET', KEYS[3], m, row)
    redis.call('HSET', KEYS[4], m, ARGV[i + 3])
    redis.call('HSET', KEYS[6], m, now)
    redis.call('ZADD', KEYS[1], score, m)
    redis.call('ZADD', KEYS[2], 0, m)
    if meta.kd ~= '' then redis.call('ZADD', prefix .. 'key:' .. meta.kd, score, m) end
    if meta.rd ~= '' then
      redis.call('ZADD', prefix .. 'reason:' .. meta.rd, score, m)
      redis.call('HSET', KEYS[7], meta.rd, ARGV[i + 5])
    end
  end
  redis.call('HINCRBY', KEYS[5], m, n)
  bump('letters', n)
  bump('messages', n * meta.w)
end
"""
)

_DELETE_ONE = (
    _BUMP
    + """
local function delete_one(prefix, m)
  local row = redis.call('HGET', KEYS[3], m)
  local copies = tonumber(redis.call('HGET', KEYS[5], m) or '0')
  if not row then return end
  local meta = cjson.decode(row)
  bump('letters', -copies)
  bump('messages', -copies * meta.w)
  redis.call('HDEL', KEYS[3], m)
  redis.call('HDEL', KEYS[4], m)
  redis.call('HDEL', KEYS[5], m)
  redis.call('HDEL', KEYS[6], m)
  redis.call('ZREM', KEYS[1], m)
  redis.call('ZREM', KEYS[2], m)
  if meta.kd ~= '' then redis.call('ZREM', prefix .. 'key:' .. meta.kd, m) end
  if meta.rd ~= '' then
    local reason_set = prefix .. 'reason:' .. meta.rd
    redis.call('ZREM', reason_set, m)
    if redis.call('EXISTS', reason_set) == 0 then redis.call('HDEL', KEYS[7], meta.rd) end
  end
end
"""
)

# ARGV[1] = prefix, then (entry, score, row, detail, copies, reason) per new letter.
ADD = (
    _ADD_ONE
    + _NOW
    + """
for i = 2, #ARGV, 6 do add_one(ARGV[1], i, now) end
return 1
"""
)

# ARGV[1] = prefix, then (entry, copies removed) each: fewer copies, or none left.
REMOVE = (
    _DELETE_ONE
    + """
for i = 2, #ARGV, 2 do
  local m, n = ARGV[i], tonumber(ARGV[i + 1])
  local copies = tonumber(redis.call('HGET', KEYS[5], m) or '0')
  if copies > n then
    local meta = cjson.decode(redis.call('HGET', KEYS[3], m))
    redis.call('HSET', KEYS[5], m, copies - n)
    bump('letters', -n)
    bump('messages', -n * meta.w)
  else
    delete_one(ARGV[1], m)
  end
end
return 1
"""
)

# ARGV[1] = prefix, ARGV[2] = walk start (Redis ms), then per letter a walk met:
# (entry, score, row, detail, copies, reason). A new entry is added; an indexed one gets the
# copies the walk met, or more if it was indexed after the walk began (a copy since).
MET = (
    _ADD_ONE
    + _NOW
    + """
local started = tonumber(ARGV[2])
for i = 3, #ARGV, 6 do
  local m, n = ARGV[i], tonumber(ARGV[i + 4])
  local copies = redis.call('HGET', KEYS[5], m)
  if not copies then
    add_one(ARGV[1], i, now)
  else
    copies = tonumber(copies)
    local added = tonumber(redis.call('HGET', KEYS[6], m) or '0')
    local target = n
    if added >= started and copies > n then target = copies end
    if target ~= copies then
      local meta = cjson.decode(redis.call('HGET', KEYS[3], m))
      redis.call('HSET', KEYS[5], m, target)
      bump('letters', target - copies)
      bump('messages', (target - copies) * meta.w)
    end
  end
end
return 1
"""
)

# ARGV[1] = prefix, ARGV[2] = walk start, then entries a walk did not meet: each indexed
# before the walk began is gone from the queue and leaves the index. Returns those kept.
UNMET = (
    _DELETE_ONE
    + """
local kept = {}
for i = 3, #ARGV do
  local added = redis.call('HGET', KEYS[6], ARGV[i])
  if added and tonumber(added) < tonumber(ARGV[2]) then
    delete_one(ARGV[1], ARGV[i])
  elseif added then
    table.insert(kept, ARGV[i])
  end
end
return kept
"""
)
