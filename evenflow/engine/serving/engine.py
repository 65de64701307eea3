"""The engine core: one model, one KV cache, one scheduler. The step reads like its data flow:
schedule -> run the model -> append sampled tokens -> finish what is done -> publish KV events.

Token ids in, token ids out: tokenization and stop strings belong to the caller.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass, replace

import torch

from evenflow import models
from evenflow.engine.config.settings import EngineConfig, ModelConfig, switched_on
from evenflow.engine.core.block_manager import BlockManager, KVEventListener
from evenflow.engine.core.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from evenflow.engine.core.sequence import FinishReason, Sequence
from evenflow.engine.core.window_blocks import WindowBlockManager
from evenflow.engine.kernels import native
from evenflow.engine.model.kv_spec import KVCacheSpec, SlidingLayers, pool_sizes
from evenflow.engine.model.transformer import CausalLM
from evenflow.engine.runners.kv_tiers import KVTiers
from evenflow.engine.runners.model_runner import ModelRunner
from evenflow.engine.runners.protocol import Runner
from evenflow.engine.runners.tp import TPGroup, TPLeaderRunner, threads_per_rank
from evenflow.engine.sample.guided import Guides
from evenflow.engine.sample.sampler import sample
from evenflow.engine.serving.kernel_switch import KernelSwitch
from evenflow.engine.serving.placement_control import ExpertPlacement
from evenflow.engine.serving.prefix_transfer import PrefixCache
from evenflow.engine.serving.profiling import ProfileControl
from evenflow.engine.serving.speculation import SpecCounts, Speculation
from evenflow.engine.weights.expert_store import read_missing_experts
from evenflow.engine.weights.form import weight_form
from evenflow.engine.weights.loader import load_weights, model_directory, quant_config, torch_dtype
from evenflow.engine.weights.tp_shard import TPShard
from evenflow.parallel.group import ProcessGroup
from evenflow.proto.codec import lean_init
from evenflow.proto.hashing import namespace_salt
from evenflow.proto.kv_handoff import KVHandoffError, KVPayload
from evenflow.proto.sampling import SamplingParams, TokenLogprobs


@lean_init  # (built per sequence per step)
@dataclass(frozen=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    # export_kv requests: the finishing output says kv_follows, and the prompt's K/V comes in
    # the next step's output for the same request (so the first token is not held up by it),
    # in the hand-off layout (proto/kv_handoff.py).
    kv: KVPayload | None = None
    kv_follows: bool = False
    # (logprob, top ids, top logprobs) of new_token_ids[0], when the request asked for them
    logprobs: TokenLogprobs | None = None
    # with the first output token, when asked: every prompt token's after the first
    prompt_logprobs: list[TokenLogprobs] | None = None
    # with the last, under speculative decoding: the request's draft tokens and those accepted
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass(frozen=True)
class EngineLayout:
    """The engine's sizes, fixed at construction (services/engine_api.py EngineLayout)."""

    max_model_len: int
    block_size: int
    num_kv_blocks: int
    kv_block_shape: tuple[int, ...]  # one block, hand-off layout
    kv_dtype_name: str

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


