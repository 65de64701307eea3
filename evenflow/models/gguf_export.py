"""A Hugging Face checkpoint written as a GGUF file, as llama.cpp's converter writes it, with the
gguf package: for `bench engine --llamacpp` / `bench quant --llamacpp` (llama.cpp runs the same
weights) and for the GGUF loading tests (models/gguf_import.py reads it back). Torch-free.

Served: Llama-style dense and Mixtral-style MoE checkpoints (llama.cpp's `llama` architecture;
Q and K rows in its interleaved rotary layout), Qwen2 (with its q/k/v biases), Qwen3 (with its
q/k norms), Qwen3-MoE (`qwen2`, `qwen3`, `qwen3moe`), DeepSeek-V2 and -V3 (`deepseek2`: MLA's
kv_b_proj split into attn_k_b, stored transposed per head, and attn_v_b, as current llama.cpp
writes them; head_count_kv 1 with the latent's key and value lengths, the per-head ones as
key_length_mla / value_length_mla; the expert gating always stated) and GPT-OSS (`gpt-oss`:
sinks, biases, experts de-interleaved into gate / up / down stacks; experts a checkpoint ships
in MXFP4 stay MXFP4 whatever the type, repacked into GGML's blocks). Tensor types: bf16, f16,
f32, q8_0, q4_0, the K-quants q4_k, q5_k and q6_k (models/gguf_kquants.py), and llama-quantize's
mixes q4_k_m and q5_k_m for the weight matrices (experts stacked per layer), and mxfp4_moe
(llama-quantize's MXFP4_MOE: expert stacks MXFP4, the other matrices q8_0); float32 for norms,
biases and the router. As llama-quantize does, a matrix whose rows are not whole blocks falls
back (K-quants need rows of 256: q4_k to q4_0, q5_k and q6_k to q8_0; then float32). The
tokenizer goes in twice: as llama.cpp's `gpt2` vocabulary (its tokens, merges for a BPE model)
and whole as `tokenizer.huggingface.json`; the chat template as `tokenizer.chat_template`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from evenflow.models import gguf_blocks, gguf_kquants

TYPES = ("bf16", "f16", "f32", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q4_k_m", "q5_k_m",
         "mxfp4_moe")
_FALLBACK = {"q4_k": "q4_0", "q5_k": "q8_0", "q6_k": "q8_0", "q8_0": "f32", "q4_0": "f32",
             "mxfp4": "q8_0"}
# model_type -> llama.cpp's architecture (Q and K reordered for its rotary only for `llama`)
FAMILIES = {"llama": "llama", "mixtral": "llama", "mistral": "llama", "qwen2": "qwen2",
            "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "deepseek_v2": "deepseek2",
            "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss"}
MXFP4_TYPE = 39  # GGMLQuantizationType.MXFP4


class Packed(NamedTuple):
    """A tensor already in a GGUF block type: raw bytes (..., rows, bytes a row)."""

    data: np.ndarray
    qtype: int


def read_safetensors(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the directory's safetensors files as float32 (bf16 widened exactly);
    uint8 ones (MXFP4 blocks and scales) as stored."""
    tensors: dict[str, np.ndarray] = {}
    kinds = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U8": np.uint8}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        raw = file.read_bytes()
        (size,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + size])
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            data = np.frombuffer(raw, dtype=kinds[info["dtype"]], count=(end - start) // (
                np.dtype(kinds[info["dtype"]]).itemsize), offset=8 + size + start)
            if info["dtype"] == "BF16":
                data = (data.astype(np.uint32) << 16).view(np.float32)
            if info["dtype"] != "U8":
                data = data.astype(np.float32)
            tensors[name] = data.reshape(info["shape"])
    return tensors


