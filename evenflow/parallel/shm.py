"""Collectives for ranks on one host through one shared-memory segment.

Layout of the segment (a file in /dev/shm, mapped by every rank):

    header   world_size lines of 64 bytes: [seq, pid, 0...] per rank (int64)
    buffers  2 (alternating by op parity) x world_size slots of `slot_bytes`

Op number k (every rank counts its collectives): a rank writes its input into its slot of
buffer k % 2, then publishes seq = k; it reads the other slots once every rank's seq >= k. A
rank may only write buffer k % 2 again for op k + 2, which needs every seq >= k + 1: by then
everyone has finished reading op k. No locks; x86's store ordering makes the data visible
before the seq that announces it. Reductions run as torch ops on views of the slots (rank
order everywhere, so every rank gets bitwise the same sum). Messages larger than a slot go in
slot-sized pieces.

No leaked segments: once every rank has mapped the segment, its name is unlinked (the mapping
lives on until the last rank exits, SIGKILL included); a rank that never joins makes the others
fail within the timeout and the creator unlinks it then.

Waits spin briefly, then yield the CPU (another rank may need it), then sleep in short steps;
every `liveness_every_s` they check that the other ranks' processes are alive (PeerLost), and
they give up after `timeout_s` (CollectiveTimeout).
"""

from __future__ import annotations

import math
import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from evenflow.parallel.group import CollectiveTimeout, PeerLost

LINE = 64  # bytes of header per rank
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
DEFAULT_SLOT_BYTES = 4 * 2**20
PATIENT_AFTER_S = 0.05
PATIENT_SLEEP_S = 0.001


def segment_path(name: str) -> Path:
    return SHM_DIR / f"evenflow-{name}"


