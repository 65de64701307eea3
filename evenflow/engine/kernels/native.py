"""The engine's own C++ kernels (engine/kernels/*.cpp): built at first use on the machine that
runs them (-march=native: AVX-512 where the CPU has it, AVX2 elsewhere) and registered as torch
ops under `torch.ops.evenflow_kernels`.

EVENFLOW_NATIVE_MARCH=haswell (any GCC -march value) builds them for another instruction set
than this CPU's: with oneDNN and ATen held to AVX2 too (ONEDNN_MAX_CPU_ISA=AVX2,
ATEN_CPU_CAPABILITY=avx2), an AVX-512 machine runs an AVX2 machine's code paths (not its caches
or memory) — how `evenflow bench engine` is measured for AVX2 here.

A build takes ~90 s on 2 cores once per machine, source and torch version; the result is kept
in ~/.cache/evenflow/kernels/<key> (kernels/native_build.py), and a file lock makes processes
starting together wait for one build. Without a C++ compiler, or with EVENFLOW_NATIVE_KERNELS=0,
`ops()` is None and callers keep torch's kernels: the native ones are a speed-up, never a
requirement.

With EVENFLOW_NATIVE_BUILD=background (`evenflow up` on a machine's first start builds them in
a process of its own meanwhile), `ops()` is None until that build is done, without waiting for
it: `pending()` says so, and once `is_built()` an idle engine calls `refresh()` and reloads
its weights onto the native kernels (Engine.switch_kernels_when_ready).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

import torch

from evenflow.engine.config.settings import engine_switch, switched_on
from evenflow.engine.kernels.native_build import (
    LIBRARY,
    SOURCES,
    TYPICAL_BUILD_S,
    build_dir,
    build_failed,
    build_lock,
    is_built,
    march,
    mark_ready,
)

log = logging.getLogger(__name__)

def enabled() -> bool:
    return switched_on("EVENFLOW_NATIVE_KERNELS")


def in_background() -> bool:
    """EVENFLOW_NATIVE_BUILD=background: another process builds; torch serves meanwhile."""
    mode = engine_switch("EVENFLOW_NATIVE_BUILD")
    if mode not in ("wait", "background"):
        raise ValueError(f"EVENFLOW_NATIVE_BUILD must be wait or background, not {mode!r}")
    return mode == "background"


def pending() -> bool:
    """Whether this process serves on torch's kernels while another builds the native ones."""
    return enabled() and in_background() and ops() is None and not _given_up and \
        not build_failed()


_given_up = False  # a background build's library failed to load here: torch's for good


def refresh() -> None:
    """Forget every answer about the kernels (each function here caches its own): the next
    call loads a build finished since (kernels/plan.py's forget_choices drops the plans
    measured without them)."""
    for value in list(globals().values()):
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the ninja wheel's copy is there only in an activated venv."""
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR


@functools.cache
def ops() -> Any | None:
    """torch.ops.evenflow_kernels, built or loaded; None when disabled or unbuildable."""
    if not enabled() or (in_background() and not is_built()):
        return None
    try:
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        where = build_dir()
        started = time.perf_counter()
        with build_lock(where) as waited:
            if waited:
                log.info("native kernels: waited %.0f s for another process's build",
                         time.perf_counter() - started)
            elif not is_built():
                log.info("building the native kernels for this machine (~%d s, once)",
                         TYPICAL_BUILD_S)
            # torch's own baton file: a build killed midway (Ctrl-C during a first start)
            # leaves it, and torch then waits for it forever. Holding our lock, no other
            # process builds here, so one found now is stale.
            (where / "lock").unlink(missing_ok=True)
            cpp_extension.load(
                name=LIBRARY, sources=[str(s) for s in SOURCES],
                build_directory=str(where), is_python_module=False, verbose=False,
                # -fopenmp: at::parallel_for is OpenMP in torch's build; the extension then
                # shares torch's libgomp (same soname, already loaded) and its threads
                extra_cflags=["-O3", f"-march={march()}", "-fno-math-errno", "-fopenmp"],
                extra_ldflags=["-fopenmp"])
            mark_ready(where)
        took = time.perf_counter() - started
        if took > 2.0 and not waited:
            log.info("native kernels built in %.0f s (%s)", took, where)
        return torch.ops.evenflow_kernels
    except Exception as exc:  # no compiler, no ninja, a failed build: torch's kernels serve
        global _given_up
        _given_up = True
        log.warning("native kernels unavailable, using torch's: %s",
                    str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
        return None


@functools.cache
def norms() -> Any | None:
    """The fused RMSNorm kernels (kernels/norm.cpp: rms_norm, add_rms_norm), or None: no native
    kernels, or EVENFLOW_NATIVE_NORM=0 (torch's rms_norm and a separate residual add)."""
    kernels = ops() if switched_on("EVENFLOW_NATIVE_NORM") else None
    return kernels if kernels is not None and hasattr(kernels, "add_rms_norm") else None


@functools.cache
def rotary_kv_write() -> Any | None:
    """The decode step's fused rotary + KV-cache write (kernels/rotary.cpp), or None: no native
    kernels, or EVENFLOW_NATIVE_ROTARY=0 (torch's multiplies, roll and index_copy_)."""
    kernels = ops() if switched_on("EVENFLOW_NATIVE_ROTARY") else None
    return None if kernels is None else getattr(kernels, "rotary_kv_write", None)


@functools.cache
def decode_attention() -> Any | None:
    """The paged decode attention kernel (kernels/paged_attention.cpp), or None: no native
    kernels, or EVENFLOW_NATIVE_ATTENTION=0 (torch's gather + scaled_dot_product_attention)."""
    if not switched_on("EVENFLOW_NATIVE_ATTENTION"):
        return None
    kernels = ops()
    return None if kernels is None else getattr(kernels, "paged_decode_attention", None)


@functools.cache
def mla_decode() -> Any | None:
    """MLA's absorbed decode over the paged latent cache in one call (kernels/mla_decode.cpp:
    mla_decode, mla_decode_int8), or None: no native kernels, or EVENFLOW_NATIVE_MLA=0 (torch's
    bmm's, gather and scaled_dot_product_attention: engine/model/mla.py)."""
    kernels = ops() if switched_on("EVENFLOW_NATIVE_MLA") else None
    return kernels if kernels is not None and hasattr(kernels, "mla_decode") else None


# MLA's latent widths the kernel takes: kv_lora_rank and kv_lora_rank + rope, multiples of this
MLA_LANES = 16


def mla_decode_serves(rank: int, rope: int) -> bool:
    """Whether MLA decode with this latent (kv_lora_rank, rope dims) runs the native kernel."""
    if mla_decode() is None:
        return False
    if rank % MLA_LANES or (rank + rope) % MLA_LANES:
        falls_back("MLA decode", f"kv_lora_rank {rank} + rope {rope} is not in multiples of "
                   f"{MLA_LANES}")
        return False
    return True


@functools.cache
def prefill_attention() -> Any | None:
    """The causal prefill attention over the paged cache (kernels/prefill_attention.cpp), or
    None: no native kernels, or EVENFLOW_NATIVE_PREFILL_ATTENTION=0 (torch's
    scaled_dot_product_attention)."""
    kernels = ops() if switched_on("EVENFLOW_NATIVE_PREFILL_ATTENTION") else None
    return None if kernels is None else getattr(kernels, "prefill_attention", None)


@functools.cache
def falls_back(kernel: str, reason: str) -> None:
    """Say once per process that a shape takes torch's path instead of a native kernel."""
    log.info("%s: %s, torch's path serves it", kernel, reason)


# The paged decode attention's float32 lanes: it takes head dims that are a multiple of this.
DECODE_ATTENTION_LANES = 16


def decode_attention_serves(head_dim: int) -> bool:
    """Whether the paged decode attention (when built) takes heads of this size."""
    if head_dim % DECODE_ATTENTION_LANES == 0:
        return True
    falls_back("paged decode attention",
               f"head_dim {head_dim} is not a multiple of {DECODE_ATTENTION_LANES}")
    return False


@functools.lru_cache(maxsize=64)
def prefill_attention_serves(dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether the prefill attention kernel takes this dtype and head shape here: AVX-512 builds
    (its register blocks are the panel kernels'; AVX2 builds keep torch's flash kernel), bf16
    only with AVX512-BF16's dot product, head dims a multiple of 64 up to 256, at most 64 query
    heads a KV head."""
    if prefill_attention() is None or not built_for_avx512():
        return False
    if head_dim % 64 or head_dim > 256 or group > 64:
        falls_back("prefill attention", f"head_dim {head_dim} with {group} queries per KV head "
                   f"is not a multiple of 64 up to 256 with at most 64")
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.evenflow_kernels.fused_moe_bf16_supported())
    return dtype == torch.float32


@functools.cache
def kv_blocks() -> Any | None:
    """The K/V hand-off's block copies (kernels/kv_blocks.cpp: kv_blocks_read / kv_blocks_write),
    or None: no native kernels, or EVENFLOW_NATIVE_KV_BLOCKS=0 (torch's index_select and
    index_copy_ per layer)."""
    kernels = ops() if switched_on("EVENFLOW_NATIVE_KV_BLOCKS") else None
    return kernels if kernels is not None and hasattr(kernels, "kv_blocks_write") else None


@functools.cache
def kv_int8() -> Any | None:
    """The int8 KV cache's kernels (kernels/kv_quant.cpp's kv_write_int8, paged_attention.cpp's
    paged_decode_attention_int8), or None: no native kernels, or EVENFLOW_NATIVE_KV_INT8=0
    (engine/model/kv_quant.py's torch write and dequantizing gather)."""
    kernels = ops() if switched_on("EVENFLOW_NATIVE_KV_INT8") else None
    return kernels if kernels is not None and hasattr(kernels, "kv_write_int8") else None


@functools.cache
def built_for_avx512() -> bool:
    """Whether the kernels were built for AVX-512 (the panel and attention loops need its 32
    registers; built for AVX2 they lose to torch's and oneDNN's paths)."""
    kernels = ops()
    return kernels is not None and bool(kernels.panel_kernels_fast())


@functools.cache
def w8a8_supported() -> bool:
    """Whether the panel kernels were built with VNNI's integer dot product (w8a8 panels:
    engine/kernels/panel_quant.h)."""
    kernels = ops()
    return kernels is not None and bool(kernels.w8a8_supported())


@functools.cache
def panels_f32_fast() -> bool:
    """Whether the float32 panel kernels beat oneDNN here: AVX-512 builds, and AVX2 builds with
    their own 8-float kernel (kernels/panel.h: panel_f32_avx2)."""
    kernels = ops()
    return kernels is not None and bool(kernels.panel_kernels_f32_fast())


@functools.lru_cache(maxsize=64)
def decode_attention_registers(head_dim: int, group: int) -> bool:
    """Whether the paged decode attention keeps this head shape in registers (AVX-512 builds:
    then it beats torch's gathered attention at any batch size)."""
    kernels = ops()
    return kernels is not None and bool(kernels.paged_attention_registers(head_dim, group))


_rows_invariant_holds = 0  # deterministic engines alive in this process (AMX tiles off)


def amx_tiles() -> bool:
    """Whether the bf16 panel kernels (linears from 2 rows, fused experts, prefill attention)
    run on AMX tiles (kernels/panel_amx.h): built for a CPU with AMX, permitted by the kernel,
    and not switched off (EVENFLOW_NATIVE_AMX=0, or a deterministic engine alive:
    `hold_rows_invariant`)."""
    kernels = ops()
    if kernels is None or not hasattr(kernels, "amx_tiles"):
        return False
    if not switched_on("EVENFLOW_NATIVE_AMX"):
        kernels.set_amx_tiles(False)
    return bool(kernels.amx_tiles())


def hold_rows_invariant() -> None:
    """While held (by each deterministic engine, until `release_rows_invariant`), every panel
    kernel in this process computes a row the same way whatever its call's row count: no AMX
    tiles (deterministic mode's batch invariance; the switch is process-wide)."""
    global _rows_invariant_holds
    kernels = ops()
    if kernels is not None and hasattr(kernels, "set_amx_tiles"):
        _rows_invariant_holds += 1
        kernels.set_amx_tiles(False)


def release_rows_invariant(everyone: bool = False) -> None:
    """One hold released (`everyone`: all of them, for tests); the last one gives the tiles
    back unless EVENFLOW_NATIVE_AMX=0."""
    global _rows_invariant_holds
    if _rows_invariant_holds == 0:
        return
    _rows_invariant_holds = 0 if everyone else _rows_invariant_holds - 1
    kernels = ops()
    if _rows_invariant_holds == 0 and kernels is not None:
        kernels.set_amx_tiles(switched_on("EVENFLOW_NATIVE_AMX"))


@functools.cache
def fused_moe() -> Any | None:
    """The fused routed-experts kernel (kernels/fused_moe.cpp), or None: no native kernels, or
    EVENFLOW_NATIVE_MOE=0 (the per-expert loop over oneDNN-packed weights)."""
    kernels = ops() if switched_on("EVENFLOW_NATIVE_MOE") else None
    return None if kernels is None else getattr(kernels, "fused_moe", None)


@functools.cache
def panel_linear() -> Any | None:
    """The dense linear over panel-packed weights (kernels/panel_linear.cpp), or None: no native
    kernels, or EVENFLOW_NATIVE_LINEAR=0 (oneDNN's packed linear)."""
    kernels = ops() if switched_on("EVENFLOW_NATIVE_LINEAR") else None
    return None if kernels is None else getattr(kernels, "panel_linear", None)


@functools.cache
def route_topk() -> Any | None:
    """MoE routing in one call (kernels/routing.cpp), or None: no native kernels, or
    EVENFLOW_NATIVE_ROUTING=0 (torch's softmax, topk and bincount)."""
    kernels = ops() if switched_on("EVENFLOW_NATIVE_ROUTING") else None
    return None if kernels is None else getattr(kernels, "route_topk", None)


# Each switchable kernel: its name in summaries, its switch, and the function that serves it.
_KERNELS = (("norm", "EVENFLOW_NATIVE_NORM", norms),
            ("rotary", "EVENFLOW_NATIVE_ROTARY", rotary_kv_write),
            ("decode_attention", "EVENFLOW_NATIVE_ATTENTION", decode_attention),
            ("mla_decode", "EVENFLOW_NATIVE_MLA", mla_decode),
            ("prefill_attention", "EVENFLOW_NATIVE_PREFILL_ATTENTION", prefill_attention),
            ("kv_blocks", "EVENFLOW_NATIVE_KV_BLOCKS", kv_blocks),
            ("kv_int8", "EVENFLOW_NATIVE_KV_INT8", kv_int8),
            ("moe", "EVENFLOW_NATIVE_MOE", fused_moe),
            ("linear", "EVENFLOW_NATIVE_LINEAR", panel_linear),
            ("routing", "EVENFLOW_NATIVE_ROUTING", route_topk))


def summary() -> str:
    """Which kernels are native here and which are torch's, and why (one line, for logs)."""
    if not enabled():
        return "torch kernels only (EVENFLOW_NATIVE_KERNELS=0)"
    if pending():
        return "torch kernels only until the native ones are built (building in the background)"
    if ops() is None:
        return "torch kernels only (the native kernels could not be built)"
    native_ones, torch_ones = [], []
    for name, switch, serves in _KERNELS:
        if serves() is not None:
            native_ones.append(name)
        else:
            torch_ones.append(f"{name} ({switch}=0)" if not switched_on(switch) else name)
    tiles = " (bf16 panels on AMX tiles)" if amx_tiles() else ""
    line = f"native kernels (-march={march()}){tiles}: {', '.join(native_ones) or 'none'}"
    return line + (f"; torch's: {', '.join(torch_ones)}" if torch_ones else "")