class Engine:
    """The real engine; it implements services/engine_api.py's ServingEngine (what services may
    ask of it): the core here, and the parts it holds - `prefix` (the prefix cache and KV
    pulls), `placement` (expert placement), `profile` and `kernels`. The offline `LLM` and the
    benchmarks also use its tensor-level methods."""

    model: CausalLM
    runner: Runner
    idle_poll_s = 0.5  # how long its thread waits for work when idle
    speculates = True  # whether speculative_config applies (not to the mock engine)
    # with fatal_error set: the worker should restart at once, not as a crash (an elastic
    # expert-parallel group re-forming to take a rank back: engine/dep/lockstep.py)
    restart_planned = False

    def __init__(self, config: EngineConfig, kv_event_listener: KVEventListener | None = None,
                 collect_kv_events: bool = False, ep_group: ProcessGroup | None = None):
        """The engine, step by step: threads, weights, cache and scheduler, runner, then the
        parts it holds (engine/api/factory.py build_engine picks the kind)."""
        if config.expert_parallel_size > 1 and ep_group is None:
            raise ValueError("expert_parallel_size > 1 runs through LLM (engine/dep/offline.py)")
        self.config = config
        self._tp: TPGroup | None = None
        self.profile = ProfileControl(self)
        self.kernels = KernelSwitch(self)
        self._set_threads()
        self.model_dir = model_directory(config.model)
        dtype = self.dtype = torch_dtype(config)
        cfg = self.model_config = self._load(dtype)
        self.weight_form = weight_form(config, self.model_dir, dtype)
        if ep_group is not None:
            self._join_expert_parallel(ep_group, dtype)
        self.max_model_len = min(config.max_model_len or models.MAX_MODEL_LEN_CAP,
                                 cfg.max_position_embeddings)
        sliding = SlidingLayers.of(cfg, self.max_model_len) if switched_on(
            "EVENFLOW_WINDOW_POOL") else None
        num_blocks, window_blocks = self._num_kv_blocks(dtype, sliding)
        salt = namespace_salt(os.path.basename(str(self.model_dir)))
        self.blocks = BlockManager(num_blocks, config.block_size, salt,
                                   config.enable_prefix_caching)
        if sliding is not None:
            self.blocks.window_pool = WindowBlockManager(window_blocks, config.block_size,
                                                    sliding.window, salt,
                                                    config.enable_prefix_caching)
        spec = config.speculative if self.speculates else None
        self.speculation = Speculation.build(spec, config, self.model, dtype, num_blocks,
                                             self.max_model_len) if spec is not None else None
        self.scheduler = self._make_scheduler()
        self.runner = self._make_runner(num_blocks, dtype, window_blocks)
        if config.deterministic:
            self._make_deterministic(cfg)
        self.tiers = self._disk_tier(salt)
        self.placement = self._initial_placement()
        self.eos_token_ids = set(cfg.eos_token_ids)
        native.ops()  # built (first time on a machine: ~30 s) or loaded now, not in a request
        self.guides = self.runner.guides = Guides(self.model_dir, cfg.eos_token_ids,
                                                  cfg.vocab_size)
        self.kv_event_listener = kv_event_listener
        self.prefix = PrefixCache(self.blocks, self.runner, self.tiers, self.kv_dtype,
                                  collect_events=collect_kv_events)
        self.layout = EngineLayout(self.max_model_len, config.block_size, num_blocks,
                                   self.kv_block_shape, self.kv_dtype_name)
        self._requests: dict[str, Sequence] = {}
        self._aborted: list[StepOutput] = []
        self._exports: list[Sequence] = []  # finished export_kv requests, blocks still held

    # -- construction's steps -----------------------------------------------------------------
    def _set_threads(self) -> None:
        config = self.config
        self.num_threads = (threads_per_rank(config) if config.tensor_parallel_size > 1
                            else config.num_threads)
        if self.num_threads:
            torch.set_num_threads(self.num_threads)

    def _join_expert_parallel(self, ep_group: ProcessGroup, dtype: torch.dtype) -> None:
        """A DEP rank's MoE layers: their collectives, and only this rank's slots' experts (from
        the initial placement on)."""
        for layer in self.model.moe_layers():
            layer.ep = ep_group
        read_missing_experts(self.model, self.model_dir, dtype, quant_config(self.config))

    def _num_kv_blocks(self, dtype: torch.dtype, sliding: SlidingLayers | None
                       ) -> tuple[int, int]:
        """As configured, else as many as kv_cache_gb holds, at most what max_num_seqs full
        contexts need (sized on the whole model's KV heads: under TP every rank holds as many
        blocks); and the sliding layers' own pool's (model/kv_spec.py pool_sizes)."""
        config = self.config
        spec = KVCacheSpec.of(self.model_config, config.block_size, dtype,
                              config.kv_cache_dtype)
        return pool_sizes(spec, sliding, budget_bytes=int(config.kv_cache_gb * 2**30),
                          num_blocks=config.num_kv_blocks or 0,
                          wanted=-(-self.max_model_len // config.block_size) *
                          config.max_num_seqs, max_num_seqs=config.max_num_seqs,
                          max_num_batched_tokens=config.max_num_batched_tokens)

    def _make_scheduler(self) -> Scheduler:
        config = self.config
        max_seqs, max_tokens = config.max_num_seqs, config.max_num_batched_tokens
        if config.deterministic and not native.built_for_avx512():
            # AVX2 builds hand float32 linears of 64 rows and more to BLAS, whose reduction
            # order depends on the row count: a step stays below that
            max_seqs, max_tokens = min(max_seqs, 63), min(max_tokens, 63)
        return Scheduler(SchedulerConfig(max_seqs, max_tokens, self.max_model_len,
                                         config.defer_shared_prefill,
                                         max_loras=config.max_loras), self.blocks,
                         self.speculation.propose if self.speculation is not None else None)

    def _disk_tier(self, salt: bytes) -> KVTiers | None:
        """The KV disk tier (kv_disk_gb > 0): in kv_disk_dir, else a temporary directory."""
        config = self.config
        if config.kv_disk_gb <= 0:
            return None
        tier_dir = config.kv_disk_dir or _temporary_directory(self, "evenflow-kv-disk-")
        return KVTiers(self.model_runner(), self.blocks, tier_dir, config.kv_disk_gb,
                       self.model_dir, salt)

    def _initial_placement(self) -> ExpertPlacement:
        """Expert placement over num_ep_ranks (virtual) ranks: slot s holds expert s mod E at
        first; none without ranks, for a dense model or the mock."""
        config, cfg = self.config, self.model_config
        if not (config.num_ep_ranks and cfg.is_moe and isinstance(self.runner, ModelRunner)):
            return self._new_placement(0, 0)
        slots = cfg.num_experts + config.num_redundant_experts
        placement = self._new_placement(cfg.num_moe_layers, slots)
        for row, layer in enumerate(self.model.moe_layers()):
            layer.slot_counts = placement.slot_counts[row]
        initial = (torch.arange(slots) % cfg.num_experts).repeat(cfg.num_moe_layers, 1)
        placement.apply_placement(initial, None, version=0)
        return placement

    def _load(self, dtype: torch.dtype) -> ModelConfig:
        """Load the weights (this rank's shard, starting the other ranks, under tensor
        parallelism); return the model's config."""
        world = self.config.tensor_parallel_size
        if world > 1:
            self._tp = TPGroup(self.config, str(self.model_dir), dtype)
        try:
            self.model = load_weights(self.model_dir, dtype, self.config,
                                      TPShard(0, world) if world > 1 else None)
        except BaseException:
            self.close()
            raise
        if self._tp is not None:
            self._tp.wait_loaded()
            self.model.set_tensor_parallel(self._tp.group)
        return self.model.config

    def _new_placement(self, moe_layers: int, slots: int) -> ExpertPlacement:
        return ExpertPlacement(self, moe_layers, slots)

    def _make_runner(self, num_blocks: int, dtype: torch.dtype, window_blocks: int) -> Runner:
        if self._tp is not None:
            return TPLeaderRunner(self._tp, self.model, num_blocks, self.config.block_size,
                                  self.max_model_len, dtype, window_blocks)
        return ModelRunner(self.model, num_blocks, self.config.block_size, self.max_model_len,
                           dtype, self.config.kv_cache_dtype, window_blocks)

    def _make_deterministic(self, cfg: ModelConfig) -> None:
        """Deterministic mode needs every attention on the paged decode kernel (each row on its
        own; torch's gathered attention pads rows to the batch's longest context)."""
        runner = self.model_runner()
        serves = (runner.paged_attention_usable and native.decode_attention() is not None
                  and native.decode_attention_serves(cfg.head_dim)
                  and runner.kv_spec.kernels_serve())
        if not serves:
            raise ValueError("deterministic mode needs the native paged decode attention for "
                             "this model (plain grouped-query attention, head_dim a multiple of "
                             "16, native kernels built and switched on)")
        runner.deterministic = True
        native.hold_rows_invariant()

    @property
    def fatal_error(self) -> str | None:
        """Set when the engine can never step again (a tensor-parallel rank is gone)."""
        return self._tp.fatal_error if self._tp is not None else None

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (also done when the engine is collected)."""
        if hasattr(self, "guides"):  # (not yet when loading failed)
            self.guides.close()
        if self._tp is not None:
            self._tp.close()
        tiers = getattr(self, "tiers", None)  # (not yet when loading failed)
        if tiers is not None:
            tiers.close()
        runner = getattr(self, "runner", None)  # (not yet when loading failed)
        if getattr(runner, "deterministic", False) and not getattr(self, "_closed", False):
            native.release_rows_invariant()  # (the AMX tiles come back with the last one)
        self._closed = True

    def configure_current_thread(self) -> None:
        """Apply the thread setting to the calling thread: OpenMP's thread count is per thread,
        so an engine stepped from a thread other than its creator's must call this there."""
        if self.num_threads:
            torch.set_num_threads(self.num_threads)

    def model_runner(self) -> ModelRunner:
        """The runner as the model's own (what a mock's lacks: its cache spec, placements)."""
        assert isinstance(self.runner, ModelRunner), "the mock engine runs no model"
        return self.runner

    @property
    def tensor_parallel(self) -> bool:
        return self._tp is not None

    # -- requests ---------------------------------------------------------------------------
    def _load_adapter(self, params: SamplingParams) -> None:
        """A LoRA request's adapter, loaded on first use (model/lora.py); raises ValueError."""
        if not params.lora_name:
            return
        if not params.lora_path and (self.model.adapters is None
                                     or params.lora_name not in self.model.adapters.loaded):
            raise ValueError(f"LoRA adapter {params.lora_name!r} is not loaded here and the "
                             "request names no path to load it from")
        if self.tensor_parallel or self.config.expert_parallel_size > 1:
            raise ValueError("LoRA adapters are not served with tensor or expert parallelism")
        from evenflow.engine.model.lora import AdapterError, Adapters

        if self.model.adapters is None:
            self.model.adapters = Adapters(self.model, self.model_config, self.dtype)
        try:
            self.model.adapters.get(params.lora_name, params.lora_path)
        except AdapterError as exc:
            raise ValueError(str(exc)) from None

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, export_kv: bool = False) -> None:
        """Queue a request; raises ValueError naming the problem if it cannot be served.
        With export_kv, its finishing StepOutput says kv_follows, and the next step() returns
        the prompt's K/V (see read_kv) for it, before any new forward pass."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; the context holds "
                             f"{self.max_model_len}, leaving no room to generate")
        if self.blocks.blocks_needed(len(prompt_token_ids) + 1) > self.blocks.num_blocks:
            raise ValueError(f"the prompt needs more KV blocks than the cache has "
                             f"({self.blocks.num_blocks} of {self.config.block_size} tokens)")
        self._load_adapter(params)
        seq = Sequence(request_id, list(prompt_token_ids), len(prompt_token_ids),
                       params, export_kv=export_kv)
        self.guides.start(seq)
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int],
                              first_token_id: int, params: SamplingParams,
                              kv: KVPayload, num_cached_tokens: int = 0) -> None:
        """Continue a request another engine prefilled: its prompt's K/V (as exported by
        add_request(export_kv=True)) and the first token it sampled. Decoding starts at the next
        step that has room; raises ValueError if the K/V does not fit this engine's layout."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids or len(prompt_token_ids) + 1 >= self.max_model_len:
            raise ValueError("the prefilled prompt is empty or fills the context")
        if not 0 <= first_token_id < self.model_config.vocab_size:
            raise ValueError(f"first token id {first_token_id} is outside the vocabulary")
        self._load_adapter(params)
        expected = self.runner.kv_shape(self.blocks.blocks_needed(len(prompt_token_ids)))
        if kv.shape != expected or kv.dtype != self.kv_dtype_name:
            raise KVHandoffError(f"K/V {kv.dtype} {kv.shape} does not match this engine's "
                                 f"{self.kv_dtype_name} {expected}")
        if self.blocks.blocks_needed(len(prompt_token_ids) + 1) > self.blocks.num_blocks:
            raise ValueError("the prompt needs more KV blocks than the cache has")
        tensor = torch.frombuffer(kv.data, dtype=torch.uint8) if len(kv.data) else torch.empty(
            0, dtype=torch.uint8)
        seq = Sequence(request_id, [*prompt_token_ids, first_token_id], len(prompt_token_ids),
                       params,
                       pending_kv=tensor.view(self.kv_dtype).view(expected),
                       num_cached_tokens=num_cached_tokens)
        seq.skip_draws(1, self.model_config.vocab_size)
        if self.speculation is not None:
            self.speculation.take_handed_hidden(seq, kv)
        self.guides.start(seq)
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.model_runner().kv_spec.dtype  # type: ignore[no-any-return]

    @property
    def kv_dtype_name(self) -> str:
        return str(self.kv_dtype).removeprefix("torch.")

    @property
    def kv_block_shape(self) -> tuple[int, ...]:
        """One block's shape in the hand-off layout (proto/kv_handoff.py)."""
        return tuple(self.runner.kv_shape(1)[1:])

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def num_kv_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_free_kv_blocks(self) -> int:
        return self.blocks.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return self.blocks.blocks_needed(num_tokens)

    def abort(self, request_id: str) -> bool:
        """Stop a request at the next step boundary; False if it is unknown or done."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT)
        self._aborted.append(self._output(seq, []))
        return True

    def abort_all(self) -> list[str]:
        """Drop every request (after a failed step, whose state cannot be trusted); their ids.
        Their blocks are freed; no output is produced for them."""
        ids = list(self._requests)
        for request_id in ids:
            self.scheduler.finish(self._requests.pop(request_id), FinishReason.ABORT)
        for seq in self._exports:
            self.blocks.free_sequence(seq)
            ids.append(seq.request_id)
        self._exports, self._aborted = [], []
        return ids

    def has_unfinished(self) -> bool:
        """Whether this engine holds work (a read: no side effects)."""
        return bool(self._requests or self._aborted or self._exports)

    def decide_step(self) -> bool:
        """Whether to step now; the engine thread asks once per loop (an expert-parallel
        rank agrees on it with its group: engine/dep/lockstep.py)."""
        return self.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def spec_counts(self) -> SpecCounts | None:
        return self.speculation.counts if self.speculation is not None else None

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def take_expert_counts(self) -> torch.Tensor:
        """Tokens routed to each (MoE layer, expert) since the last call: (moe_layers, experts)."""
        counts = self.runner.expert_counts.clone()
        self.runner.expert_counts.zero_()
        return counts

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        if self._exports:  # last step's finished export_kv requests: their K/V, and no forward
            return self._export_kv()
        outputs, self._aborted = self._aborted, []
        started = time.perf_counter()  # (a decode step's cost includes drafting it)
        chunks = self.scheduler.schedule()
        if self.tiers is not None:
            self.tiers.after_schedule()
        for chunk in chunks:
            seq = chunk.seq
            if seq.pending_kv is not None:  # admitted with imported K/V: write it in
                prompt_blocks = self.blocks.blocks_needed(seq.num_prompt_tokens)
                self.runner.write_kv(seq.block_table[:prompt_blocks], seq.pending_kv,
                                     seq.window_table[:prompt_blocks] or None)
                seq.pending_kv = None
        if chunks:
            starts = [c.seq.num_computed_tokens for c in chunks]
            sampled = iter(self.runner.run(chunks))
            for chunk in chunks:
                seq, samples = chunk.seq, chunk.samples
                if chunk.draft:
                    outputs += self._verify(chunk, next(sampled))  # type: ignore[arg-type]
                    continue
                seq.num_computed_tokens += chunk.num_tokens
                self.blocks.commit_full_blocks(seq)
                if not samples:
                    continue
                token = next(sampled)
                assert isinstance(token, int)
                seq.token_ids.append(token)
                reason = self._finish_reason(seq, token)
                if reason is not None:
                    self._finish(seq, reason)
                outputs.append(self._output(seq, [token],
                                            kv_follows=reason is not None and seq.export_kv))
                if reason is not None and self.speculation is not None:
                    outputs[-1] = self._with_draft_counts(outputs[-1], seq)
            if self.speculation is not None and self.speculation.wants_hidden:
                self.speculation.hand_hidden(chunks, starts, self.model_runner().chunk_hidden)
            if self.speculation is not None and all(
                    c.draft or c.num_tokens == 1 for c in chunks):  # a decode step: its cost,
                self.speculation.observe_step(  # its drafts' verification included
                    sum(c.num_tokens for c in chunks), len(chunks), time.perf_counter() - started)
        events = self.blocks.take_events()
        if events and self.kv_event_listener is not None:
            self.kv_event_listener(events)
        elif events:
            self.prefix.keep_events(events)
        return outputs

    def step_in_lockstep(self) -> list[StepOutput]:
        """A step that runs exactly one forward pass, a dummy one when this engine has nothing
        to run: expert-parallel ranks' MoE collectives must meet every step. (Engine's own
        has_unfinished/step, whatever a subclass makes of them.)"""
        runner = self.model_runner()
        before = runner.forward_calls
        outputs = Engine.step(self) if Engine.has_unfinished(self) else []
        if runner.forward_calls == before:
            runner.forward_dummy()
        return outputs

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        # An export keeps its blocks until the next step has read them out.
        self.scheduler.finish(seq, reason, free_blocks=not seq.export_kv)
        if self.speculation is not None:
            self.speculation.finished(seq)
        if seq.export_kv:
            self._exports.append(seq)
        del self._requests[seq.request_id]

    def _verify(self, chunk: ScheduledChunk, rows: torch.Tensor) -> list[StepOutput]:
        """A draft's step: the tokens it takes (engine/serving/speculation.py), one output
        each (each its own logprobs), the sequence finished at the first that ends it."""
        seq, eos = chunk.seq, frozenset(self.eos_token_ids)
        reason: FinishReason | None = None

        def stops(token: int) -> bool:
            nonlocal reason
            reason = self._finish_reason(seq, token)
            return reason is not None

        assert self.speculation is not None
        taken = self.speculation.verify(
            seq, rows, chunk.draft, lambda row: sample(row, [seq], eos, self.guides)[0], stops)
        self.blocks.commit_full_blocks(seq)
        if reason is not None:
            self._finish(seq, reason)
        outputs = [StepOutput(seq.request_id, [token], False, None, seq.num_prompt_tokens,
                              seq.num_cached_tokens, None, False, logprobs, None)
                   for token, logprobs in taken]
        outputs[-1] = replace(outputs[-1], finished=seq.is_finished,
                              finish_reason=seq.finish_reason,
                              kv_follows=reason is not None and seq.export_kv)
        if seq.is_finished:
            outputs[-1] = self._with_draft_counts(outputs[-1], seq)
        return outputs

    @staticmethod
    def _with_draft_counts(output: StepOutput, seq: Sequence) -> StepOutput:
        drafted, accepted = Speculation.request_counts(seq)
        return replace(output, draft_tokens=drafted, accepted_draft_tokens=accepted) \
            if drafted else output

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if Guides.complete(seq):
            return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _export_kv(self) -> list[StepOutput]:
        outputs = []
        for seq in self._exports:
            prompt_blocks = self.blocks.blocks_needed(seq.num_prompt_tokens)
            kv = self.runner.read_kv(seq.block_table[:prompt_blocks],
                                     seq.window_table[:prompt_blocks] or None).contiguous()
            self.blocks.free_sequence(seq)
            raw, _ = _raw(kv)  # a view, no copy
            hidden = self.speculation.export_hidden(seq) if self.speculation is not None \
                else None
            outputs.append(self._output(seq, [], KVPayload(
                raw, self.kv_dtype_name, prompt_blocks, tuple(kv.shape[1:]),
                *(_raw(hidden) if hidden is not None else ()))))
        self._exports = []
        return outputs

    @staticmethod
    def _output(seq: Sequence, new: list[int], kv: KVPayload | None = None,
                kv_follows: bool = False) -> StepOutput:
        return StepOutput(seq.request_id, new, seq.is_finished, seq.finish_reason,
                          seq.num_prompt_tokens, seq.num_cached_tokens, kv, kv_follows,
                          seq.step_logprobs if new else None,
                          seq.prompt_logprobs if new and seq.params.prompt_logprobs is not None
                          and seq.num_output_tokens == 1 else None)


def _raw(t: torch.Tensor) -> tuple[memoryview, str]:
    """A tensor's bytes (a view of a contiguous one) and its dtype's name."""
    return (memoryview(t.contiguous().view(torch.uint8).numpy().reshape(-1).data),
            str(t.dtype).removeprefix("torch."))


def _temporary_directory(owner: object, prefix: str) -> str:
    """A directory removed when `owner` is collected or the process exits."""
    path = tempfile.mkdtemp(prefix=prefix)
    weakref.finalize(owner, shutil.rmtree, path, True)
    return path
