"""Collectives across hosts with torch.distributed's gloo backend, behind the same interface
(and the NCCL path for GPUs: the same calls, selected by device; not exercised on CPU hosts).

`init_default(rank, world_size, address, timeout_s)` starts the default process group once per
process; `GlooGroup(ranks)` is a group over some of its ranks (all ranks must create it, as
torch.distributed requires). Waits time out after the group's timeout (CollectiveTimeout).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from evenflow.parallel.group import CollectiveTimeout


def init_default(rank: int, world_size: int, address: str, timeout_s: float = 30.0) -> None:
    """address: "host:port" of rank 0's rendezvous store."""
    backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


class GlooGroup:
    def __init__(self, ranks: list[int] | None = None, timeout_s: float = 30.0) -> None:
        world = dist.get_world_size()
        self.ranks = list(range(world)) if ranks is None else sorted(ranks)
        self.group = None if ranks is None else dist.new_group(
            self.ranks, timeout=timedelta(seconds=timeout_s), backend="gloo")
        self.world_size = len(self.ranks)
        me = dist.get_rank()
        self.rank = self.ranks.index(me) if me in self.ranks else -1

    def _run(self, fn, *args, **kwargs):
        try:
            return fn(*args, group=self.group, **kwargs)
        except RuntimeError as exc:  # gloo reports a dead or silent peer as a RuntimeError
            raise CollectiveTimeout(f"gloo collective failed: {exc}") from exc

    def all_reduce(self, tensor: Tensor) -> Tensor:
        self._run(dist.all_reduce, tensor)
        return tensor

    def all_gather(self, tensor: Tensor) -> Tensor:
        out = torch.empty(self.world_size, *tensor.shape, dtype=tensor.dtype)
        self._run(dist.all_gather, list(out.unbind(0)), tensor.contiguous())
        return out

    def reduce_scatter(self, tensor: Tensor) -> Tensor:
        summed = self.all_reduce(tensor.clone())
        return summed.tensor_split(self.world_size)[self.rank].clone()

    def all_to_all(self, tensor: Tensor, send_counts: list[int],
                   matrix: Tensor | None = None) -> Tensor:
        """matrix: every rank's send_counts [src, dst], when the caller gathered them."""
        # gloo's all_to_all takes equal sizes only: every chunk padded to the largest
        if matrix is None:
            matrix = self.all_gather(torch.tensor(send_counts, dtype=torch.int64))
        incoming, width = matrix[:, self.rank].tolist(), int(matrix.max())
        rows = tensor.contiguous()
        sends = []
        for chunk in rows.split(send_counts):
            padded = chunk.new_zeros(width, *rows.shape[1:])
            padded[: len(chunk)] = chunk
            sends.append(padded)
        outs = [rows.new_empty(width, *rows.shape[1:]) for _ in range(self.world_size)]
        self._run(dist.all_to_all, outs, sends)
        return torch.cat([out[:n] for out, n in zip(outs, incoming, strict=True)])

    def broadcast(self, tensor: Tensor, src: int = 0, patient: bool = False) -> Tensor:
        # patient: gloo cannot wait without its group's timeout; that timeout applies
        self._run(dist.broadcast, tensor, src=self.ranks[src])
        return tensor

    def barrier(self) -> None:
        self._run(dist.barrier)

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
