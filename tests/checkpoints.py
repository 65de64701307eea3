"""Tiny random HF checkpoints for tests: each supported architecture, saved with transformers'
save_pretrained (fixed seed) plus a word-level tokenizer, so tests need no download."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 256

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=1,
               bos_token_id=0, tie_word_embeddings=False)

_DEEPSEEK = dict(n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
                 topk_group=2, first_k_dense_replace=1, moe_intermediate_size=32,
                 intermediate_size=96, kv_lora_rank=32, qk_rope_head_dim=16,
                 qk_nope_head_dim=16, v_head_dim=24, routed_scaling_factor=2.5,
                 num_key_value_heads=4)  # (transformers needs KV heads = heads for MLA)

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=128)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=128, head_dim=16)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=128, moe_intermediate_size=48, num_experts=4,
                       num_experts_per_tok=2, shared_expert_intermediate_size=96,
                       decoder_sparse_step=1, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=128, moe_intermediate_size=48, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, head_dim=16)),
    # Llama 3.1's rope scaling, with an original context short enough that the scaling changes
    # most frequencies here
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        intermediate_size=128, rope_parameters=dict(
            rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=64))),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=128)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(intermediate_size=128, head_dim=24)),
    # sliding windows run windowed (no longer capping the context): Mistral's on every layer,
    # Qwen2's from max_window_layers on
    "mistral_window": ("MistralConfig", "MistralForCausalLM",
                       dict(intermediate_size=128, sliding_window=16)),
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        intermediate_size=128, use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=48, num_experts=8, num_experts_per_tok=2, clip_qkv=8.0)),
    # YaRN (Qwen3's long-context setting): scaled frequencies and the attention scale
    "qwen3_yarn": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        intermediate_size=128, head_dim=16, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0,
            original_max_position_embeddings=64))),
    # DeepSeek-V3: MLA with q_lora, 1 dense layer then DeepSeekMoE (8 routed experts in 4
    # groups, 2 chosen from the best 2 groups, 1 shared expert, sigmoid scores)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(_DEEPSEEK, q_lora_rank=48)),
    # ... without q_lora, with YaRN (its mscale in the softmax scale and on cos / sin)
    "deepseek_v3_yarn": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        _DEEPSEEK, q_lora_rank=None, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
            mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1))),
    # DeepSeek-V2: softmax routing, group_limited_greedy, no q_lora
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        _DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy",
        routed_scaling_factor=1.5)),
    # GPT-OSS: sinks, a sliding layer (window 8) then a full one, biases, clamped SwiGLU
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, head_dim=16,
        sliding_window=8, rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
            truncate=False, original_max_position_embeddings=4096))),
    # GLM-4.5 (Glm4Moe): no layer of its own, the parts above mapped from its config:
    # DeepSeek-V3's routing and shared experts under GQA with partial rotary, biases, q/k norm
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        moe_intermediate_size=32, intermediate_size=96, use_qk_norm=True,
        first_k_dense_replace=1, attention_bias=True, routed_scaling_factor=1.5)),
    # dots.llm1 (Dots1): Qwen3's attention (q/k norm) over DeepSeek-V3's MoE, by mapping
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(
        head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
        topk_group=2, moe_intermediate_size=32, intermediate_size=96, first_k_dense_replace=1,
        norm_topk_prob=True, routed_scaling_factor=2.0)),
    # Solar Open: Llama's attention over GLM-4.5's MoE in every layer, by mapping
    "solar_open": ("SolarOpenConfig", "SolarOpenForCausalLM", dict(
        head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
        topk_group=2, moe_intermediate_size=32, routed_scaling_factor=1.5)),
    # Granite-MoE: Mixtral's layout with its attention, embedding, residual and logits
    # multipliers (folded into the weights at load), top-k-softmax routing; tied embeddings
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.03,
        logits_scaling=6.0, tie_word_embeddings=True)),
    # Granite-MoE-Shared: Granite-MoE plus an ungated shared MLP (its [gate | up] split at load)
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=48, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.03, logits_scaling=6.0)),
    # FlexOlmo: OLMoE's attention and routing under OLMo 2's post-norms
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", dict(
        intermediate_size=48, num_experts=4, num_experts_per_tok=2, pad_token_id=None)),
    # DBRX: its own names and keys, bias-free LayerNorms, a fused q | k | v clamped to
    # clip_qkv, softmax routing renormalized (p = 1), experts stacked by rows
    "dbrx": ("DbrxConfig", "DbrxForCausalLM", dict(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=1024,
        attn_config=dict(kv_n_heads=2, clip_qkv=0.3, rope_theta=10000.0),
        ffn_config=dict(ffn_hidden_size=48, moe_num_experts=4, moe_top_k=2))),
    # Ernie 4.5 MoE: interleaved rotary (folded into q and k at load), a dense first layer,
    # softmax scores with a correction bias for the choice, an ungated shared expert; weights
    # large enough (initializer_range) that the rotary's pairing changes the tokens
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
        intermediate_size=96, moe_intermediate_size=32, moe_k=2, moe_num_experts=8,
        moe_num_shared_experts=1, moe_layer_start_index=1, num_hidden_layers=3,
        pad_token_id=None, initializer_range=0.1)),
    # HunYuan-MoE (v1): q/k norms after rotary, an ungated shared MLP, NTK-alpha rotary
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(
        intermediate_size=48, num_experts=4, moe_topk=2, head_dim=16, pad_token_id=None,
        initializer_range=0.1, rope_parameters=dict(
            rope_type="dynamic", alpha=1000.0, factor=1.0, rope_theta=10000.0))),
    # MiniMax-M2: whole-projection q/k norms, partial rotary, sigmoid scores with a
    # correction bias for the choice
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        intermediate_size=48, num_local_experts=8, num_experts_per_tok=2, head_dim=16,
        initializer_range=0.1, rope_parameters=dict(
            rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
    # GLM-4.7-Flash (Glm4MoeLite): DeepSeek-V3's MLA over GLM-4.5's MoE, by mapping
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        _DEEPSEEK, q_lora_rank=48, mlp_layer_types=["dense", "sparse"])),
}

# Parameters that initialize to constants (zeros, ones) and get random noise of this std in
# these families' checkpoints, so that what they change is compared too: a score-correction
# bias shifts the expert choice, q/k norm weights tell a norm after rotary from one before.
RANDOMIZED = {
    "ernie4_5_moe": {"e_score_correction_bias": 0.05},
    "hunyuan_v1_moe": {"query_layernorm.weight": 0.5, "key_layernorm.weight": 0.5},
    "minimax_m2": {"e_score_correction_bias": 0.05},
}


def write_word_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    """Token i is the word `w{i}`; 0 = <s>, 1 = </s>."""
    from evenflow.bench.checkpoint import write_word_tokenizer as write

    write(path, vocab_size, bos_id=0, eos_id=1)


def make_checkpoint(arch: str, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                    overrides: dict | None = None):
    """Save a random `arch` model to `path` (`overrides`: config fields to change); returns
    the transformers model (the oracle)."""
    import transformers

    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(**(_COMMON | extra | (overrides or {})))
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(dtype).eval()
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            for suffix, std in RANDOMIZED.get(arch, {}).items():
                if name.endswith(suffix):
                    t.add_(torch.randn(t.shape) * std)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_word_tokenizer(path)
    return model


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt`: the oracle's tokens."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run_with_arrivals(engine, prompts: list[list[int]], params, arrivals: list[int]
                      ) -> list[list[int]]:
    """Prompt i joins the engine once it has run arrivals[i] steps (non-decreasing), so later
    prompts arrive while earlier ones prefill in chunks or decode; then it steps until all
    finish. -> each prompt's generated tokens."""
    produced: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    steps = 0
    for i, prompt in enumerate(prompts):
        while steps < arrivals[i]:
            for out in engine.step():
                produced[out.request_id].extend(out.new_token_ids)
            steps += 1
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            produced[out.request_id].extend(out.new_token_ids)
    return [produced[str(i)] for i in range(len(prompts))]


