"""GGUF checkpoints (llama.cpp's format) as evenflow loads them: `--model file.gguf` is converted
once into a checkpoint directory (config.json, model.safetensors, tokenizer.json) in
~/.cache/evenflow/gguf/, which the engine then loads as any other; the gateway and the balancer
read the same directory. Torch-free (numpy and the gguf package), as everything in models/.

Served: llama.cpp's `llama` architecture (Llama-style dense and Mixtral-style MoE models,
experts stacked per layer), `qwen2`, `qwen3` and `qwen3moe`. Tensors: F32, F16 and BF16, kept
exactly (BF16 and F32 as float32, F16 as float16), and Q8_0 / Q4_0. Q4_0 linears are written
as GPTQ int4 (groups of 32, zero point 8, fp16 scales: exactly Q4_0's values), which the
engine loads as its int4; where a layer's q/k/v or experts mix Q4_0 with other types, that
group is dequantized instead (the engine fuses them). Q8_0 is dequantized and quantized again
at load, per output channel, as evenflow's int8 (Q8_0's blocks of 32 have no exact
counterpart there); `evenflow_gguf.json` says so, and the engine applies it unless a
quantization was asked for. Q and K come back from llama.cpp's interleaved rotary layout to
Hugging Face's (`llama` only). The tokenizer is the file's `tokenizer.huggingface.json` when
it has one (evenflow's exporter writes it), a tokenizer.json beside the file, or a byte-level
BPE built from the file's `gpt2` vocabulary and merges.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

# llama.cpp's architectures served: (HF class, model_type) dense and MoE, whether llama.cpp
# stored Q and K in its interleaved rotary order, and the HF prefix of a layer's experts
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": dict(dense=("LlamaForCausalLM", "llama"), moe=("MixtralForCausalLM", "mixtral"),
                  permuted=True, experts="block_sparse_moe"),
    "qwen2": dict(dense=("Qwen2ForCausalLM", "qwen2"), moe=None, permuted=False, experts=""),
    "qwen3": dict(dense=("Qwen3ForCausalLM", "qwen3"), moe=None, permuted=False, experts=""),
    "qwen3moe": dict(dense=None, moe=("Qwen3MoeForCausalLM", "qwen3_moe"), permuted=False,
                     experts="mlp"),
}
# expert stacks: GGUF name -> HF projection, by the experts' HF naming
EXPERT_ROLES = {"block_sparse_moe": {"ffn_gate_exps.weight": "w1", "ffn_down_exps.weight": "w2",
                                     "ffn_up_exps.weight": "w3"},
                "mlp": {"ffn_gate_exps.weight": "gate_proj", "ffn_down_exps.weight": "down_proj",
                        "ffn_up_exps.weight": "up_proj"}}
HINT_FILE = "evenflow_gguf.json"  # the quantization the file's tensors ask for
F32, F16, Q4_0, Q8_0, BF16 = 0, 1, 2, 8, 30  # GGMLQuantizationType values
QUANTIZATION_OF = {Q8_0: ("int8", 0)}  # requantized at load (Q4_0 is GPTQ in the directory)
GPTQ_NAMES = ("_proj.", "block_sparse_moe.experts.")  # linears GPTQ may hold (not routers)
Q4_0_BLOCK = 32


class GGUFError(ValueError):
    """The GGUF file cannot be served (architecture, tensor type, tokenizer)."""


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "evenflow" / "gguf"


def converted_dir(path: Path) -> Path:
    """The checkpoint directory of this GGUF file, converted on first use (keyed by the
    file's path, size and modification time; several processes may race: one rename wins)."""
    path = path.expanduser().resolve()
    stat = path.stat()
    key = hashlib.sha1(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / f"{path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        convert(path, tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process converted it first
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_quantization(model_dir: Path) -> tuple[str, int] | None:
    """(quantization, int4 group size) a converted GGUF checkpoint asks for, or None."""
    hint = model_dir / HINT_FILE
    if not hint.is_file():
        return None
    data = json.loads(hint.read_text())
    return (data["quantization"], int(data["group_size"])) if data.get("quantization") else None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (rotary pairs interleaved) back to Hugging Face's halves."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _array(tensor: Any) -> np.ndarray:
    """A tensor's values: float32, or float16 for F16 (exact); quantized types dequantized."""
    from gguf.quants import dequantize

    kind = int(tensor.tensor_type)
    data = np.asarray(tensor.data)
    if kind == F32:
        return data.astype(np.float32, copy=False)
    if kind == F16:
        return data.astype(np.float16, copy=False)
    if kind == BF16:
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if kind in (Q8_0, Q4_0):
        return dequantize(data, tensor.tensor_type).astype(np.float32, copy=False)
    raise GGUFError(f"tensor {tensor.name}: GGUF type {tensor.tensor_type.name} is not served "
                    "(F32, F16, BF16, Q8_0 and Q4_0 are)")


def convert(path: Path, out: Path, dequantize_all: bool = False) -> None:
    """Write the checkpoint directory for the GGUF file at `path` into `out` (dequantize_all:
    every tensor as float32, none quantized again: the reference the tests compare with)."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path.name}: GGUF architecture {arch!r} is not served (served: "
                        f"{', '.join(ARCHITECTURES)})")
    config = _config(reader, arch)
    family = ARCHITECTURES[arch]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if not family["permuted"]:
        heads = kv_heads = 0  # (no rotary reordering)
    tensors: dict[str, np.ndarray] = {}
    kinds: dict[int, int] = {}
    mixed = {_fused_group(t.name) for t in reader.tensors if int(t.tensor_type) != Q4_0}
    mixed.discard(None)
    for tensor in reader.tensors:
        name, kind = tensor.name, int(tensor.tensor_type)
        # Q4_0: its codes and scales (rows permuted as the values), unless its group is mixed
        if kind == Q4_0 and not dequantize_all and _fused_group(name) not in mixed:
            q, d = _q4_0_codes(tensor)
            codes = {hf: c for hf, c in _hf_tensors(name, q, heads, kv_heads, family)}
            for hf, scale in _hf_tensors(name, d, heads, kv_heads, family):
                if hf.startswith("model.layers.") and any(p in hf for p in GPTQ_NAMES):
                    tensors.update(_gptq(hf.removesuffix(".weight"), codes[hf], scale))
                else:  # embedding, lm_head: plain
                    tensors[hf] = np.ascontiguousarray(_dequantized(codes[hf], scale))
            kinds[kind] = kinds.get(kind, 0) + 1
            continue
        values = _array(tensor)
        if values.ndim >= 2 and not name.endswith("ffn_gate_inp.weight"):
            kinds[kind] = kinds.get(kind, 0) + 1
        for hf_name, value in _hf_tensors(name, values, heads, kv_heads, family):
            tensors[hf_name] = np.ascontiguousarray(value)
    if "lm_head.weight" not in tensors:
        config["tie_word_embeddings"] = True
    if any(name.endswith(".qweight") for name in tensors):
        config["quantization_config"] = {
            "quant_method": "gptq", "bits": 4, "group_size": Q4_0_BLOCK, "sym": False,
            "desc_act": False, "checkpoint_format": "gptq_v2"}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    quantized = sorted((n, k) for k, n in kinds.items() if k in QUANTIZATION_OF)
    method, group = QUANTIZATION_OF[quantized[-1][1]] if quantized and not dequantize_all \
        else ("", 0)
    (out / HINT_FILE).write_text(json.dumps({
        "source": str(path), "quantization": method, "group_size": group,
        "tensor_types": {str(k): v for k, v in kinds.items()}}))
    _write_tokenizer(reader, path, out, config)


def _fused_group(name: str) -> tuple[str, str] | None:
    """The tensors the engine fuses, which GPTQ must hold all or none of: a layer's q/k/v,
    and its expert stacks."""
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "blk":
        return None
    if parts[2] in ("attn_q", "attn_k", "attn_v") and parts[-1] == "weight":
        return parts[1], "qkv"
    if parts[2].endswith("_exps"):
        return parts[1], "experts"
    return None


def _q4_0_codes(tensor: Any) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_0 tensor's codes (..., K) uint8 in 0..15 and scales (..., K / 32) float16: each
    block of 32 is an fp16 scale d, then 16 bytes: code j in byte j's low nibble, code j + 16
    in its high nibble; w = d * (code - 8)."""
    raw = np.asarray(tensor.data)
    blocks = raw.reshape(*raw.shape[:-1], -1, 2 + Q4_0_BLOCK // 2)
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    nibbles = blocks[..., 2:]
    q = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1)  # (..., K / 32, 32)
    return q.reshape(*raw.shape[:-1], -1), d


def _dequantized(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    w = (q.astype(np.float32) - 8).reshape(*d.shape, Q4_0_BLOCK) * d[..., None].astype(
        np.float32)
    return w.reshape(q.shape)


def _gptq(base: str, q: np.ndarray, d: np.ndarray) -> dict[str, np.ndarray]:
    """One Q4_0 linear (N, K) as GPTQ v2 tensors (engine/weights/gptq.py's layout): codes
    packed 8 to an int32 along K, fp16 scales (K / 32, N), zero points 8 packed along N."""
    n, k = q.shape
    shifts = np.arange(8, dtype=np.uint32) * 4
    packed = (q.T.astype(np.uint32).reshape(k // 8, 8, n) << shifts[None, :, None]).sum(
        axis=1, dtype=np.uint32)
    zeros = np.full((k // Q4_0_BLOCK, n // 8), 0x88888888, dtype=np.uint32)
    return {f"{base}.qweight": np.ascontiguousarray(packed).view(np.int32),
            f"{base}.scales": np.ascontiguousarray(d.T),
            f"{base}.qzeros": zeros.view(np.int32)}


def _config(reader: Any, arch: str) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    experts = int(get("expert_count", 0) or 0)
    config: dict[str, Any] = {
        "vocab_size": int(get("vocab_size", 0) or embed.shape[-1]),
        "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    family = ARCHITECTURES[arch]
    kind = family["moe"] if experts else family["dense"]
    if kind is None:
        raise GGUFError(f"a {arch} GGUF {'with' if experts else 'without'} experts is not served")
    config.update(architectures=[kind[0]], model_type=kind[1])
    if experts:
        used = int(get("expert_used_count"))
        config.update(num_local_experts=experts, num_experts=experts, num_experts_per_tok=used)
    if arch == "qwen3moe":
        config.update(moe_intermediate_size=int(get("expert_feed_forward_length")),
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return config


_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}


def _hf_tensors(name: str, value: np.ndarray, heads: int, kv_heads: int,
                family: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    """The Hugging Face tensors of one GGUF tensor (an expert stack is one per expert); heads
    and kv_heads 0: Q and K as stored (no rotary reordering)."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight":
           "model.norm.weight", "output.weight": "lm_head.weight"}
    if name in top:
        return [(top[name], value)]
    if not name.startswith("blk."):
        raise GGUFError(f"tensor {name} has no place in a llama-architecture model")
    _, index, rest = name.split(".", 2)
    prefix = f"model.layers.{index}."
    if rest == "attn_q.weight":
        return [(prefix + "self_attn.q_proj.weight",
                 _unpermute(value, heads) if heads else value)]
    if rest == "attn_k.weight":
        return [(prefix + "self_attn.k_proj.weight",
                 _unpermute(value, kv_heads) if kv_heads else value)]
    if rest in _LAYER_NAMES:
        return [(prefix + _LAYER_NAMES[rest], value)]
    experts = family["experts"]
    if rest == "ffn_gate_inp.weight" and experts:
        return [(f"{prefix}{experts}.gate.weight", value)]
    if experts and rest in EXPERT_ROLES[experts]:
        role = EXPERT_ROLES[experts][rest]
        return [(f"{prefix}{experts}.experts.{e}.{role}.weight", value[e])
                for e in range(value.shape[0])]
    raise GGUFError(f"tensor {name} has no place in a llama-architecture model")


def _write_tokenizer(reader: Any, path: Path, out: Path, config: dict[str, Any]) -> None:
    embedded = _field(reader, "tokenizer.huggingface.json")
    beside = path.with_name("tokenizer.json")
    if embedded:
        (out / "tokenizer.json").write_text(embedded)
    elif beside.is_file():
        shutil.copy(beside, out / "tokenizer.json")
    elif _field(reader, "tokenizer.ggml.model") == "gpt2":
        _bpe_tokenizer(reader).save(str(out / "tokenizer.json"))
    else:
        raise GGUFError(f"{path.name}: no tokenizer evenflow can build (it reads "
                        "tokenizer.huggingface.json, a tokenizer.json beside the file, or a gpt2 "
                        "BPE vocabulary); put the model's tokenizer.json beside the file")
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    settings: dict[str, Any] = {}
    for key, token_id in (("bos_token", config["bos_token_id"]),
                          ("eos_token", config["eos_token_id"])):
        if token_id is not None and token_id < len(tokens):
            settings[key] = tokens[token_id]
    template = _field(reader, "tokenizer.chat_template")
    if template:
        settings["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(settings))


def _bpe_tokenizer(reader: Any) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer
