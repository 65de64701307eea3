"""The Redis layout of the global KV index, and its scripts. One place spells every key.

    ev:b:{hash}     SET of members holding the block      (member = "{worker_id}@{epoch}")
    ev:w:{member}   SET of block hashes the member holds  (so a member can be dropped at once)
    ev:lease        ZSET member -> lease expiry (unix s)  (renewed from heartbeats)
    ev:p:{hash}     HASH role -> member predicted to hold the block soon (PX ttl, by gateways)
    ev:instance     STRING the index service's id         (gone => Redis restarted: resync)

A worker's entries only match while its lease is live; a restarted worker has a new epoch, so
its old member can never match again.
"""

from __future__ import annotations

PREFIX = "ev:"
LEASES = PREFIX + "lease"
INSTANCE = PREFIX + "instance"


def block_key(block_hash: int | str) -> str:
    return f"{PREFIX}b:{block_hash}"


def member_key(member: str) -> str:
    return f"{PREFIX}w:{member}"


def predicted_key(block_hash: int | str) -> str:
    return f"{PREFIX}p:{block_hash}"


def member_of(worker_id: str, epoch: str) -> str:
    return f"{worker_id}@{epoch}"


def split_member(member: str) -> tuple[str, str]:
    worker_id, _, epoch = member.rpartition("@")
    return worker_id, epoch


# ARGV: now (unix seconds), then the request's block hashes in chain order. Returns a flat list
# [member, matched_blocks, ...] for every live member that holds (or is predicted to hold) a
# leading run of the blocks. One round trip, whatever the prompt length.
MATCH = """
local now = tonumber(ARGV[1])
local live, prefix = {}, {}
for i = 2, #ARGV do
  local h = ARGV[i]
  local holders = redis.call('SMEMBERS', 'ev:b:' .. h)
  for _, m in ipairs(redis.call('HVALS', 'ev:p:' .. h)) do table.insert(holders, m) end
  local extended = false
  for _, m in ipairs(holders) do
    if (prefix[m] or 0) == i - 2 then
      if live[m] == nil then
        local expiry = redis.call('ZSCORE', 'ev:lease', m)
        live[m] = expiry ~= false and tonumber(expiry) > now
      end
      if live[m] then
        prefix[m] = i - 1
        extended = true
      end
    end
  end
  if not extended then break end
end
local out = {}
for m, n in pairs(prefix) do
  if n > 0 then
    table.insert(out, m)
    table.insert(out, n)
  end
end
return out
"""

# KEYS: none. ARGV: member. Forget everything a member holds.
DROP_MEMBER = """
local m = ARGV[1]
local hashes = redis.call('SMEMBERS', 'ev:w:' .. m)
for _, h in ipairs(hashes) do redis.call('SREM', 'ev:b:' .. h, m) end
redis.call('DEL', 'ev:w:' .. m)
redis.call('ZREM', 'ev:lease', m)
return #hashes
"""
