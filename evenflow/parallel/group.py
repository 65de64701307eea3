"""What every backend offers (`ProcessGroup`) and how collectives fail.

All collectives are blocking and called by every rank of the group in the same order with
tensors of the same shape and dtype (all_to_all: the same row shape). Every wait has a
timeout: a rank that died or stopped answering turns into `PeerLost` or `CollectiveTimeout`,
never a hang.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class CollectiveError(RuntimeError):
    """A collective could not complete; the group is unusable afterwards."""


class CollectiveTimeout(CollectiveError):
    pass


class PeerLost(CollectiveError):
    pass


class ProcessGroup(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, tensor: Tensor) -> Tensor:
        """Sum over ranks, in place (and returned). Summed in rank order on every rank, so
        every rank gets bitwise the same result."""
        ...

    def all_gather(self, tensor: Tensor) -> Tensor:
        """(world_size, *tensor.shape): every rank's tensor, by rank."""
        ...

    def reduce_scatter(self, tensor: Tensor) -> Tensor:
        """This rank's part (torch.tensor_split along dim 0) of the sum over ranks."""
        ...

    def all_to_all(self, tensor: Tensor, send_counts: list[int]) -> Tensor:
        """Rows [sum(send_counts[:r]), sum(send_counts[:r+1])) go to rank r; returns the rows
        every rank sent here, concatenated by source rank."""
        ...

    def broadcast(self, tensor: Tensor, src: int = 0, patient: bool = False) -> Tensor:
        """`src`'s tensor, into `tensor` in place on every rank (and returned). patient: the
        receivers may wait indefinitely while `src` is alive (a follower idling until its
        leader's next command), sleeping rather than spinning once the wait grows long."""
        ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...
