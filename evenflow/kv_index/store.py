"""The Redis layout of the global KV index, and its scripts. One place spells every key.

    ev:b:{hash}     SET of members holding the block      (member = "{worker_id}@{epoch}")
    ev:w:{member}   SET of block hashes the member holds  (so a member can be dropped at once)
    ev:lease        ZSET member -> lease expiry (unix s)  (renewed from heartbeats)
    ev:p:{hash}     HASH member -> 1: predicted to hold the block soon (PX ttl, by gateways)
    ev:pm:{member}  STRING: the member has predictions     (PX ttl; the match skips the rest)
    ev:instance     STRING the index service's id         (gone => Redis restarted: resync)

{hash} is the block hash's 8 bytes, little-endian (binary-safe keys): a match sends a prompt's
hashes as one packed string, which is what keeps it near one bare round trip.

A worker's entries only match while its lease is live; a restarted worker has a new epoch, so
its old member can never match again.
"""

from __future__ import annotations

import struct

PREFIX = "ev:"
LEASES = PREFIX + "lease"
INSTANCE = PREFIX + "instance"


def hash_bytes(block_hash: int) -> bytes:
    return block_hash.to_bytes(8, "little")


def pack_hashes(block_hashes: list[int]) -> bytes:
    return struct.pack(f"<{len(block_hashes)}Q", *block_hashes)


def block_key(block_hash: int) -> bytes:
    return b"ev:b:" + hash_bytes(block_hash)


def member_key(member: str) -> str:
    return f"{PREFIX}w:{member}"


def member_of(worker_id: str, epoch: str) -> str:
    return f"{worker_id}@{epoch}"


def split_member(member: str) -> tuple[str, str]:
    worker_id, _, epoch = member.rpartition("@")
    return worker_id, epoch


# ARGV: now (unix seconds), then the request's block hashes packed (pack_hashes), chain order.
# Returns a flat list [member, matched_blocks, ...] for every live member that holds (or is
# predicted to hold) a leading run of the blocks. One round trip. The candidates are the holders
# of the first block; each one's run is found by binary search, O(log n) probes per member:
# holdings are prefix-closed, since a block is only cached after its parent and eviction takes
# a sequence's tail blocks first. Predictions are probed only for members that have any.
MATCH = """
local now = tonumber(ARGV[1])
local blob = ARGV[2]
local n = #blob / 8
local function hash(i) return string.sub(blob, 8 * i - 7, 8 * i) end
local function holds(m, i, predicting)
  local h = hash(i)
  if redis.call('SISMEMBER', 'ev:b:' .. h, m) == 1 then return true end
  return predicting and redis.call('HEXISTS', 'ev:p:' .. h, m) == 1
end
local candidates = redis.call('SMEMBERS', 'ev:b:' .. hash(1))
for _, m in ipairs(redis.call('HKEYS', 'ev:p:' .. hash(1))) do table.insert(candidates, m) end
local out, seen = {}, {}
for _, m in ipairs(candidates) do
  if not seen[m] then
    seen[m] = true
    local expiry = redis.call('ZSCORE', 'ev:lease', m)
    if expiry and tonumber(expiry) > now then
      local predicting = redis.call('EXISTS', 'ev:pm:' .. m) == 1
      local lo, hi = 1, n
      while lo < hi do
        local mid = math.floor((lo + hi + 1) / 2)
        if holds(m, mid, predicting) then lo = mid else hi = mid - 1 end
      end
      table.insert(out, m)
      table.insert(out, lo)
    end
  end
end
return out
"""

# ARGV: ttl_ms, then pairs (member, its predicted block hashes packed). One round trip from the
# gateway whatever the prompt's length; the per-block writes happen inside Redis.
PREDICT = """
local ttl = ARGV[1]
for i = 2, #ARGV, 2 do
  local m, blob = ARGV[i], ARGV[i + 1]
  if #blob > 0 then
    redis.call('SET', 'ev:pm:' .. m, 1, 'PX', ttl)
    for j = 1, #blob, 8 do
      local key = 'ev:p:' .. string.sub(blob, j, j + 7)
      redis.call('HSET', key, m, 1)
      redis.call('PEXPIRE', key, ttl)
    end
  end
end
return 0
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
