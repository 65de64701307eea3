"""Tensor-parallel ranks of one engine (tensor_parallel_size = N > 1).

Rank 0 lives in the engine's process and owns everything but its shard of the forward pass:
scheduling, sampling, the mesh. Ranks 1..N-1 are processes of their own (`follower_main`):
each loads its shard (engine/weights/tp_shard.py), builds a KV cache for its heads and then executes
the leader's commands until told to stop or until the leader is gone.

A command (runners/rank_wire.py: a typed message) crosses the process group (shm on this host)
as two broadcasts: a header int64[payload bytes], then its encoded bytes; a KV write adds the
tensor itself. Followers wait for the header patiently (no timeout, liveness checked), so an idle
engine costs them no CPU to speak of.

The K/V hand-off keeps the full-head layout (proto/kv_handoff.py): read_kv gathers every
rank's heads into rank 0, write_kv sends the whole payload and each rank keeps its heads. So a
TP prefill group can hand off to a decode group of any TP size, TP 1 included.

A rank that dies or stops answering makes the leader's next collective raise within its timeout
(`TensorParallelLost`, fatal: the engine cannot step again), and a watchdog notices a dead
follower between steps too (`fatal_error`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import traceback
import uuid
import weakref
from typing import Any

import torch
from torch import Tensor

from evenflow.engine.config.settings import EngineConfig, ModelConfig, ModelLoadError
from evenflow.engine.core.scheduler import ScheduledChunk
from evenflow.engine.model.transformer import CausalLM
from evenflow.engine.runners.model_runner import ChunkInput, ModelRunner
from evenflow.engine.runners.rank_wire import (
    LOAD_TIMEOUT_S,
    STEP_TIMEOUT_S,
    InitRunner,
    Placement,
    RankMessage,
    ReadKV,
    RunForward,
    Stop,
    WriteKV,
    receive_command,
    send_command,
    stop_ranks,
)
from evenflow.engine.weights.loader import load_weights
from evenflow.engine.weights.tp_shard import TPShard
from evenflow.parallel.group import CollectiveError
from evenflow.parallel.shm import ShmGroup

log = logging.getLogger(__name__)

class TensorParallelLost(RuntimeError):
    """A rank of the group is gone: the engine cannot step again (Engine.fatal_error)."""


def threads_per_rank(config: EngineConfig) -> int:
    return config.num_threads or max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


class TPGroup:
    """The leader's side: its follower processes and the process group they share."""

    def __init__(self, config: EngineConfig, model_dir: str, dtype: torch.dtype) -> None:
        world = config.tensor_parallel_size
        name = f"tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=follower_main, name=f"evenflow-tp-rank{rank}",
                                  args=(config, model_dir, str(dtype), name, rank), daemon=True)
                      for rank in range(1, world)]
        for proc in self.procs:
            proc.start()
        self.fatal_error: str | None = None
        try:
            self.group = ShmGroup(name, 0, world, timeout_s=LOAD_TIMEOUT_S, peers_alive=lambda: all(
                p.exitcode is None for p in self.procs))
        except CollectiveError as exc:
            stop_ranks(self.procs, None)
            raise ModelLoadError(f"tensor-parallel ranks did not start: {exc} (a script that "
                                 f"starts ranks needs an `if __name__ == \"__main__\":` "
                                 f"guard)") from exc
        self._finalizer = weakref.finalize(self, stop_ranks, self.procs, self.group)
        threading.Thread(target=_watch, args=(weakref.ref(self),), name="tp watchdog",
                         daemon=True).start()

    def wait_loaded(self) -> None:
        """After the leader loaded its own shard: every rank has loaded its own."""
        try:
            self.group.barrier()
        except CollectiveError as exc:
            self.close()
            raise ModelLoadError(f"a tensor-parallel rank failed to load the model ({exc}); "
                                 f"its error is in this process's log") from exc
        self.group.timeout_s = STEP_TIMEOUT_S

    def send(self, command: RankMessage) -> None:
        send_command(self.group, command)

    def close(self) -> None:
        self._finalizer()


def _watch(ref: weakref.ref[TPGroup]) -> None:
    """Between steps too, a dead follower is noticed (fatal_error) within a second."""
    while (tp := ref()) is not None and tp._finalizer.alive and tp.fatal_error is None:
        for rank, proc in enumerate(tp.procs, start=1):
            if proc.exitcode is not None:
                tp.fatal_error = f"tensor-parallel rank {rank} exited (code {proc.exitcode})"
                log.error("%s", tp.fatal_error)
        del tp
        threading.Event().wait(0.5)