def run_all(engine) -> tuple[dict[str, list[int]], dict]:
    """Step an engine until its requests finish: (tokens by request, K/V by request for those
    that handed theirs off)."""
    tokens: dict[str, list[int]] = {}
    kvs = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.kv is not None:
                kvs[out.request_id] = out.kv
    return tokens, kvs


def prefill_then_decode(config, prompts: dict[str, list[int]], params,
                        neighbour: list[int] | None = None
                        ) -> tuple[dict[str, list[int]], dict[str, list[int]], dict]:
    """The same prompts on one engine, and prefilled on one then continued on another (their
    K/V handed over; `neighbour`: a prompt the second engine is already decoding): (one
    engine's tokens, the two engines' tokens, the handed-over K/V) by request."""
    from evenflow import SamplingParams
    from evenflow.engine.serving.engine import Engine

    single = Engine(config)
    for rid, p in prompts.items():
        single.add_request(rid, p, params)
    expected, _ = run_all(single)
    prefill, decode = Engine(config), Engine(config)
    first_only = SamplingParams(**{**params.__dict__, "max_tokens": 1})
    for rid, p in prompts.items():
        prefill.add_request(rid, p, first_only, export_kv=True)
    firsts, kvs = run_all(prefill)
    if neighbour is not None:
        decode.add_request("neighbour", neighbour, params)
        decode.step()
    for rid, p in prompts.items():
        decode.add_prefilled_request(rid, p, firsts[rid][0], params, kvs[rid])
    rest, _ = run_all(decode)
    return expected, {rid: firsts[rid] + rest.get(rid, []) for rid in prompts}, kvs


