"""The elastic rendezvous of a DEP group (parallel/rendezvous.py) against a real TCPStore:
epochs form from the ranks that arrive, a restarted member starts the next epoch, a late
rank asks to join and the next epoch includes it, sizes the slots do not split over wait."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from evenflow.parallel.rendezvous import Membership, RendezvousError, join
from evenflow.services.launcher import free_port


@pytest.fixture
def address():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    yield f"127.0.0.1:{port}"
    del store


def join_all(address: str, ranks: list[int], world: int = 4, sizes=(1, 2, 3, 4),
             settle_s: float = 0.3, timeout_s: float = 20) -> dict[int, Membership]:
    """Each rank's membership (or the error its join ended in)."""
    out: dict = {}

    def one(rank: int) -> None:
        try:
            out[rank] = join(address, "g", rank, world, sizes, settle_s, timeout_s)
        except RendezvousError as exc:
            out[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_every_planned_rank_forms_one_epoch(address):
    got = join_all(address, [3, 1, 0, 2], settle_s=30)  # all four: no settle wait
    assert {m.epoch for m in got.values()} == {0}
    assert all(m.members == [0, 1, 2, 3] and m.rank == r for r, m in got.items())


def test_survivors_reform_and_a_late_rank_is_taken_back(address):
    first = join_all(address, [0, 1, 2, 3], settle_s=30)
    assert first[0].joiners() == []
    # ranks 2 and 3 are gone; 0 and 1 restart: the next epoch is theirs alone
    second = join_all(address, [0, 1])
    assert [(m.epoch, m.members) for m in second.values()] == [(1, [0, 1])] * 2
    # rank 2 comes back: it asks to join, the group's rank 0 sees it, ends the epoch and
    # every rank meets again in the next one
    late: dict[int, Membership] = {}
    thread = threading.Thread(target=lambda: late.update(join_all(address, [2])))
    thread.start()
    waiting = []
    for _ in range(100):
        if waiting := second[0].joiners():
            break
        threading.Event().wait(0.05)
    assert waiting == [2]
    second[0].end_epoch(waiting)  # the next epoch: 0, 1 and 2, whoever comes first waits
    time.sleep(1.0)  # rank 2 is there first (and waits for 0 and 1, past its settle time)
    third = join_all(address, [0, 1])
    thread.join(30)
    assert third[0].members == [0, 1, 2] and late[2].epoch == third[0].epoch == 2
    assert late[2].rank == 2


def test_a_size_the_slots_do_not_split_over_is_not_formed(address):
    got = join_all(address, [0, 1, 2], sizes=(1, 2, 4), timeout_s=3)  # 3 does not divide
    assert got[0].members == got[1].members == [0, 1]
    assert isinstance(got[2], RendezvousError)  # rank 2 waits for a next epoch (none here)


def test_no_store_is_an_error():
    with pytest.raises(RendezvousError, match="no rendezvous store"):
        join(f"127.0.0.1:{free_port()}", "g", 0, 2, (1, 2), 0.1, timeout_s=2)
