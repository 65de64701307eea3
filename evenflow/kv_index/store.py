"""The Redis layout of the global KV index, and its scripts. One place spells every key.

    ev:b:{hash}     SET of members holding the block      (member = "{worker_id}@{epoch}")
    ev:w:{member}   SET of block hashes the member holds  (so a member can be dropped at once)
    ev:lease        ZSET member -> lease expiry (unix s)  (renewed from heartbeats)
    ev:p:{hash}     HASH member -> 1: predicted to hold the block soon (PX ttl, by gateways)
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
# leading run of the blocks. One round trip. The candidates are the holders of the first block;
# each one's run is found by binary search, O(log n) probes per member: holdings are
# prefix-closed, since a block is only cached after its parent and eviction takes a
# sequence's tail blocks first.
MATCH = """
local now = tonumber(ARGV[1])
local n = #ARGV - 1
local function holds(m, i)
  local h = ARGV[i + 1]
  return redis.call('SISMEMBER', 'ev:b:' .. h, m) == 1
      or redis.call('HEXISTS', 'ev:p:' .. h, m) == 1
end
local candidates = redis.call('SMEMBERS', 'ev:b:' .. ARGV[2])
for _, m in ipairs(redis.call('HKEYS', 'ev:p:' .. ARGV[2])) do table.insert(candidates, m) end
local out, seen = {}, {}
for _, m in ipairs(candidates) do
  if not seen[m] then
    seen[m] = true
    local expiry = redis.call('ZSCORE', 'ev:lease', m)
    if expiry and tonumber(expiry) > now then
      local lo, hi = 1, n
      while lo < hi do
        local mid = math.floor((lo + hi + 1) / 2)
        if holds(m, mid) then lo = mid else hi = mid - 1 end
      end
      table.insert(out, m)
      table.insert(out, lo)
    end
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
