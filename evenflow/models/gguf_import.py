"""GGUF checkpoints (llama.cpp's format) as evenflow loads them: `--model file.gguf` is converted
once into a checkpoint directory (config.json, model.safetensors, tokenizer.json) in
~/.cache/evenflow/gguf/, which the engine then loads as any other; the gateway and the balancer
read the same directory. Torch-free (numpy and the gguf package), as everything in models/.

Served: llama.cpp's `llama` architecture (Llama-style dense and Mixtral-style MoE models,
experts stacked per layer), `qwen2`, `qwen3`, `qwen3moe`, `deepseek2` (DeepSeek-V2 and -V3:
MLA, DeepSeekMoE; V3 where the file's expert gating is sigmoid) and `gpt-oss`. Tensors: F32, F16
and BF16, kept exactly (BF16 and F32 as float32, F16 as float16), and the quantized Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K (so the K-quant mixes llama-quantize writes, Q4_K_M and
Q5_K_M, with their fallbacks for rows that are not whole super-blocks, too). A quantized linear
of a layer (and lm_head) goes into the directory as its raw blocks, `<name>.gguf_<type>` uint8
(rows, bytes a row), under `quantization_config: {"quant_method": "gguf"}`: the directory is
no larger than the file, and the engine decodes the blocks as each layer loads
(engine/weights/gguf_weights.py says into which of its forms). MXFP4 expert stacks
(llama-quantize's MXFP4_MOE, GPT-OSS's files) go in as GPT-OSS checkpoints store theirs
(`mlp.experts.gate_up_proj_blocks` / `_scales`, gate and up rows interleaved; the nibbles
reordered from GGML's block layout), which the engine keeps at 4.25 bits a weight
(engine/quant/mxfp4.py). A quantized embedding is dequantized into float32 (exact; the engine
holds it in its dtype), as is anything of MLA's kv_b_proj (the engine holds it in its dtype).
Q and K come back from llama.cpp's interleaved rotary layout to Hugging Face's (`llama` only;
block rows are permuted like value rows); DeepSeek's rotary dimensions are interleaved in both.
DeepSeek's kv_b_proj comes back whole from current llama.cpp's split `attn_k_b` (stored
transposed, per head) and `attn_v_b`, or from older files' `attn_kv_b`. The tokenizer is the
file's `tokenizer.huggingface.json` when it has one (evenflow's exporter writes it), a
tokenizer.json beside the file, or a byte-level BPE built from the file's `gpt2` vocabulary and
merges.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from evenflow.models import gguf_blocks
from evenflow.models.gguf_config import ARCHITECTURES, GGUFError, field, hf_config

# expert stacks: GGUF name -> HF projection, by the experts' HF naming
EXPERT_ROLES = {"block_sparse_moe": {"ffn_gate_exps.weight": "w1", "ffn_down_exps.weight": "w2",
                                     "ffn_up_exps.weight": "w3"},
                "mlp": {"ffn_gate_exps.weight": "gate_proj", "ffn_down_exps.weight": "down_proj",
                        "ffn_up_exps.weight": "up_proj"}}
HINT_FILE = "evenflow_gguf.json"  # where the directory came from, and its tensor types
F32, F16, BF16, MXFP4 = 0, 1, 30, 39  # GGMLQuantizationType (the others: gguf_blocks.py)
# linears kept as blocks (not routers, norms or the embedding)
BLOCK_NAMES = ("_proj.", "_proj_with_mqa.", "block_sparse_moe.experts.")
# tensors that become (part of) MLA's kv_b_proj, always float
KV_B = ("attn_kv_b.weight", "attn_k_b.weight", "attn_v_b.weight")




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
        name = field(GGUFReader(path), "general.name")
    except (OSError, ValueError):  # (a broken file: the loader says what is wrong with it)
        name = None
    return str(name).strip() if name and str(name).strip() else Path(path).stem




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
    if kind in gguf_blocks.LAYOUT or kind == MXFP4:
        return dequantize(data, tensor.tensor_type).astype(np.float32, copy=False)
    raise GGUFError(f"tensor {tensor.name}: GGUF type {tensor.tensor_type.name} is not served "
                    "(F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K and MXFP4 "
                    "are)")


def convert(path: Path, out: Path, dequantize_all: bool = False) -> None:
    """Write the checkpoint directory for the GGUF file at `path` into `out` (dequantize_all:
    every tensor as float32, none quantized again: the reference the tests compare with)."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    reader = GGUFReader(str(path))
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path.name}: GGUF architecture {arch!r} is not served (served: "
                        f"{', '.join(ARCHITECTURES)})")
    config = hf_config(reader, arch)
    family = ARCHITECTURES[arch]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if not family["permuted"]:
        heads = kv_heads = 0  # (no rotary reordering)
    tensors: dict[str, np.ndarray] = {}
    parts: dict[str, dict[str, np.ndarray]] = {}  # `<name>#<part>`: joined below
    kinds: dict[str, int] = {}
    mxfp4_layers = set() if dequantize_all else _mxfp4_layers(reader.tensors)
    for tensor in reader.tensors:
        name, kind = tensor.name, int(tensor.tensor_type)
        if dequantize_all or name.endswith(KV_B) or (
                kind not in gguf_blocks.LAYOUT and not (kind == MXFP4 and (
                    m := _EXPERTS.match(name)) and m[1] in mxfp4_layers)):
            hf_tensors = _hf_tensors(name, _array(tensor), heads, kv_heads, family)
        elif kind == MXFP4:  # an expert stack: stays MXFP4
            hf_tensors = _mxfp4_tensors(name, np.asarray(tensor.data))
        else:
            raw = np.asarray(tensor.data)  # (..., rows, bytes a row), as stored
            hf_tensors = []
            for hf, rows in _hf_tensors(name, raw, heads, kv_heads, family):
                if hf == "lm_head.weight" or (hf.startswith("model.layers.") and
                                              any(p in hf for p in BLOCK_NAMES)):
                    base = hf.removesuffix(".weight")
                    hf_tensors.append((f"{base}.gguf_{gguf_blocks.NAMES[kind]}", rows))
                else:  # the embedding: plain
                    values = gguf_blocks.decode_rows(kind, rows).dequantize()
                    hf_tensors.append((hf, values.reshape(*rows.shape[:-1], values.shape[-1])))
        for hf_name, value in hf_tensors:
            target, _, part = hf_name.partition("#")
            if part:
                parts.setdefault(target, {})[part] = value
            else:
                tensors[hf_name] = np.ascontiguousarray(value)
        if len(tensor.shape) >= 2 and not name.endswith("ffn_gate_inp.weight"):
            type_name = tensor.tensor_type.name.lower()
            kinds[type_name] = kinds.get(type_name, 0) + 1
    for target, pieces in parts.items():
        tensors[target] = _joined(target, pieces)
    if config["model_type"] == "deepseek_v3":  # (a file without the correction bias: zeros)
        for i in range(config["first_k_dense_replace"], config["num_hidden_layers"]):
            tensors.setdefault(f"model.layers.{i}.mlp.gate.e_score_correction_bias",
                               np.zeros(config["n_routed_experts"], np.float32))
    if "lm_head.weight" not in tensors and not any(n.startswith("lm_head.") for n in tensors):
        config["tie_word_embeddings"] = True
    if any(".gguf_" in name or name.endswith("_blocks") for name in tensors):
        config["quantization_config"] = {"quant_method": "gguf"}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / HINT_FILE).write_text(json.dumps({"source": str(path), "tensor_types": kinds}))
    _write_tokenizer(reader, path, out, config)