def run_to_end(engine) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Step an engine until its requests finish: (tokens by request, cached prompt tokens by
    request)."""
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
    return tokens, cached


def generate_one(engine, request_id: str, prompt: list[int], params) -> tuple[list[int], int]:
    """One request run to its end on an otherwise idle engine: (its tokens, its cached prompt
    tokens)."""
    engine.add_request(request_id, prompt, params)
    tokens, cached = run_to_end(engine)
    return tokens.get(request_id, []), cached.get(request_id, 0)


def assert_counts_and_reverses(llm) -> None:
    """tiny-moe's tasks, greedy: counting up, counting down, reversing (what its README says)."""
    from evenflow import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=8)
    up, down, rev = llm.generate(
        ["count from 17 :", "count down from 90 :", "reverse : q w e r ="], greedy)
    assert up.text.split()[:6] == ["17", "18", "19", "20", "21", "22"]
    assert down.text.split()[:6] == ["90", "89", "88", "87", "86", "85"]
    assert rev.text.split()[:4] == ["r", "e", "w", "q"]


def add_next_token_layer(path: Path, hf, seed: int = 1) -> dict[str, torch.Tensor]:
    """Write DeepSeek-V3's next-token (MTP) layer beside `hf`'s checkpoint, as DeepSeek ships
    it: `model.layers.<num_hidden_layers>.` holding a decoder layer (the last one's weights
    with noise; experts one by one), enorm, hnorm, eh_proj, shared_head.norm and copies of the
    embedding and lm_head, in a file of its own. Returns the layer's tensors as transformers
    holds them in memory (stacked experts), by their names after the prefix."""
    from safetensors.torch import save_file

    cfg = hf.config
    last, stored = cfg.num_hidden_layers - 1, cfg.num_hidden_layers
    g = torch.Generator().manual_seed(seed)
    layer = {name.removeprefix(f"model.layers.{last}."): t.detach().clone()
             for name, t in hf.state_dict().items() if name.startswith(f"model.layers.{last}.")}
    for name, t in layer.items():
        if t.dim() >= 2:
            layer[name] = t + 0.02 * torch.randn(t.shape, generator=g, dtype=t.dtype)
    hidden = cfg.hidden_size
    layer |= {
        "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "eh_proj.weight": 0.05 * torch.randn(hidden, 2 * hidden, generator=g),
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "shared_head.head.weight": hf.lm_head.weight.detach().clone(),
        "embed_tokens.weight": hf.model.embed_tokens.weight.detach().clone(),
    }
    layer = {k: v.to(hf.dtype).contiguous() for k, v in layer.items()}
    shipped = {}
    for name, t in layer.items():
        if name == "mlp.experts.gate_up_proj":  # (E, 2I, H): gate rows, then up rows
            for e, w in enumerate(t):
                gate, up = w.chunk(2)
                shipped[f"mlp.experts.{e}.gate_proj.weight"] = gate.contiguous()
                shipped[f"mlp.experts.{e}.up_proj.weight"] = up.contiguous()
        elif name == "mlp.experts.down_proj":
            for e, w in enumerate(t):
                shipped[f"mlp.experts.{e}.down_proj.weight"] = w.contiguous()
        else:
            shipped[name] = t
    save_file({f"model.layers.{stored}.{k}": v for k, v in shipped.items()},
              str(path / "model-next-token.safetensors"))
    return layer


def write_peft_adapter(hf, path: Path, seed: int, targets: list[str], parameters: list[str],
                       rank: int = 4, gain: float = 3.0) -> None:
    """A LoRA adapter written by PEFT itself onto `hf` (target_modules `targets`,
    target_parameters `parameters` for fused experts), its random factors times `gain`: large
    enough to change greedy tokens."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=4 * rank, target_modules=targets,
                                         target_parameters=parameters or None,
                                         init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.mul_(gain)
    peft.save_pretrained(path)
