"""A Hugging Face checkpoint written as a GGUF file, as llama.cpp's converter writes it, with the
gguf package: for `bench engine --llamacpp` / `bench quant --llamacpp` (llama.cpp runs the same
weights) and for the GGUF loading tests (models/gguf_import.py reads it back). Torch-free.

Served: Llama-style dense and Mixtral-style MoE checkpoints (llama.cpp's `llama` architecture;
Q and K rows in its interleaved rotary layout), Qwen2 (with its q/k/v biases), Qwen3 (with its
q/k norms) and Qwen3-MoE (`qwen2`, `qwen3`, `qwen3moe`). Tensor types: bf16, f16, f32, q8_0,
q4_0, the K-quants q4_k, q5_k and q6_k (models/gguf_kquants.py), and llama-quantize's mixes
q4_k_m and q5_k_m for the weight matrices (experts stacked per layer), float32 for norms and the
router. As llama-quantize does, a matrix whose rows are not whole blocks falls back (K-quants
need rows of 256: q4_k to q4_0, q5_k and q6_k to q8_0; then float32). The tokenizer goes in
twice: as llama.cpp's `gpt2` vocabulary (its tokens, merges for a BPE model) and whole as
`tokenizer.huggingface.json`; the chat template as `tokenizer.chat_template`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from evenflow.models import gguf_blocks, gguf_kquants

TYPES = ("bf16", "f16", "f32", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q4_k_m", "q5_k_m")
_FALLBACK = {"q4_k": "q4_0", "q5_k": "q8_0", "q6_k": "q8_0", "q8_0": "f32", "q4_0": "f32"}
# model_type -> llama.cpp's architecture (Q and K reordered for its rotary only for `llama`)
FAMILIES = {"llama": "llama", "mixtral": "llama", "mistral": "llama", "qwen2": "qwen2",
            "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}


def read_safetensors(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the directory's safetensors files as float32 (bf16 widened exactly)."""
    tensors: dict[str, np.ndarray] = {}
    kinds = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
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
            tensors[name] = data.astype(np.float32).reshape(info["shape"])
    return tensors


# general.file_type (llama.cpp's LLAMA_FTYPE): what tools show as the file's type
_FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "q4_k": 15, "q5_k": 17, "q6_k": 18,
               "q4_k_m": 15, "q5_k_m": 17, "bf16": 32}


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
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads",
                                                           cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    writer = GGUFWriter(str(out), arch)
    writer.add_name(model_dir.name)
    writer.add_file_type(_FILE_TYPES.get(kind, 0))
    writer.add_context_length(int(cfg.get("max_position_embeddings", 4096)))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-5)))
    writer.add_vocab_size(cfg["vocab_size"])
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    if cfg.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    _add_tokenizer(writer, model_dir, cfg)
    layers = int(cfg["num_hidden_layers"])

    def add(name: str, value: np.ndarray, matrix: bool = True) -> None:
        chosen = gguf_kquants.mix_type(kind, name, layers) if kind.endswith("_m") else kind
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
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", weights[p + "input_layernorm.weight"], matrix=False)
        add(b + "ffn_norm.weight", weights[p + "post_attention_layernorm.weight"], matrix=False)
        q, k = weights[p + "self_attn.q_proj.weight"], weights[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = _permute(q, heads), _permute(k, kv_heads)
        add(b + "attn_q.weight", q)
        add(b + "attn_k.weight", k)
        add(b + "attn_v.weight", weights[p + "self_attn.v_proj.weight"])
        add(b + "attn_output.weight", weights[p + "self_attn.o_proj.weight"])
        for part in ("q", "k", "v"):  # Qwen2's biases, Qwen3's q/k norms
            if f"{p}self_attn.{part}_proj.bias" in weights:
                add(f"{b}attn_{part}.bias", weights[f"{p}self_attn.{part}_proj.bias"], False)
            if f"{p}self_attn.{part}_norm.weight" in weights:
                add(f"{b}attn_{part}_norm.weight", weights[f"{p}self_attn.{part}_norm.weight"],
                    False)
        if experts:
            moe = p + ("block_sparse_moe." if arch == "llama" else "mlp.")
            roles = ("w1", "w2", "w3") if arch == "llama" else ("gate_proj", "down_proj",
                                                                 "up_proj")
            add(b + "ffn_gate_inp.weight", weights[moe + "gate.weight"], matrix=False)
            for gguf_name, hf in zip(("ffn_gate_exps", "ffn_down_exps", "ffn_up_exps"), roles,
                                     strict=True):
                add(f"{b}{gguf_name}.weight", np.stack([
                    weights[f"{moe}experts.{e}.{hf}.weight"] for e in range(experts)]))
        else:
            for gguf_name, hf in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"),
                                  ("ffn_down", "down_proj")):
                add(f"{b}{gguf_name}.weight", weights[f"{p}mlp.{hf}.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


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