# general.file_type (llama.cpp's LLAMA_FTYPE): what tools show as the file's type
_FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "q4_k": 15, "q5_k": 17, "q6_k": 18,
               "q4_k_m": 15, "q5_k_m": 17, "bf16": 32, "mxfp4_moe": 38}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's Q/K rows (rotary halves) in llama.cpp's order (pairs interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def export_gguf(model_dir: Path, out: Path, kind: str = "bf16") -> Path:
    """Write `model_dir`'s checkpoint to `out` (.gguf) with its weight matrices in `kind`."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    if kind not in TYPES:
        raise ValueError(f"GGUF type must be one of {TYPES}, got {kind!r}")
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("model_type") not in FAMILIES:
        raise ValueError(f"GGUF export serves {', '.join(FAMILIES)} checkpoints, not "
                         f"{cfg.get('model_type')!r}")
    arch = FAMILIES[cfg["model_type"]]
    weights = read_safetensors(model_dir)
    writer = GGUFWriter(str(out), arch)
    writer.add_name(model_dir.name)
    writer.add_file_type(_FILE_TYPES.get(kind, 0))
    _add_hparams(writer, arch, cfg)
    _add_tokenizer(writer, model_dir, cfg)
    layers = int(cfg["num_hidden_layers"])

    def add(name: str, value: np.ndarray | Packed, matrix: bool = True) -> None:
        if isinstance(value, Packed):
            writer.add_tensor(name, value.data, raw_shape=value.data.shape,
                              raw_dtype=GGMLQuantizationType(value.qtype))
            return
        chosen = gguf_kquants.mix_type(kind, name, layers) if kind.endswith("_m") else kind
        if chosen == "mxfp4_moe":  # (llama-quantize's MXFP4_MOE)
            chosen = "mxfp4" if name.endswith("_exps.weight") else "q8_0"
        while chosen in _FALLBACK and value.shape[-1] % (
                gguf_blocks.QK_K if chosen.endswith("_k") else 32):
            chosen = _FALLBACK[chosen]  # rows not in whole blocks, as llama-quantize does
        if not matrix or chosen == "f32":
            writer.add_tensor(name, value.astype(np.float32))
        elif chosen == "f16":
            writer.add_tensor(name, value.astype(np.float16))
        elif chosen.endswith("_k"):
            qtype = GGMLQuantizationType[chosen.upper()]
            rows = value.reshape(-1, value.shape[-1])
            data = gguf_kquants.encode(int(qtype), rows).reshape(*value.shape[:-1], -1)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            qtype = GGMLQuantizationType[chosen.upper()]
            data = quantize(value.astype(np.float32), qtype)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    add("token_embd.weight", weights["model.embed_tokens.weight"])
    add("output_norm.weight", weights["model.norm.weight"], matrix=False)
    if not cfg.get("tie_word_embeddings") and "lm_head.weight" in weights:
        add("output.weight", weights["lm_head.weight"])
    for i in range(layers):
        for name, value, matrix in _layer_tensors(arch, cfg, weights, i):
            add(f"blk.{i}.{name}", value, matrix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _experts(cfg: dict[str, Any]) -> int:
    return int(cfg.get("num_local_experts") or cfg.get("num_experts")
               or cfg.get("n_routed_experts") or 0)


def _add_hparams(writer: Any, arch: str, cfg: dict[str, Any]) -> None:
    """The architecture's keys, as llama.cpp's converter states them."""
    from gguf import ExpertGatingFuncType, RopeScalingType

    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    experts = _experts(cfg)
    writer.add_context_length(int(cfg.get("max_position_embeddings", 4096)))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0))
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-5)))
    writer.add_vocab_size(cfg["vocab_size"])
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    if cfg.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type == "linear" and rope.get("factor"):
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope_type == "yarn" and rope.get("factor"):
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        for key, add in (("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(float(rope[key]))
    if arch == "gpt-oss":
        writer.add_head_count_kv(kv_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(int(cfg["sliding_window"]))
        writer.add_expert_feed_forward_length(int(cfg["intermediate_size"]))
        return
    if arch != "deepseek2":
        writer.add_head_count_kv(kv_heads)
        writer.add_rope_dimension_count(head_dim)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        return
    # DeepSeek: MLA as MQA over the latent (llama.cpp's absorbed form), DeepSeekMoE
    v3 = cfg["model_type"] == "deepseek_v3"
    rank, rope_dims = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    writer.add_head_count_kv(1)
    writer.add_leading_dense_block_count(int(cfg.get("first_k_dense_replace") or 0))
    if cfg.get("q_lora_rank"):
        writer.add_q_lora_rank(int(cfg["q_lora_rank"]))
    writer.add_kv_lora_rank(rank)
    writer.add_key_length(rank + rope_dims)
    writer.add_value_length(rank)
    writer.add_key_length_mla(int(cfg["qk_nope_head_dim"]) + rope_dims)
    writer.add_value_length_mla(int(cfg["v_head_dim"]))
    writer.add_rope_dimension_count(rope_dims)
    writer.add_expert_shared_count(int(cfg.get("n_shared_experts") or 0))
    writer.add_expert_weights_scale(float(cfg.get("routed_scaling_factor") or 1.0))
    if v3 and cfg.get("norm_topk_prob", True):  # (V2 never renormalizes: engine/config)
        writer.add_expert_weights_norm(True)
    # (always stated: llama.cpp takes a file without it for softmax)
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if v3 else
                                  ExpertGatingFuncType.SOFTMAX)
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if method != "greedy" and cfg.get("n_group"):
        writer.add_expert_group_count(int(cfg["n_group"]))
        writer.add_expert_group_used_count(int(cfg["topk_group"]))
    if rope_type == "yarn" and rope.get("mscale_all_dim"):
        # (llama.cpp's converter stores 0.1 * mscale_all_dim here, "for legacy reasons")
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))


LayerTensor = tuple[str, "np.ndarray | Packed", bool]  # (name in the block, value, is a matrix)


def _layer_tensors(arch: str, cfg: dict[str, Any], weights: dict[str, np.ndarray],
                   i: int) -> list[LayerTensor]:
    """Layer i's tensors, named as llama.cpp names them less the `blk.{i}.` prefix."""
    p = f"model.layers.{i}."
    out: list[LayerTensor] = [("attn_norm.weight", weights[p + "input_layernorm.weight"], False),
                         ("post_attention_norm.weight" if arch == "gpt-oss" else
                          "ffn_norm.weight", weights[p + "post_attention_layernorm.weight"],
                          False)]
    out += _mla_tensors(cfg, weights, p) if arch == "deepseek2" else \
        _attention_tensors(arch, cfg, weights, p)
    experts = _experts(cfg)
    if arch == "gpt-oss":
        return out + _gpt_oss_experts(weights, p + "mlp.")
    sparse = experts and i >= int(cfg.get("first_k_dense_replace") or 0)
    if not sparse:
        return out + [(f"ffn_{part}.weight", weights[f"{p}mlp.{part}_proj.weight"], True)
                      for part in ("gate", "up", "down")]
    moe = p + ("block_sparse_moe." if arch == "llama" else "mlp.")
    roles = ("w1", "w2", "w3") if arch == "llama" else ("gate_proj", "down_proj", "up_proj")
    out.append(("ffn_gate_inp.weight", weights[moe + "gate.weight"], False))
    if moe + "gate.e_score_correction_bias" in weights:
        out.append(("exp_probs_b.bias", weights[moe + "gate.e_score_correction_bias"], False))
    for gguf_name, hf in zip(("ffn_gate_exps", "ffn_down_exps", "ffn_up_exps"), roles,
                             strict=True):
        out.append((f"{gguf_name}.weight", np.stack([
            weights[f"{moe}experts.{e}.{hf}.weight"] for e in range(experts)]), True))
    if f"{moe}shared_experts.gate_proj.weight" in weights:
        out += [(f"ffn_{part}_shexp.weight", weights[f"{moe}shared_experts.{part}_proj.weight"],
                 True) for part in ("gate", "up", "down")]
    return out


def _attention_tensors(arch: str, cfg: dict[str, Any], weights: dict[str, np.ndarray],
                       p: str) -> list[LayerTensor]:
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    q, k = weights[p + "self_attn.q_proj.weight"], weights[p + "self_attn.k_proj.weight"]
    if arch == "llama":
        q, k = _permute(q, heads), _permute(k, kv_heads)
    out: list[LayerTensor] = [("attn_q.weight", q, True), ("attn_k.weight", k, True),
                         ("attn_v.weight", weights[p + "self_attn.v_proj.weight"], True),
                         ("attn_output.weight", weights[p + "self_attn.o_proj.weight"], True)]
    # Qwen2's and GPT-OSS's biases, Qwen3's q/k norms, GPT-OSS's sinks
    for part in ("q", "k", "v", "o"):
        gguf_part = "output" if part == "o" else part
        if f"{p}self_attn.{part}_proj.bias" in weights:
            out.append((f"attn_{gguf_part}.bias", weights[f"{p}self_attn.{part}_proj.bias"],
                        False))
        if f"{p}self_attn.{part}_norm.weight" in weights:
            out.append((f"attn_{part}_norm.weight", weights[f"{p}self_attn.{part}_norm.weight"],
                        False))
    if p + "self_attn.sinks" in weights:
        out.append(("attn_sinks.weight", weights[p + "self_attn.sinks"], False))
    return out


def _mla_tensors(cfg: dict[str, Any], weights: dict[str, np.ndarray], p: str) -> list[LayerTensor]:
    """DeepSeek's MLA; kv_b_proj split for llama.cpp's absorbed form: attn_k_b (heads,
    kv_lora, nope), each head's key rows transposed, and attn_v_b (heads, v, kv_lora)."""
    a = p + "self_attn."
    heads, rank = cfg["num_attention_heads"], int(cfg["kv_lora_rank"])
    nope, v_dim = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
    if a + "q_a_proj.weight" in weights:
        out: list[LayerTensor] = [("attn_q_a.weight", weights[a + "q_a_proj.weight"], True),
                             ("attn_q_a_norm.weight", weights[a + "q_a_layernorm.weight"], False),
                             ("attn_q_b.weight", weights[a + "q_b_proj.weight"], True)]
    else:
        out = [("attn_q.weight", weights[a + "q_proj.weight"], True)]
    kv_b = weights[a + "kv_b_proj.weight"].reshape(heads, nope + v_dim, rank)
    return out + [
        ("attn_kv_a_mqa.weight", weights[a + "kv_a_proj_with_mqa.weight"], True),
        ("attn_kv_a_norm.weight", weights[a + "kv_a_layernorm.weight"], False),
        ("attn_k_b.weight", np.ascontiguousarray(kv_b[:, :nope].swapaxes(1, 2)), True),
        ("attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:]), True),
        ("attn_output.weight", weights[a + "o_proj.weight"], True)]


def _gpt_oss_experts(weights: dict[str, np.ndarray], mlp: str) -> list[LayerTensor]:
    """GPT-OSS's router and experts: its stacks (E, H, 2I) with gate and up interleaved column
    by column and (E, I, H) become llama.cpp's (E, I, H) gate and up and (E, H, I) down; MXFP4
    ones (E, out, in / 32, 16), gate and up interleaved by row, are repacked as they are."""
    e = mlp + "experts."
    out: list[LayerTensor] = [("ffn_gate_inp.weight", weights[mlp + "router.weight"], False),
                         ("ffn_gate_inp.bias", weights[mlp + "router.bias"], False)]
    if e + "gate_up_proj_blocks" in weights:
        blocks, scales = weights[e + "gate_up_proj_blocks"], weights[e + "gate_up_proj_scales"]
        out += [("ffn_gate_exps.weight", _ggml_mxfp4(blocks[:, 0::2], scales[:, 0::2]), True),
                ("ffn_up_exps.weight", _ggml_mxfp4(blocks[:, 1::2], scales[:, 1::2]), True),
                ("ffn_down_exps.weight", _ggml_mxfp4(weights[e + "down_proj_blocks"],
                                                     weights[e + "down_proj_scales"]), True)]
    else:
        gate_up = weights[e + "gate_up_proj"].swapaxes(1, 2)  # (E, 2I, H), interleaved rows
        out += [("ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, 0::2]), True),
                ("ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, 1::2]), True),
                ("ffn_down_exps.weight",
                 np.ascontiguousarray(weights[e + "down_proj"].swapaxes(1, 2)), True)]
    bias = weights[e + "gate_up_proj_bias"]
    return out + [("ffn_gate_exps.bias", bias[:, 0::2], False),
                  ("ffn_up_exps.bias", bias[:, 1::2], False),
                  ("ffn_down_exps.bias", weights[e + "down_proj_bias"], False)]


def _ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> Packed:
    """MXFP4 as checkpoints store it ((..., rows, G, 16): two values a byte in order, the lower
    nibble first; exponents (..., rows, G)) in GGML's blocks of 17 bytes: the exponent, then
    value j in byte j's low nibble and value j + 16 in its high one."""
    codes = np.stack([blocks & 0xF, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    packed = np.concatenate([scales[..., None], nibbles], axis=-1).astype(np.uint8)
    return Packed(packed.reshape(*packed.shape[:-2], -1), MXFP4_TYPE)


def _add_tokenizer(writer: Any, model_dir: Path, cfg: dict[str, Any]) -> None:
    text = (model_dir / "tokenizer.json").read_text()
    spec = json.loads(text)
    vocab: dict[str, int] = dict(spec["model"].get("vocab") or {})
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [f"[PAD{i}]" for i in range(cfg["vocab_size"])]
    for token, token_id in vocab.items():
        if token_id < len(tokens):
            tokens[token_id] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    # llama.cpp's BPE vocabulary needs merges; a word-level tokenizer has none, and one merge
    # of two existing tokens changes nothing evenflow or a benchmark does
    writer.add_token_merges(merges or [f"{tokens[0]} {tokens[1]}"])
    for key, add in (("bos_token_id", writer.add_bos_token_id),
                     ("eos_token_id", writer.add_eos_token_id)):
        value = cfg.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            add(int(value))
    writer.add_string("tokenizer.huggingface.json", text)
    settings = model_dir / "tokenizer_config.json"
    template = json.loads(settings.read_text()).get("chat_template") if settings.is_file() \
        else None
    if not template and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if isinstance(template, str) and template:
        writer.add_chat_template(template)
