"""Loading HF-format checkpoints: config.json + model.safetensors (single or sharded with an
index) into a CausalLM, stacking per-expert weights into the model's grouped layout.

Loading goes one decoder layer at a time: read the layer's tensors, fill the layer, quantize it
when asked (a QuantConfig, or a GPTQ checkpoint), drop what was read; so peak memory stays near
the (quantized) model's size plus one layer. GPT-OSS's MXFP4 experts stay MXFP4 (engine/quant/
mxfp4.py): handed to the layer as stored, never expanded (only a tensor-parallel shard, which
cuts the experts' rows, dequantizes them first).
"""

from __future__ import annotations

import ctypes
import functools
import json
import re
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from evenflow import models
from evenflow.engine.config.families import load_model_config
from evenflow.engine.config.settings import (
    EngineConfig,
    ModelConfig,
    ModelLoadError,
    cpu_has_bf16,
)
from evenflow.engine.model.transformer import CausalLM
from evenflow.engine.quant import mxfp4
from evenflow.engine.quant.mxfp4 import Mxfp4Values
from evenflow.engine.quant.stacks import ATTENTION_BY_METHOD, QuantConfig, QuantValues, quantize
from evenflow.engine.weights import (
    awq,
    compressed_tensors,
    fp8_blockwise,
    gguf_weights,
    gptq,
    safetensors_io,
)
from evenflow.engine.weights.hf_names import (
    EXPERT,
    GATE_UP,
    RENAMES,
    ROLE,
    ROW_STACKED_EXPERTS,
    STORED_NAMES,
    TRANSPOSED_EXPERTS,
    usual_name,
)
from evenflow.engine.weights.prepack import prepack_model
from evenflow.engine.weights.quantize_model import quantize_head, quantize_layer
from evenflow.engine.weights.tp_shard import TPShard
from evenflow.progress import Progress

# Already-stacked experts (transformers' in-memory layout, found in some exports; GPT-OSS's
# checkpoints, transposed and with biases).
_STACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
# GPT-OSS's MXFP4 experts (engine/quant/mxfp4.py): (E, out, in / 32, 16) nibbles and scales
_MXFP4 = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj))"
                    r"_(blocks|scales)$")


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"{index}: not a safetensors index ({exc})") from exc
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights found")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{model_dir}: shard(s) missing: {', '.join(missing)}")
    return files