class ShmGroup:
    def __init__(self, name: str, rank: int, world_size: int,
                 slot_bytes: int = DEFAULT_SLOT_BYTES, timeout_s: float = 30.0,
                 liveness_every_s: float = 0.1,
                 peers_alive: Callable[[], bool] | None = None) -> None:
        """peers_alive: rank 0 may say whether the ranks it started still run, so that one
        that died before joining fails the join at once instead of at the timeout."""
        assert 0 <= rank < world_size and slot_bytes % LINE == 0
        self.name, self.rank, self.world_size = name, rank, world_size
        self.slot_bytes, self.timeout_s, self.liveness_every_s = slot_bytes, timeout_s, \
            liveness_every_s
        self._seq = 0
        self._closed = False
        size = world_size * LINE + 2 * world_size * slot_bytes
        path = segment_path(name)
        deadline = time.monotonic() + timeout_s
        if rank == 0:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
        else:
            while True:
                try:
                    fd = os.open(path, os.O_RDWR)
                    if os.fstat(fd).st_size == size:
                        break
                    os.close(fd)
                except FileNotFoundError:
                    pass
                if time.monotonic() > deadline:
                    raise CollectiveTimeout(f"shm group {name}: rank 0 never created {path}")
                time.sleep(0.005)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._header = memoryview(self._map).cast("q")  # int64 words
        self._pids: list[int] = [0] * world_size
        self._header[rank * 8 + 1] = os.getpid()
        try:
            self._join(deadline, peers_alive)
        finally:
            if rank == 0 or all(self._pids):
                path.unlink(missing_ok=True)  # mapped by all (or failed): the name can go

    def _join(self, deadline: float, peers_alive: Callable[[], bool] | None) -> None:
        while True:
            self._pids = [self._header[r * 8 + 1] for r in range(self.world_size)]
            if all(self._pids):
                return
            if peers_alive is not None and not peers_alive():
                missing = [r for r, p in enumerate(self._pids) if not p]
                raise PeerLost(f"shm group {self.name}: ranks {missing} exited before joining")
            if time.monotonic() > deadline:
                missing = [r for r, p in enumerate(self._pids) if not p]
                raise CollectiveTimeout(f"shm group {self.name}: ranks {missing} never joined")
            time.sleep(0.001)

    # -- synchronisation ----------------------------------------------------------------------
    def _wait(self, k: int, ranks: range | list[int] | None = None, patient: bool = False,
              nap_after_s: float = 0.0) -> None:
        """Until every rank in `ranks` (default all) has published op k. patient: no timeout
        (peers are still checked for liveness), and sleeps of PATIENT_SLEEP_S once the wait
        has lasted PATIENT_AFTER_S (a follower waiting for its leader's next command).
        nap_after_s > 0: sleep in PATIENT_SLEEP_S steps after that long instead of spinning
        (ranks agreeing whether there is work, while the group may be idle)."""
        ranks = range(self.world_size) if ranks is None else ranks
        header = self._header
        if all(header[r * 8] >= k for r in ranks):
            return
        start = time.monotonic()
        next_check = start + self.liveness_every_s
        spins = 0
        while not all(header[r * 8] >= k for r in ranks):
            spins += 1
            if nap_after_s and spins > 100 and time.monotonic() - start > nap_after_s:
                time.sleep(PATIENT_SLEEP_S)
            elif patient and spins > 20_000 and time.monotonic() - start > PATIENT_AFTER_S:
                time.sleep(PATIENT_SLEEP_S)
            elif spins > 20_000:
                time.sleep(0.00005)
            elif spins > 100:
                os.sched_yield()  # oversubscribed: let the rank we wait for run
            now = time.monotonic()
            if now >= next_check:
                next_check = now + self.liveness_every_s
                self._check_peers(ranks, k)
                if now - start > self.timeout_s and not patient:
                    late = [r for r in ranks if header[r * 8] < k]
                    raise CollectiveTimeout(f"shm group {self.name}: ranks {late} did not "
                                            f"reach op {k} within {self.timeout_s:g} s")

    def _check_peers(self, ranks: range | list[int], k: int) -> None:
        for r in ranks:
            if self._header[r * 8] < k and not _alive(self._pids[r]):
                raise PeerLost(f"shm group {self.name}: rank {r} (pid {self._pids[r]}) is gone")

    def _slot(self, k: int, r: int, nbytes: int) -> Tensor:
        start = self.world_size * LINE + ((k % 2) * self.world_size + r) * self.slot_bytes
        return self._bytes[start : start + nbytes]

    def _begin(self) -> int:
        """Next op's number, once its buffer is free (every rank past op k - 1)."""
        if self._closed:
            raise PeerLost(f"shm group {self.name} is closed")
        k = self._seq + 1
        self._wait(k - 1)
        return k

    def _publish(self, k: int) -> None:
        self._header[self.rank * 8] = k
        self._seq = k

    # -- collectives --------------------------------------------------------------------------
    def _pieces(self, flat: Tensor) -> list[Tensor]:
        per = max(1, self.slot_bytes // flat.element_size())
        return list(flat.split(per)) if flat.numel() else [flat]

    def all_reduce(self, tensor: Tensor) -> Tensor:
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
        for piece in self._pieces(flat):
            nbytes = piece.numel() * piece.element_size()
            k = self._begin()
            self._slot(k, self.rank, nbytes).copy_(piece.view(torch.uint8))
            self._publish(k)
            self._wait(k)
            views = [self._slot(k, r, nbytes).view(piece.dtype) for r in range(self.world_size)]
            if len(views) == 1:
                piece.copy_(views[0])
            else:  # rank order on every rank: bitwise the same sum everywhere
                torch.add(views[0], views[1], out=piece)
            for view in views[2:]:
                piece.add_(view)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
        return tensor

    def all_gather(self, tensor: Tensor, nap_after_s: float = 0.0,
                   patient: bool = False) -> Tensor:
        """nap_after_s, patient: see _wait (the lockstep engines' idle agreement; patient: a
        follower rank waiting for its leader's next meeting)."""
        src = tensor.contiguous().view(-1)
        out = torch.empty(self.world_size, src.numel(), dtype=tensor.dtype)
        pieces = self._pieces(src)
        for piece, lo in zip(pieces, _offsets(pieces), strict=True):
            nbytes = piece.numel() * piece.element_size()
            k = self._begin()
            self._slot(k, self.rank, nbytes).copy_(piece.view(torch.uint8))
            self._publish(k)
            self._wait(k, patient=patient, nap_after_s=nap_after_s)
            for r in range(self.world_size):
                out[r, lo : lo + piece.numel()].copy_(self._slot(k, r, nbytes).view(piece.dtype))
        return out.view(self.world_size, *tensor.shape)

    def reduce_scatter(self, tensor: Tensor) -> Tensor:
        summed = self.all_reduce(tensor.clone())
        return summed.tensor_split(self.world_size)[self.rank].clone()

    def all_to_all(self, tensor: Tensor, send_counts: list[int]) -> Tensor:
        assert len(send_counts) == self.world_size and sum(send_counts) == tensor.shape[0]
        rows = tensor.contiguous()
        row_bytes = rows.element_size() * math.prod(rows.shape[1:])  # also with no rows
        head = 8 * self.world_size
        if head + rows.numel() * rows.element_size() > self.slot_bytes:
            raise ValueError(f"all_to_all of {rows.numel() * rows.element_size()} bytes passes "
                             f"the shm slot ({self.slot_bytes} bytes)")
        k = self._begin()
        mine = self._slot(k, self.rank, head + rows.numel() * rows.element_size())
        mine[:head].view(torch.int64).copy_(torch.tensor(send_counts, dtype=torch.int64))
        mine[head:].copy_(rows.view(-1).view(torch.uint8))
        self._publish(k)
        self._wait(k)
        parts = []
        for r in range(self.world_size):
            counts = self._slot(k, r, head).view(torch.int64).tolist()
            start = head + sum(counts[: self.rank]) * row_bytes
            data = self._slot(k, r, start + counts[self.rank] * row_bytes)[start:]
            parts.append(data.view(rows.dtype).view(counts[self.rank], *rows.shape[1:]).clone())
        return torch.cat(parts) if parts else rows[:0]

    def broadcast(self, tensor: Tensor, src: int = 0, patient: bool = False) -> Tensor:
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
        for piece in self._pieces(flat):
            nbytes = piece.numel() * piece.element_size()
            k = self._begin()
            if self.rank == src:
                self._slot(k, src, nbytes).copy_(piece.view(torch.uint8))
            self._publish(k)
            self._wait(k, [src], patient)
            if self.rank != src:
                piece.copy_(self._slot(k, src, nbytes).view(piece.dtype))
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
        return tensor

    def barrier(self) -> None:
        k = self._begin()
        self._publish(k)
        self._wait(k)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._header.release()
            del self._bytes
            try:
                self._map.close()
            except BufferError:  # a view is still held by the caller: unmapped at exit
                pass


def _offsets(pieces: list[Tensor]) -> list[int]:
    out, at = [], 0
    for p in pieces:
        out.append(at)
        at += p.numel()
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child its parent has not reaped yet still "exists"
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
