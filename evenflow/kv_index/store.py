"""The Redis layout of the global KV index (and the balancer's placement), and its scripts.
One place spells every key. Every key starts with the namespace `ev:{model}:{mesh}:` ({ns}
below, MeshConfig.redis_prefix), so several meshes, or several models, can share one Redis
without seeing each other:

    {ns}b:{hash}     SET of members holding the block      (member = "{worker_id}@{epoch}")
    {ns}w:{member}   SET of block hashes the member holds  (so a member can be dropped at once)
    {ns}lease        ZSET member -> lease expiry (unix s)  (renewed from heartbeats)
    {ns}p:{hash}     HASH member -> 1: predicted to hold the block soon (PX ttl, by gateways)
    {ns}pm:{member}  STRING: the member has predictions     (PX ttl; the match skips the rest)
    {ns}instance     STRING the index service's id         (gone => Redis restarted: resync)
    {ns}eplb:placement  the balancer's placement in force (balancer/service.py writes it)

The scripts take the namespace as ARGV[1].

{hash} is the block hash's 8 bytes, little-endian (binary-safe keys): a match sends a prompt's
hashes as one packed string, which is what keeps it near one bare round trip.

A worker's entries only match while its lease is live; a restarted worker has a new epoch, so
its old member can never match again.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    """The keys of one namespace (one model served by one mesh)."""

    prefix: str

    @property
    def leases(self) -> str:
        return self.prefix + "lease"

    @property
    def instance(self) -> str:
        return self.prefix + "instance"

    def block_key(self, block_hash: int) -> bytes:
        return self.prefix.encode() + b"b:" + hash_bytes(block_hash)

    def member_key(self, member: str) -> str:
        return f"{self.prefix}w:{member}"


def hash_bytes(block_hash: int) -> bytes:
    return block_hash.to_bytes(8, "little")


def pack_hashes(block_hashes: list[int]) -> bytes:
    return struct.pack(f"<{len(block_hashes)}Q", *block_hashes)


def member_of(worker_id: str, epoch: str) -> str:
    return f"{worker_id}@{epoch}"


def split_member(member: str) -> tuple[str, str]:
    worker_id, _, epoch = member.rpartition("@")
    return worker_id, epoch


# ARGV: namespace, now (unix seconds), then the request's block hashes packed (pack_hashes),
# chain order.
# Returns a flat list [member, matched_blocks, ...] for every live member that holds (or is
# predicted to hold) a leading run of the blocks. One round trip. The candidates are the holders
# of the first block; each one's run is found by binary search, O(log n) probes per member:
# holdings are prefix-closed, since a block is only cached after its parent and eviction takes
# a sequence's tail blocks first. Predictions are probed only for members that have any.
MATCH = """
local ns = ARGV[1]
local now = tonumber(ARGV[2])
local blob = ARGV[3]
local n = #blob / 8
local function hash(i) return string.sub(blob, 8 * i - 7, 8 * i) end
local function holds(m, i, predicting)
  local h = hash(i)
  if redis.call('SISMEMBER', ns .. 'b:' .. h, m) == 1 then return true end
  return predicting and redis.call('HEXISTS', ns .. 'p:' .. h, m) == 1
end
local candidates = redis.call('SMEMBERS', ns .. 'b:' .. hash(1))
for _, m in ipairs(redis.call('HKEYS', ns .. 'p:' .. hash(1))) do table.insert(candidates, m) end
local out, seen = {}, {}
for _, m in ipairs(candidates) do
  if not seen[m] then
    seen[m] = true
    local expiry = redis.call('ZSCORE', ns .. 'lease', m)
    if expiry and tonumber(expiry) > now then
      local predicting = redis.call('EXISTS', ns .. 'pm:' .. m) == 1
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

# ARGV: namespace, ttl_ms, then pairs (member, its predicted block hashes packed). One round
# trip from the gateway whatever the prompt's length; the per-block writes happen inside Redis.
PREDICT = """
local ns = ARGV[1]
local ttl = ARGV[2]
for i = 3, #ARGV, 2 do
  local m, blob = ARGV[i], ARGV[i + 1]
  if #blob > 0 then
    redis.call('SET', ns .. 'pm:' .. m, 1, 'PX', ttl)
    for j = 1, #blob, 8 do
      local key = ns .. 'p:' .. string.sub(blob, j, j + 7)
      redis.call('HSET', key, m, 1)
      redis.call('PEXPIRE', key, ttl)
    end
  end
end
return 0
"""

# KEYS: none. ARGV: namespace, member. Forget everything a member holds.
DROP_MEMBER = """
local ns, m = ARGV[1], ARGV[2]
local hashes = redis.call('SMEMBERS', ns .. 'w:' .. m)
for _, h in ipairs(hashes) do redis.call('SREM', ns .. 'b:' .. h, m) end
redis.call('DEL', ns .. 'w:' .. m)
redis.call('ZREM', ns .. 'lease', m)
return #hashes
"""