def tensor_names(files: list[Path]) -> dict[Path, list[str]]:
    """Each file's tensor names (read once: a load then opens only the files it needs)."""
    names: dict[Path, list[str]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                names[path] = list(f.keys())
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file ({exc})") from exc
    return names


def _read_tensors(names: dict[Path, list[str]], wanted: Callable[[str], bool],
                  rename: Callable[[str], str] | None = None) -> dict[str, Tensor]:
    """The tensors `wanted` picks, each in memory of its own (no file mapping stays); with
    `rename` (a family's stored names -> the usual ones), picked and returned by that name."""
    tensors: dict[str, Tensor] = {}
    for path, in_file in names.items():
        chosen = [name for name in in_file if wanted(rename(name) if rename else name)]
        if not chosen:
            continue
        try:
            read = safetensors_io.read(path, chosen)
            tensors.update({rename(k): v for k, v in read.items()} if rename else read)
        except (OSError, safetensors_io.SafetensorsError) as exc:
            raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file ({exc})") from exc
    return tensors


def _to_model_names(cfg: ModelConfig, tensors: dict[str, Tensor], layers: Iterable[int],
                    quantized_experts: bool = False) -> dict[str, Tensor]:
    """Rename HF tensors to this model's parameters, fusing q/k/v and stacking experts into
    w13 / w2 for `layers` (not when their experts come quantized)."""
    layers = list(layers)
    state: dict[str, Tensor] = {}
    experts: dict[tuple[int, int, str], Tensor] = {}
    row_stacked: dict[tuple[int, str], Tensor] = {}
    transposed = cfg.architecture in TRANSPOSED_EXPERTS
    for name, t in _dequantized_mxfp4(tensors).items():
        if m := EXPERT.match(name):
            experts[(int(m[1]), int(m[2]), ROLE[m[3]])] = t
        elif m := ROW_STACKED_EXPERTS.match(name):
            row_stacked[(int(m[1]), m[2])] = t
        elif m := _STACKED.match(name):
            gate_up = m[2] == "gate_up_proj"
            key = ("b" if m[3] else "w") + ("13" if gate_up else "2")
            state[f"model.layers.{m[1]}.mlp.{key}"] = \
                _untransposed(t, gate_up) if transposed else t
        elif ".block_sparse_moe.gate." in name:
            state[name.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = t
        elif fused := next((k for k in GATE_UP if name.endswith(k)), None):
            mlp = name.removesuffix(fused) + GATE_UP[fused]
            state[f"{mlp}gate_proj.weight"], state[f"{mlp}up_proj.weight"] = t.chunk(2)
        else:
            for old, new in RENAMES:
                name = name.replace(old, new)
            state[name] = t.flatten() if name.endswith(".mlp.score_bias") else t
    for layer in layers:
        if cfg.mla:  # (no q/k/v to fuse)
            continue
        attn = f"model.layers.{layer}.self_attn."
        for kind in ("weight", "bias"):
            parts = [state.pop(f"{attn}{p}_proj.{kind}", None) for p in "qkv"]
            if all(t is not None for t in parts):
                state[f"{attn}qkv_proj.{kind}"] = torch.cat(parts)  # type: ignore[arg-type]
            elif any(t is not None for t in parts):
                raise ModelLoadError(f"checkpoint has only some of {attn}q/k/v_proj.{kind}")
    state |= _unstacked_rows(cfg, row_stacked)
    for layer in layers:
        if not cfg.sparse_layers[layer] or f"model.layers.{layer}.mlp.w13" in state or \
                quantized_experts:
            continue
        try:
            gate_up = [torch.cat([experts[(layer, e, "gate")], experts[(layer, e, "up")]])
                       for e in range(cfg.num_experts)]
            down = [experts[(layer, e, "down")] for e in range(cfg.num_experts)]
        except KeyError as exc:
            raise ModelLoadError(f"checkpoint lacks expert weight {exc.args[0]}") from exc
        state[f"model.layers.{layer}.mlp.w13"] = torch.stack(gate_up)
        state[f"model.layers.{layer}.mlp.w2"] = torch.stack(down)
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def _unstacked_rows(cfg: ModelConfig, row_stacked: dict[tuple[int, str], Tensor]
                    ) -> dict[str, Tensor]:
    """DBRX's experts (hf_names.ROW_STACKED_EXPERTS) by (layer, w1 | v1 | w2) -> the model's
    w13 (E, 2I, H) [gate | up] and w2 (E, H, I)."""
    state: dict[str, Tensor] = {}
    E, H = cfg.num_experts, cfg.hidden_size
    for layer in sorted({layer for layer, _ in row_stacked}):
        try:
            gate, up, down = (row_stacked[(layer, kind)].view(E, -1, H)
                              for kind in ("w1", "v1", "w2"))
        except KeyError as exc:
            raise ModelLoadError(f"checkpoint lacks layer {layer}'s experts {exc.args[0][1]}"
                                 ) from exc
        except RuntimeError as exc:  # (a view that does not fit)
            raise ModelLoadError(f"layer {layer}'s experts do not fit the config: {exc}"
                                 ) from exc
        state[f"model.layers.{layer}.mlp.w13"] = torch.cat([gate, up], dim=1)
        state[f"model.layers.{layer}.mlp.w2"] = down.transpose(1, 2).contiguous()
    return state


def _dequantized_mxfp4(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """MXFP4 expert stacks (blocks + scales) replaced by their float values in the layout of
    an unquantized GPT-OSS checkpoint, (E, in, out); everything else as it is."""
    found = {m[1]: None for name in tensors if (m := _MXFP4.match(name))}
    if not found:
        return tensors
    out = {name: t for name, t in tensors.items() if not _MXFP4.match(name)}
    for base in found:
        try:
            values = mxfp4.dequantize(tensors[f"{base}_blocks"], tensors[f"{base}_scales"])
        except KeyError as exc:
            raise ModelLoadError(f"MXFP4 checkpoint lacks {exc.args[0]}") from exc
        except ValueError as exc:
            raise ModelLoadError(f"{base}: {exc}") from exc
        out[base] = values.transpose(-1, -2)
    return out


def take_mxfp4_experts(tensors: dict[str, Tensor], layer: int
                       ) -> dict[str, list[Mxfp4Values]]:
    """Pop one layer's MXFP4 expert stacks out of `tensors`, as the model's per-expert
    weights (N, K) in MXFP4: gate_up's rows, stored gate and up interleaved, become
    [gate | up] (w13); down as stored (w2). Empty where the layer's experts are not MXFP4."""
    base = f"model.layers.{layer}.mlp.experts."
    given: dict[str, list[Mxfp4Values]] = {}
    for stored, ours in (("gate_up_proj", "mlp.w13"), ("down_proj", "mlp.w2")):
        blocks = tensors.pop(f"{base}{stored}_blocks", None)
        scales = tensors.pop(f"{base}{stored}_scales", None)
        if blocks is None and scales is None:
            continue
        if blocks is None or scales is None:
            raise ModelLoadError(f"MXFP4 checkpoint has only one of {base}{stored}"
                                 f"_blocks / _scales")
        if blocks.dim() != 4 or blocks.shape[:-1] != scales.shape or \
                blocks.shape[-1] != mxfp4.GROUP // 2:
            raise ModelLoadError(f"{base}{stored}: MXFP4 blocks {tuple(blocks.shape)} do not "
                                 f"match scales {tuple(scales.shape)}")
        if stored == "gate_up_proj":  # (rows 2i: gate i, 2i + 1: up i)
            blocks = torch.cat([blocks[:, 0::2], blocks[:, 1::2]], dim=1)
            scales = torch.cat([scales[:, 0::2], scales[:, 1::2]], dim=1)
        given[ours] = [Mxfp4Values(b.contiguous(), s.contiguous())
                       for b, s in zip(blocks.unbind(0), scales.unbind(0), strict=True)]
    return given


def _untransposed(t: Tensor, gate_up: bool) -> Tensor:
    """GPT-OSS's stacked experts in the model's layout: gate_up (E, H, 2I) with gate and up
    interleaved column by column -> (E, 2I, H) [gate | up]; down (E, I, H) -> (E, H, I); their
    biases (E, 2I) de-interleaved the same way, (E, H) as is."""
    if t.dim() == 2:  # a bias
        return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous() if gate_up else t
    if gate_up:
        t = torch.cat([t[:, :, 0::2], t[:, :, 1::2]], dim=2)
    return t.transpose(1, 2).contiguous()


def _checked(state: dict[str, Tensor], expected: dict[str, Tensor], dtype: torch.dtype,
             covered: Collection[str] = ()) -> dict[str, Tensor]:
    """`state` in `dtype` after checking it against the model's parameters (`covered`: ones
    that come quantized instead)."""
    missing = sorted(set(expected) - set(state) - set(covered))
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ModelLoadError(f"checkpoint has unknown tensor(s), e.g. {unexpected[:3]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)}, config "
                                 f"implies {tuple(expected[name].shape)}")
    return {name: tensor.to(dtype) for name, tensor in state.items()}


def read_quant_spec(config: dict) -> dict | None:
    """The checkpoint's quantization as we load it (GPTQ or compressed-tensors int8, with its
    `method`; FP8 block-wise, kept as stored), None if unquantized (or MXFP4, whose experts the
    loader finds by name); ModelLoadError for what we cannot load."""
    spec = config.get("quantization_config") or {}
    if spec.get("quant_method") == compressed_tensors.FORMAT:
        return compressed_tensors.read_quant_config(spec)
    if spec.get("quant_method") == fp8_blockwise.FORMAT:
        return fp8_blockwise.read_quant_config(spec)
    if spec.get("quant_method") == gguf_weights.FORMAT:
        return gguf_weights.read_quant_config(spec)
    if spec.get("quant_method") == awq.FORMAT:
        return awq.read_quant_config(spec)
    return gptq.read_quant_config(config)


def take_quantized(tensors: dict[str, Tensor], spec: dict) -> dict[str, QuantValues]:
    """Pop the pre-quantized layers out of one read of `tensors`, by HF layer name."""
    if spec.get("format") == compressed_tensors.FORMAT:
        return compressed_tensors.take_quantized(tensors, spec)
    if spec.get("format") == fp8_blockwise.FORMAT:
        return fp8_blockwise.take_quantized(tensors, spec)  # type: ignore[return-value]
    if spec.get("format") == gguf_weights.FORMAT:
        return gguf_weights.take_quantized(tensors, spec)
    if spec.get("format") == awq.FORMAT:
        return awq.take_quantized(tensors, spec)
    return gptq.take_quantized(tensors, spec)


def load_model(model_dir: str | Path, dtype: torch.dtype,
               quantization: QuantConfig | None = None, shard: TPShard | None = None,
               show_progress: bool = False) -> CausalLM:
    """Build the model described by config.json and fill it from the safetensors files,
    quantizing as it goes when asked (or when the checkpoint is GPTQ). With a TPShard, only
    that tensor-parallel rank's part of each layer is kept (cut before quantizing)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    cfg = load_model_config(model_dir)
    spec = read_quant_spec(json.loads((model_dir / "config.json").read_text()))
    files = checkpoint_files(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = dict(model.state_dict())
    if shard is not None:
        shard.check(cfg)
        if spec is not None:
            raise ModelLoadError("tensor parallelism over a pre-quantized checkpoint is "
                                 "not supported: load the unquantized one with quantization=")
    with Progress(f"loading {model_dir.name}", cfg.num_layers + 1, show_progress) as progress:
        _load_by_layer(model, files, expected, dtype, spec, quantization, shard, progress)
    if cfg.tie_word_embeddings and not cfg.folds_head:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def _load_by_layer(model: CausalLM, files: list[Path], expected: dict[str, Tensor],
                   dtype: torch.dtype, spec: dict | None, quantization: QuantConfig | None,
                   shard: TPShard | None, progress: Progress) -> None:
    cfg = model.config
    if quantization is None and spec is not None and spec.get("method"):
        # quantized as it says, the rest as is
        quantization = QuantConfig(spec["method"], max(32, spec.get("group_size", 64)),
                                   bool(spec.get("sym")))
    layer_of = re.compile(r"^model\.layers\.(\d+)\.")
    names = tensor_names(files)
    rename = functools.partial(usual_name, cfg.architecture) \
        if cfg.architecture in STORED_NAMES else None
    for layer in range(cfg.num_layers):
        prefix = f"model.layers.{layer}."
        # quantized as read, one expert at a time (None: read with the layer, as stored)
        experts = _expert_names(cfg, layer, names, quantization) if (
            quantization is not None and spec is None and shard is None
            and cfg.sparse_layers[layer]) else None
        tensors = _read_tensors(names, _layer_tensors(prefix, skip_experts=experts is not None),
                                rename)
        given_hf = take_quantized(tensors, spec) if spec else {}
        given: dict[str, list] = dict(gptq.to_model_values(cfg, layer, given_hf))
        if shard is None:  # (a TP shard cuts plain rows: MXFP4 is dequantized for it)
            given.update(take_mxfp4_experts(tensors, layer))
        if experts is not None:
            assert quantization is not None
            given.update(_quantize_experts_as_read(cfg, experts, quantization))
        covered = {f"{prefix}{name}.weight" if not name.endswith(("w13", "w2")) else
                   f"{prefix}{name}" for name in given}
        renamed = _to_model_names(cfg, tensors, [layer], "mlp.w13" in given)
        tensors.clear()  # the per-expert originals: stacked copies are in `renamed` now
        state = _checked(renamed, {k: v for k, v in expected.items() if k.startswith(prefix)},
                         dtype, covered)
        del renamed
        module = model.model.layers[layer]
        module.load_state_dict({k.removeprefix(prefix): v for k, v in state.items()},
                               assign=True, strict=False)
        _drop_covered(module, covered, prefix, dtype)
        _fold_residual(module, cfg.residual_multiplier, given)
        if cfg.rope_interleave and not cfg.mla:
            _fold_rope_interleave(module, cfg, given)
        if shard is not None:
            shard.shard_layer(module, cfg)  # type: ignore[arg-type]
        if quantization is not None or given:
            quantize_layer(module, quantization, dtype, given, layer)  # type: ignore[arg-type]
        del tensors, state, given, given_hf
        _return_freed_memory()
        progress.update()
    tensors = _read_tensors(names, lambda name: layer_of.match(name) is None, rename)
    given_head = take_quantized(tensors, spec).get("lm_head") if spec else None
    covered = {"lm_head.weight"} if given_head is not None else set()
    rest = {k: v for k, v in expected.items() if layer_of.match(k) is None}
    model.load_state_dict(_checked(_to_model_names(cfg, tensors, []), rest, dtype, covered),
                          assign=True, strict=False)
    if given_head is not None:
        model.lm_head.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype))
    if cfg.folds_head:  # (new tensors: a tied embedding and lm_head part here)
        if given_head is not None:
            raise ModelLoadError("a pre-quantized lm_head with logits_scaling is not supported")
        head, embed = model.lm_head, model.model.embed_tokens
        head.weight = torch.nn.Parameter(head.weight.data / cfg.logits_scaling,
                                         requires_grad=False)
        embed.weight = torch.nn.Parameter(embed.weight.data * cfg.embedding_multiplier,
                                          requires_grad=False)
    if shard is not None:
        shard.shard_vocab(model)
    if quantization is not None or given_head is not None:
        quantize_head(model, quantization, dtype, given_head)
    progress.update()
    on_meta = [name for name, p in model.named_parameters() if p.is_meta]
    if on_meta:
        raise ModelLoadError(f"checkpoint left {len(on_meta)} parameter(s) unset, e.g. "
                             f"{on_meta[:3]}")


def load_extra_layer(model_dir: Path, cfg: ModelConfig, stored: int, layer: torch.nn.Module,
                     dtype: torch.dtype, quantization: QuantConfig | None,
                     extra_names: Collection[str]) -> dict[str, Tensor]:
    """Fill `layer` (a decoder layer built from `cfg`, a one-layer config) from the stored
    layer `model.layers.<stored>.` (a checkpoint's next-token layer, stored after the
    decoder's), quantized as asked; return that layer's tensors named in `extra_names` (its
    own parts outside the decoder layer), in `dtype`. Ones outside both are not read."""
    if read_quant_spec(json.loads((model_dir / "config.json").read_text())) is not None:
        raise ModelLoadError("the next-token layer of a pre-quantized checkpoint is not "
                             "supported: load the unquantized one with quantization=")
    prefix = f"model.layers.{stored}."
    rename = functools.partial(usual_name, cfg.architecture) \
        if cfg.architecture in STORED_NAMES else None
    tensors = _read_tensors(tensor_names(checkpoint_files(model_dir)),
                            lambda name: name.startswith(prefix), rename)
    if not tensors:
        raise ModelLoadError(f"checkpoint has no tensors under {prefix}")
    extra = {name: tensors.pop(prefix + name).to(dtype) for name in extra_names
             if prefix + name in tensors}
    decoder_parts = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.",
                     "post_feedforward_layernorm.")
    own = {"model.layers.0." + name.removeprefix(prefix): t for name, t in tensors.items()
           if name.removeprefix(prefix).startswith(decoder_parts)}
    expected = {f"model.layers.0.{k}": v for k, v in layer.state_dict().items()}
    state = _checked(_to_model_names(cfg, own, [0]), expected, dtype)
    layer.load_state_dict({k.removeprefix("model.layers.0."): v for k, v in state.items()},
                          assign=True, strict=False)
    _fold_residual(layer, cfg.residual_multiplier, {})
    if cfg.rope_interleave and not cfg.mla:
        _fold_rope_interleave(layer, cfg, {})
    if quantization is not None:
        quantize_layer(layer, quantization, dtype, {}, stored)  # type: ignore[arg-type]
    return extra


def _fold_residual(layer: torch.nn.Module, multiplier: float, given: dict[str, list]) -> None:
    """Granite-MoE's residual multiplier folded into the weights that end each residual branch
    (o_proj; down of the MLP, of the routed experts and of a shared expert), plain or handed
    over quantized (`given`: their scales): the branch's output comes out already scaled."""
    if multiplier == 1.0:
        return
    for name in ("self_attn.o_proj", "mlp.down_proj", "mlp.shared_expert.down_proj", "mlp.w2"):
        for values in given.get(name, []):
            if isinstance(values, Mxfp4Values):  # (its scales are powers of two)
                raise ModelLoadError("MXFP4 weights with a residual_multiplier are not supported")
            values.scale = values.scale * multiplier
    mlp = layer.get_submodule("mlp")
    ends: list[torch.nn.Module] = [layer.get_submodule("self_attn.o_proj")]
    ends += [mlp.get_submodule("down_proj")] if hasattr(mlp, "down_proj") else []
    if getattr(mlp, "shared_expert", None) is not None:
        ends.append(mlp.get_submodule("shared_expert.down_proj"))
    with torch.no_grad():
        for linear in ends:
            for name in ("weight", "bias"):
                t = getattr(linear, name, None)
                if t is not None and t.numel():  # (empty: handed over quantized)
                    t.mul_(multiplier)
        for name in ("w2", "b2"):
            t = getattr(mlp, name, None)
            if t is not None and t.numel():
                t.mul_(multiplier)


def _fold_rope_interleave(layer: torch.nn.Module, cfg: ModelConfig, given: dict[str, list]
                          ) -> None:
    """Rotary over interleaved pairs (Ernie 4.5: dims 2i and 2i + 1 turn together) folded into
    the q and k rows of qkv_proj, plain or handed over quantized (QuantValues: their rows):
    each head's rotary dims reordered evens then odds, so attention's rotate-half turns the same
    pairs; q and k move alike, so their dot products, and attention, are unchanged."""
    hd, rot = cfg.head_dim, cfg.rotary_dim
    within = torch.cat([torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, hd)])
    heads = torch.arange(cfg.num_heads + 2 * cfg.num_kv_heads)
    order = (heads.unsqueeze(1) * hd + torch.where(
        heads.unsqueeze(1) < cfg.num_heads + cfg.num_kv_heads, within, torch.arange(hd))).flatten()
    if any(name.startswith("self_attn.") and name not in ("self_attn.qkv_proj", "self_attn.o_proj")
           for name in given):
        raise ModelLoadError("interleaved rotary over these quantized q/k projections is not "
                             "supported")
    for values in given.get("self_attn.qkv_proj", []):
        if not isinstance(values, QuantValues):
            raise ModelLoadError(f"interleaved rotary over {type(values).__name__} q/k "
                                 f"projections is not supported")
        values.q, values.scale = values.q[order], values.scale[order]
        values.zero = None if values.zero is None else values.zero[order]
    qkv = layer.get_submodule("self_attn.qkv_proj")
    with torch.no_grad():
        for name in ("weight", "bias"):
            t = getattr(qkv, name, None)
            if t is not None and t.numel():  # (empty: handed over quantized)
                t.copy_(t[order])


def _layer_tensors(prefix: str, skip_experts: bool) -> Callable[[str], bool]:
    return lambda name: name.startswith(prefix) and not (skip_experts and bool(EXPERT.match(name)))


def _expert_names(cfg: ModelConfig, layer: int, names: dict[Path, list[str]],
                  config: QuantConfig) -> dict[tuple[int, str], tuple[Path, str]] | None:
    """One layer's per-expert HF weights by (expert, role) -> (file, name), when every one is
    stored on its own and fits `config`; else None (stored stacked, or a shape that does not
    fit)."""
    try:
        found = {(int(m[2]), ROLE[m[3]]): (path, name, entry.shape)
                 for path, in_file in names.items()
                 for name, entry in safetensors_io.header(path).items()
                 if (m := EXPERT.match(name)) and int(m[1]) == layer and name in in_file}
    except (OSError, safetensors_io.SafetensorsError) as exc:
        raise ModelLoadError(f"corrupt or unreadable safetensors file ({exc})") from exc
    if not config.takes(f"model.layers.{layer}.mlp.experts"):
        return None  # (quant_skip: read with the layer, as stored)
    if len(found) != 3 * cfg.num_experts or not all(config.fits(shape)
                                                    for _, _, shape in found.values()):
        return None
    return {key: (path, name) for key, (path, name, _) in found.items()}


def _quantize_experts_as_read(cfg: ModelConfig, found: dict[tuple[int, str], tuple[Path, str]],
                              config: QuantConfig) -> dict[str, list[QuantValues]]:
    """One layer's per-expert HF weights (`_expert_names`) read and quantized one expert at a
    time, each original dropped (and its memory given back) before the next is read: no
    full-precision copy of the layer's experts is ever held."""

    def read(e: int, role: str) -> Tensor:
        path, name = found[(e, role)]
        try:
            return safetensors_io.read(path, [name])[name]
        except (OSError, safetensors_io.SafetensorsError) as exc:
            raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file ({exc})"
                                 ) from exc

    w13, w2 = [], []
    for e in range(cfg.num_experts):
        w13.append(quantize(torch.cat([read(e, "gate"), read(e, "up")]), config))
        w2.append(quantize(read(e, "down"), config))
        _return_freed_memory()
    return {"mlp.w13": w13, "mlp.w2": w2}


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc
        return None


def _return_freed_memory() -> None:
    """Give the heap's free pages back to the OS (glibc keeps them otherwise, and the layer's
    full-precision copies would stay in the process's RSS after they are freed)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _drop_covered(layer: torch.nn.Module, covered: set[str], prefix: str,
                  dtype: torch.dtype) -> None:
    """Parameters that come quantized get an empty placeholder (they are replaced next)."""
    for name in covered:
        parent_name, _, attr = name.removeprefix(prefix).rpartition(".")
        parent = layer.get_submodule(parent_name)
        shape = getattr(parent, attr).shape
        setattr(parent, attr, torch.nn.Parameter(torch.empty(0, *shape[1:], dtype=dtype),
                                                 requires_grad=False))


# What an engine (or a rank of one) loads, from its EngineConfig

def model_directory(model: str) -> Path:
    """A built-in model's name (`tiny-moe`) or a checkpoint directory."""
    path = models.resolve_model(model)
    if path is None:
        raise ModelLoadError(f"model {model!r} is neither a built-in model nor a directory")
    return path


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(config: EngineConfig) -> torch.dtype:
    """The dtype the engine computes in: auto is bfloat16 where the CPU has native bf16 math."""
    if config.dtype == "auto":
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    return _DTYPES[config.dtype]


def quant_config(config: EngineConfig) -> QuantConfig | None:
    if config.quantization is None:
        return None
    attention = config.quant_attention
    if attention == "auto":
        attention = ATTENTION_BY_METHOD.get(config.quantization, "same")
    return QuantConfig(config.quantization, config.quant_group_size, config.quant_symmetric,
                       config.quantize_lm_head, config.quant_skip, attention)


def load_weights(model_dir: str | Path, dtype: torch.dtype, config: EngineConfig,
                 shard: TPShard | None = None) -> CausalLM:
    """The model as one rank holds it: loaded (its tensor-parallel shard, if any), quantized
    and prepacked as the config says."""
    model = load_model(model_dir, dtype, quant_config(config), shard,
                       show_progress=config.show_progress and shard is None)
    if config.prepack_weights:
        prepack_model(model, dtype, fuse_experts=config.expert_parallel_size == 1)
    return model
