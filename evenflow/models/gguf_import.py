"""GGUF checkpoints (llama.cpp's format) as evenflow loads them: `--model file.gguf` is converted
once into a checkpoint directory (config.json, model.safetensors, tokenizer.json) in
~/.cache/evenflow/gguf/, which the engine then loads as any other; the gateway and the balancer
read the same directory. Torch-free (numpy and the gguf package), as everything in models/.

Served: llama.cpp's `llama` architecture (Llama-style dense and Mixtral-style MoE models,
experts stacked per layer), `qwen2`, `qwen3` and `qwen3moe`. Tensors: F32, F16 and BF16, kept
exactly (BF16 and F32 as float32, F16 as float16), and the quantized Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, Q4_K, Q5_K and Q6_K (so the K-quant mixes llama-quantize writes, Q4_K_M and Q5_K_M, with
their fallbacks for rows that are not whole super-blocks, too). A quantized linear
of a layer (and lm_head) goes into the directory as its raw blocks, `<name>.gguf_<type>` uint8
(rows, bytes a row), under `quantization_config: {"quant_method": "gguf"}`: the directory is
no larger than the file, and the engine decodes the blocks as it loads each layer
(engine/weights/gguf_weights.py says into which of its forms). A quantized embedding is
dequantized into float32 (exact; the engine holds it in its dtype). Q and K come back from
llama.cpp's interleaved rotary layout to Hugging Face's (`llama` only; block rows are permuted
like value rows). The tokenizer is the
file's `tokenizer.huggingface.json` when it has one (evenflow's exporter writes it), a
tokenizer.json beside the file, or a byte-level BPE built from the file's `gpt2` vocabulary and
merges.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from evenflow.models import gguf_blocks

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
HINT_FILE = "evenflow_gguf.json"  # where the directory came from, and its tensor types
F32, F16, BF16 = 0, 1, 30  # GGMLQuantizationType values (the quantized ones: gguf_blocks.py)
# linears kept as blocks (not routers, norms or the embedding)
BLOCK_NAMES = ("_proj.", "block_sparse_moe.experts.")


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


def gguf_tensor_types(model_dir: Path) -> dict[str, int]:
    """A converted GGUF checkpoint's weight matrices by the file's type name (`q4_k`, `f16`,
    ...); empty for other checkpoints."""
    hint = model_dir / HINT_FILE
    if not hint.is_file():
        return {}
    return dict(json.loads(hint.read_text()).get("tensor_types", {}))


@functools.lru_cache(maxsize=8)
def served_name(path: str) -> str:
    """The name a GGUF file is served under: its `general.name` (what llama.cpp's tools show),
    else the file's name without .gguf."""
    from gguf import GGUFReader

    try:
        name = _field(GGUFReader(path), "general.name")
    except (OSError, ValueError):  # (a broken file: the loader says what is wrong with it)
        name = None
    return str(name).strip() if name and str(name).strip() else Path(path).stem


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
    if kind in gguf_blocks.LAYOUT:
        return dequantize(data, tensor.tensor_type).astype(np.float32, copy=False)
    raise GGUFError(f"tensor {tensor.name}: GGUF type {tensor.tensor_type.name} is not served "
                    "(F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K are)")


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
    kinds: dict[str, int] = {}
    for tensor in reader.tensors:
        name, kind = tensor.name, int(tensor.tensor_type)
        if kind in gguf_blocks.LAYOUT and not dequantize_all:
            raw = np.asarray(tensor.data)  # (..., rows, bytes a row), as stored
            for hf, rows in _hf_tensors(name, raw, heads, kv_heads, family):
                if hf == "lm_head.weight" or (hf.startswith("model.layers.") and
                                              any(p in hf for p in BLOCK_NAMES)):
                    base = hf.removesuffix(".weight")
                    tensors[f"{base}.gguf_{gguf_blocks.NAMES[kind]}"] = np.ascontiguousarray(rows)
                else:  # the embedding: plain
                    values = gguf_blocks.decode_rows(kind, rows).dequantize()
                    tensors[hf] = values.reshape(*rows.shape[:-1], values.shape[-1])
        else:
            for hf_name, value in _hf_tensors(name, _array(tensor), heads, kv_heads, family):
                tensors[hf_name] = np.ascontiguousarray(value)
        if len(tensor.shape) >= 2 and not name.endswith("ffn_gate_inp.weight"):
            type_name = tensor.tensor_type.name.lower()
            kinds[type_name] = kinds.get(type_name, 0) + 1
    if "lm_head.weight" not in tensors and not any(n.startswith("lm_head.") for n in tensors):
        config["tie_word_embeddings"] = True
    if any(".gguf_" in name for name in tensors):
        config["quantization_config"] = {"quant_method": "gguf"}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / HINT_FILE).write_text(json.dumps({"source": str(path), "tensor_types": kinds}))
    _write_tokenizer(reader, path, out, config)


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
