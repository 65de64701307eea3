"""Elastic rendezvous of an expert-parallel group whose ranks may sit on several hosts.

The ranks meet in a TCPStore served by one small process (`python -m
evenflow.parallel.rendezvous HOST:PORT`, started by `evenflow serve --ep-rendezvous-serve`).
A group lives in numbered epochs. Epoch e is formed by the planned ranks that register for
it: once all `world` of them are there, or `settle_s` after a rank's own arrival (half of it
for a later epoch: survivors of a loss restart together, and time without a group is time
without service), that rank fixes the members with an atomic compare-and-set (the first
one wins; every rank reads the same list), keeping the largest count the model's slots split
over (`sizes`). Members are renumbered 0..n-1 in planned-rank order, and their
torch.distributed group uses the store under the epoch's prefix.

A rank that finds epoch e already formed:
- was one of its members: the epoch is broken (this rank died and came back), so it starts
  epoch e + 1 and registers there (the survivors, restarting too, meet it there);
- was not (it came back late, or its host did): it asks to join (`e{e}/join/{rank}`) and waits
  for the next epoch. The running group's rank 0 looks for such requests between steps
  (`Membership.joiners`); the group then ends its epoch, naming the next one's members (its
  own and the joiners: `e{e+1}/expect`), and the next epoch forms once they are all there
  (or EXPECT_WAIT_S has passed, if one of them died meanwhile).

Every wait here has a deadline: a store that is gone, or a group that never forms, is an error.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

POLL_S = 0.05
EXPECT_WAIT_S = 30.0  # an epoch whose members were named waits this long for all of them


class RendezvousError(RuntimeError):
    pass


@dataclass
class Membership:
    store: dist.TCPStore
    address: str
    name: str
    epoch: int
    members: list[int]  # planned ranks, in group order
    planned_rank: int
    world: int  # planned ranks in all
    sizes: tuple[int, ...]  # group sizes the model's slots split over

    @property
    def rank(self) -> int:
        return self.members.index(self.planned_rank)

    @property
    def size(self) -> int:
        return len(self.members)

    def _key(self, *parts: object) -> str:
        return "/".join([self.name, f"e{self.epoch}", *map(str, parts)])

    def joiners(self) -> list[int]:
        """Planned ranks waiting to join, when taking them makes a group size the slots split
        over (a store round trip per absent rank: call it every second or so)."""
        waiting = [r for r in range(self.world)
                   if r not in self.members and self.store.check([self._key("join", r)])]
        return waiting if waiting and self.size + len(waiting) in self.sizes else []

    def end_epoch(self, joiners: list[int] | None = None) -> None:
        """Close this epoch; the next one waits for this one's members and `joiners`."""
        expected = sorted(set(self.members) | set(joiners or []))
        self.store.set(f"{self.name}/e{self.epoch + 1}/expect", ",".join(map(str, expected)))
        _bump(self.store, self.name, self.epoch)

    def prefix_store(self) -> dist.PrefixStore:
        return dist.PrefixStore(self._key("pg"), self.store)


def connect(address: str, timeout_s: float = 30.0) -> dist.TCPStore:
    host, port = _split(address)
    try:
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:
        raise RendezvousError(f"no rendezvous store at {address}: {exc}") from exc


def join(address: str, name: str, planned_rank: int, world: int, sizes: tuple[int, ...],
         settle_s: float = 3.0, timeout_s: float = 600.0) -> Membership:
    """This rank's place in the next epoch its group forms (see the module's docstring)."""
    deadline = time.monotonic() + timeout_s
    while True:  # (another host's ranks may start before the store does)
        try:
            store = connect(address, min(10.0, max(0.5, deadline - time.monotonic())))
            break
        except RendezvousError:
            if time.monotonic() > deadline:
                raise
    try:
        while time.monotonic() < deadline:
            epoch = _epoch(store, name)
            key = f"{name}/e{epoch}"
            if store.check([f"{key}/members"]):
                if planned_rank in _members(store, key):
                    _bump(store, name, epoch)  # our own epoch: broken
                else:
                    store.set(f"{key}/join/{planned_rank}", "1")
                    _wait_epoch_after(store, name, epoch, deadline)
                continue
            store.set(f"{key}/rank/{planned_rank}", "1")
            arrived = time.monotonic()
            settle = settle_s if epoch == 0 else settle_s / 2
            expected = set(_members(store, key, "expect")) if store.check(
                [f"{key}/expect"]) else None
            if expected:
                settle = EXPECT_WAIT_S
            while not store.check([f"{key}/members"]):
                present = [r for r in range(world) if store.check([f"{key}/rank/{r}"])]
                if len(present) == world or (expected and expected <= set(present)) or \
                        time.monotonic() - arrived >= settle:
                    count = max((n for n in sizes if n <= len(present)), default=0)
                    if count:
                        chosen = ",".join(map(str, present[:count]))
                        store.compare_set(f"{key}/members", "", chosen)
                        break
                if time.monotonic() > deadline:
                    break
                time.sleep(POLL_S)
            if not store.check([f"{key}/members"]):
                continue
            members = _members(store, key)
            if planned_rank in members:
                return Membership(store, address, name, epoch, members, planned_rank, world,
                                  sizes)
            store.set(f"{key}/join/{planned_rank}", "1")  # left out: the next epoch
            _wait_epoch_after(store, name, epoch, deadline)
    except (RuntimeError, OSError) as exc:  # the store went away
        raise RendezvousError(f"rendezvous at {address}: {exc}") from exc
    raise RendezvousError(f"group {name}: no epoch formed with rank {planned_rank} within "
                          f"{timeout_s:g} s")


def _epoch(store: dist.TCPStore, name: str) -> int:
    return int(store.add(f"{name}/epoch", 0))


def _bump(store: dist.TCPStore, name: str, epoch: int) -> None:
    """Epoch -> epoch + 1, unless someone did already (add() stores the count as text)."""
    store.compare_set(f"{name}/epoch", str(epoch), str(epoch + 1))


def _members(store: dist.TCPStore, key: str, which: str = "members") -> list[int]:
    return [int(r) for r in store.get(f"{key}/{which}").decode().split(",") if r]


def _wait_epoch_after(store: dist.TCPStore, name: str, epoch: int, deadline: float) -> None:
    while _epoch(store, name) <= epoch:
        if time.monotonic() > deadline:
            return
        time.sleep(POLL_S * 4)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise RendezvousError(f"rendezvous address must be HOST:PORT, got {address!r}")
    return host, int(port)


def serve(address: str) -> None:
    """Serve the store until killed."""
    host, port = _split(address)
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    print(f"evenflow rendezvous store at {address}", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        del store


if __name__ == "__main__":
    serve(sys.argv[1])
