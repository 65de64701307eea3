"""How a rank-0 process drives the rank processes it started (tensor-parallel followers,
offline expert-parallel ranks) over their process group: a command is a header int64[kind,
payload bytes] broadcast, then its msgpack payload as bytes; receivers wait for the header
patiently (no timeout while rank 0 lives, sleeping once idle). And how they are stopped."""

from __future__ import annotations

from typing import Any

import msgpack
import torch

from evenflow.parallel.group import ProcessGroup

LOAD_TIMEOUT_S = 600.0  # every rank of a group started, joined and loaded its weights
STEP_TIMEOUT_S = 60.0  # any one collective once serving


def send_command(group: ProcessGroup, kind: int, payload: Any = None) -> None:
    data = msgpack.packb(payload)
    group.broadcast(torch.tensor([kind, len(data)], dtype=torch.int64))
    group.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def receive_command(group: ProcessGroup) -> tuple[int, Any]:
    header = group.broadcast(torch.zeros(2, dtype=torch.int64), patient=True)
    kind, size = header.tolist()
    data = group.broadcast(torch.empty(size, dtype=torch.uint8))
    return kind, msgpack.unpackb(data.numpy().tobytes())


def stop_ranks(procs: list[Any], group: ProcessGroup | None, stop_kind: int) -> None:
    """Tell the ranks to stop (if they can all hear it), then make sure they are gone, and
    close the group."""
    if group is not None and all(p.exitcode is None for p in procs):
        try:
            group.timeout_s = 2.0  # type: ignore[attr-defined]
            send_command(group, stop_kind)
        except Exception:  # gone or stuck: killed below
            pass
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    if group is not None:
        group.close()