class TPLeaderRunner(ModelRunner):
    """Rank 0's runner: every call that touches the forward pass or the KV cache first sends
    its command, then does its own shard's part."""

    def __init__(self, tp: TPGroup, model: CausalLM, num_blocks: int, block_size: int,
                 max_model_len: int, dtype: torch.dtype, window_blocks: int = 0) -> None:
        self.tp = tp
        self.world_size = tp.group.world_size
        self._shard = TPShard(0, self.world_size)
        self._guard(tp.send, InitRunner(num_blocks=num_blocks, block_size=block_size,
                                        max_model_len=max_model_len,
                                        window_blocks=window_blocks))
        super().__init__(model, num_blocks, block_size, max_model_len, dtype,
                         window_blocks=window_blocks)

    def _guard(self, fn: Any, *args: Any) -> Any:
        if self.tp.fatal_error is not None:
            raise TensorParallelLost(self.tp.fatal_error)
        try:
            return fn(*args)
        except CollectiveError as exc:
            self.tp.fatal_error = f"tensor-parallel group lost: {exc}"
            raise TensorParallelLost(self.tp.fatal_error) from exc

    def run(self, chunks: list[ScheduledChunk]) -> list[int | Tensor]:
        inputs = [ChunkInput.of(c) for c in chunks]
        self._guard(self.tp.send, RunForward(chunks=inputs))
        logits = self._guard(self.forward, inputs)
        return self.sample_step(chunks, inputs, logits)

    def read_kv(self, block_ids: list[int], window_ids: list[int] | None = None) -> Tensor:
        self._guard(self.tp.send, ReadKV(block_ids=block_ids, window_ids=window_ids))
        parts = self._guard(self.tp.group.all_gather, super().read_kv(block_ids, window_ids))
        return gather_heads(parts, self.model.config)

    def write_kv(self, block_ids: list[int], kv: Tensor, window_ids: list[int] | None = None
                 ) -> None:
        kv = kv.to(self.kv_spec.dtype).contiguous()
        self._guard(self.tp.send, WriteKV(block_ids=block_ids, shape=list(kv.shape),
                                          window_ids=window_ids))
        self._guard(self.tp.group.broadcast, kv)
        super().write_kv(block_ids, own_heads(kv, self._shard, self.model.config), window_ids)

    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The hand-off layout holds every KV head."""
        cfg = self.model.config
        parts = cfg.kv_parts()
        return (num_blocks, cfg.num_layers, len(parts), self.block_size, *parts[0])

    def apply_placement(self, phy2log: Tensor, share: Tensor | None, num_ep_ranks: int) -> None:
        self._guard(self.tp.send, Placement.of(phy2log, share, num_ep_ranks))
        super().apply_placement(phy2log, share, num_ep_ranks)


def gather_heads(parts: Tensor, cfg: ModelConfig) -> Tensor:
    """(N, blocks, layers, 2, bs, heads_per_rank, hd) from every rank -> the full-head layout
    (blocks, layers, 2, bs, num_kv_heads, hd); a replicated head is taken from its first rank."""
    world = parts.shape[0]
    if cfg.mla:  # the latent is whole on every rank
        return parts[0]
    if cfg.num_kv_heads >= world:
        return torch.cat(list(parts.unbind(0)), dim=-2)
    first = [h * world // cfg.num_kv_heads for h in range(cfg.num_kv_heads)]
    return torch.cat([parts[r] for r in first], dim=-2)


def own_heads(kv: Tensor, shard: TPShard, cfg: ModelConfig) -> Tensor:
    """This rank's heads of a full-head K/V payload (MLA's latent: all of it)."""
    if cfg.mla:
        return kv
    return kv.index_select(-2, torch.tensor(shard.kv_heads(cfg)))


def follower_main(config: EngineConfig, model_dir: str, dtype_name: str, group_name: str,
                  rank: int) -> None:
    """A follower rank's process: join, load the shard, execute commands until STOP."""
    torch.set_num_threads(threads_per_rank(config))
    world = config.tensor_parallel_size
    group = ShmGroup(group_name, rank, world, timeout_s=LOAD_TIMEOUT_S)
    try:
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        shard = TPShard(rank, world)
        model = load_weights(model_dir, dtype, config, shard)
        model.set_tensor_parallel(group)
        group.barrier()  # loaded (the leader's wait_loaded)
        group.timeout_s = STEP_TIMEOUT_S
        _serve(group, model, shard, dtype)
    except CollectiveError:
        pass  # the leader is gone or stopped answering: nothing left to serve
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        group.close()


def _serve(group: ShmGroup, model: CausalLM, shard: TPShard, dtype: torch.dtype) -> None:
    runner: ModelRunner | None = None
    while True:
        command = receive_command(group)
        if isinstance(command, Stop):
            return
        if isinstance(command, InitRunner):
            runner = ModelRunner(model, command.num_blocks, command.block_size,
                                 command.max_model_len, dtype,
                                 window_blocks=command.window_blocks)
            continue
        assert runner is not None, "a command before InitRunner"
        match command:
            case RunForward(chunks=chunks):
                runner.forward(chunks)
            case ReadKV(block_ids=block_ids, window_ids=window_ids):
                group.all_gather(runner.read_kv(block_ids, window_ids))
            case WriteKV(block_ids=block_ids, shape=shape, window_ids=window_ids):
                kv = group.broadcast(torch.empty(shape, dtype=runner.kv_spec.dtype))
                runner.write_kv(block_ids, own_heads(kv, shard, model.config), window_ids)
            case Placement(num_ep_ranks=num_ep_ranks):
                runner.apply_placement(*command.tensors(), num_ep_ranks)
            case _:
                raise RuntimeError(f"a tensor-parallel follower got {type(command).__name__}")