_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",  # (gpt-oss's name)
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "attn_sinks.weight": "self_attn.sinks",
    # MLA (deepseek2)
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_k_b.weight": "self_attn.kv_b_proj.weight#k",
    "attn_v_b.weight": "self_attn.kv_b_proj.weight#v",
    # DeepSeekMoE's shared experts and score-correction bias
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    # GPT-OSS's router and expert biases (stacked, gate and up interleaved as it stores them)
    "ffn_gate_inp.bias": "mlp.router.bias",
    "ffn_gate_exps.bias": "mlp.experts.gate_up_proj_bias#gate",
    "ffn_up_exps.bias": "mlp.experts.gate_up_proj_bias#up",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}
# expert stacks (ffn_gate_up_exps: a converter's option, gate rows then up rows)
_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.(weight|bias)$")
MXFP4_BLOCK = 17  # bytes a block of 32: an E8M0 exponent, then 16 bytes of nibbles


def _hf_tensors(name: str, value: np.ndarray, heads: int, kv_heads: int,
                family: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    """The Hugging Face tensors of one GGUF tensor (an expert stack is one per expert; a name
    `<target>#<part>` is part of a tensor _joined makes); heads and kv_heads 0: Q and K as
    stored (no rotary reordering)."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight":
           "model.norm.weight", "output.weight": "lm_head.weight"}
    if name in top:
        return [(top[name], value)]
    if not name.startswith("blk."):
        raise GGUFError(f"tensor {name} has no place in the model")
    _, index, rest = name.split(".", 2)
    prefix = f"model.layers.{index}."
    if rest == "ffn_gate_up_exps.weight" or rest == "ffn_gate_up_exps.bias":
        half = value.shape[1] // 2  # (rows of a stack, or a bias's columns)
        kind = rest.rsplit(".", 1)[1]
        return [out for part, piece in (("gate", value[:, :half]), ("up", value[:, half:]))
                for out in _hf_tensors(f"blk.{index}.ffn_{part}_exps.{kind}", piece, heads,
                                       kv_heads, family)]
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
    raise GGUFError(f"tensor {name} has no place in the model")


def _mxfp4_layers(tensors: Any) -> set[str]:
    """The layers whose expert stacks are all MXFP4 (a layer with some in another type, rows
    llama-quantize could not make MXFP4, is dequantized: the engine holds a layer's experts in
    one form)."""
    kinds: dict[str, set[bool]] = {}
    for tensor in tensors:
        if (m := _EXPERTS.match(tensor.name)) and m[3] == "weight":
            kinds.setdefault(m[1], set()).add(int(tensor.tensor_type) == MXFP4)
    return {layer for layer, mxfp4 in kinds.items() if mxfp4 == {True}}


def _mxfp4_tensors(name: str, raw: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """An MXFP4 expert stack (E, rows, blocks * 17 bytes) as GPT-OSS checkpoints store theirs:
    `_blocks` (E, rows, blocks, 16), two values a byte in order (the lower nibble first), and
    `_scales` (E, rows, blocks), the same E8M0 exponents. GGML's block holds value j in byte j's
    low nibble and value j + 16 in its high one."""
    m = _EXPERTS.match(name)
    assert m is not None and m[3] == "weight"
    b = raw.reshape(*raw.shape[:-1], -1, MXFP4_BLOCK)
    nibbles = b[..., 1:]
    codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1)  # (..., blocks, 32)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    base = f"model.layers.{m[1]}.mlp.experts."
    if m[2] == "gate_up":
        half = raw.shape[1] // 2
        return [(f"{base}gate_up_proj_{kind}#{part}", t)
                for part, rows in (("gate", slice(None, half)), ("up", slice(half, None)))
                for kind, t in (("blocks", blocks[:, rows]), ("scales", b[:, rows, :, 0]))]
    if m[2] == "down":
        return [(f"{base}down_proj_blocks", blocks), (f"{base}down_proj_scales", b[..., 0])]
    return [(f"{base}gate_up_proj_blocks#{m[2]}", blocks),
            (f"{base}gate_up_proj_scales#{m[2]}", b[..., 0])]


def _joined(target: str, parts: dict[str, np.ndarray]) -> np.ndarray:
    """One tensor from its parts: MLA's kv_b_proj (heads * (nope + v), kv_lora) from k_b
    (heads, kv_lora, nope) and v_b (heads, v, kv_lora); GPT-OSS's stacked gate_up (bias, MXFP4
    blocks or scales) with gate and up interleaved along its second axis."""
    if target.endswith("kv_b_proj.weight"):
        if set(parts) != {"k", "v"}:
            raise GGUFError(f"{target}: the file has only attn_{''.join(parts)}_b of it")
        k, v = parts["k"], parts["v"]
        return np.concatenate([k.swapaxes(1, 2), v], axis=1).reshape(-1, k.shape[1])
    if set(parts) != {"gate", "up"}:
        raise GGUFError(f"{target}: the file has only the {''.join(parts)} part of it")
    gate, up = parts["gate"], parts["up"]
    joined = np.empty((gate.shape[0], 2 * gate.shape[1], *gate.shape[2:]), gate.dtype)
    joined[:, 0::2], joined[:, 1::2] = gate, up
    return joined


def _write_tokenizer(reader: Any, path: Path, out: Path, config: dict[str, Any]) -> None:
    embedded = field(reader, "tokenizer.huggingface.json")
    beside = path.with_name("tokenizer.json")
    if embedded:
        (out / "tokenizer.json").write_text(embedded)
    elif beside.is_file():
        shutil.copy(beside, out / "tokenizer.json")
    elif field(reader, "tokenizer.ggml.model") == "gpt2":
        _bpe_tokenizer(reader).save(str(out / "tokenizer.json"))
    else:
        raise GGUFError(f"{path.name}: no tokenizer evenflow can build (it reads "
                        "tokenizer.huggingface.json, a tokenizer.json beside the file, or a gpt2 "
                        "BPE vocabulary); put the model's tokenizer.json beside the file")
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    settings: dict[str, Any] = {}
    for key, token_id in (("bos_token", config["bos_token_id"]),
                          ("eos_token", config["eos_token_id"])):
        if token_id is not None and token_id < len(tokens):
            settings[key] = tokens[token_id]
    template = field(reader, "tokenizer.chat_template")
    if template:
        settings["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(settings))


def _bpe_tokenizer(reader: Any) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer
