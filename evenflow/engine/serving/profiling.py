"""Operator-level profiles of the engine: record_function ranges per component (attention, MoE
or MLP, norms, embedding + lm_head) put around modules by forward hooks while profiling only,
the top operators by self CPU time, and the share of time in copies and layout changes (the
fusion candidates). Used by `evenflow profile` (offline) and by a worker asked over the mesh
(POST /admin/profile at the gateway: `StepProfiler` over the worker's next N steps)."""

from __future__ import annotations

from typing import Any

COPY_OPS = ("aten::copy_", "aten::index_select", "aten::cat", "aten::contiguous", "aten::clone",
            "aten::_to_copy", "aten::index", "aten::index_copy_", "aten::index_put_",
            "aten::stack", "aten::gather", "aten::scatter_add_", "aten::index_add_")
COMPONENTS = ("attention", "moe", "mlp", "norm", "embed+lm_head", "sampler")


def _label(module) -> str | None:
    from evenflow.engine.model.attention import Attention
    from evenflow.engine.model.mlp import MLP
    from evenflow.engine.model.moe import MoE
    from evenflow.engine.model.norm import LayerNorm, RMSNorm

    if isinstance(module, Attention):
        return "attention"
    if isinstance(module, MoE):
        return "moe"
    if isinstance(module, MLP):
        return "mlp"
    if isinstance(module, RMSNorm | LayerNorm):
        return "norm"
    return None


def instrument(model) -> list:
    """Forward hooks that open a record_function range per component (removed after)."""
    handles: list = []
    if model is None:  # an engine without a torch model (the mock engine)
        return handles
    for module in model.modules():
        label = _label(module)
        if label is not None:
            handles += _range_hooks(module, label)
    embed = getattr(model.model, "embed_tokens", None)
    if embed is not None:
        handles += _range_hooks(embed, "embed+lm_head")
    handles += _range_hooks(model.lm_head, "embed+lm_head")
    return handles + [_SamplerRange()]


class _SamplerRange:
    """The runner's sampling call inside a "sampler" range while profiling (the module's
    `sample` swapped for a wrapper; remove() puts it back): no cost when not profiling."""

    def __init__(self) -> None:
        from torch.profiler import record_function

        from evenflow.engine.runners import model_runner as runner

        self.original = original = runner.sample

        def sample_in_range(*args, **kwargs):
            with record_function("sampler"):
                return original(*args, **kwargs)

        runner.sample = sample_in_range  # type: ignore[assignment]

    def remove(self) -> None:
        from evenflow.engine.runners import model_runner as runner

        runner.sample = self.original  # type: ignore[assignment]


def _range_hooks(module, label: str) -> list:
    from torch.profiler import record_function

    ranges: list = []

    def enter(_m, _args):
        ranges.append(record_function(label))
        ranges[-1].__enter__()

    def leave(_m, _args, _out):
        ranges.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]


def report(prof, phase: str, steps: int, top: int) -> list[str]:
    averages = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in averages)
    by_name = {e.key: e for e in averages}
    lines = [f"{phase}: {total_us / 1e3 / steps:.2f} ms of CPU time per step ({steps} step(s))"]
    parts = []
    for name in COMPONENTS:
        event = by_name.get(name)
        if event is not None and event.cpu_time_total:
            parts.append(f"{name} {100 * event.cpu_time_total / total_us:.0f}%")
    if parts:
        lines.append("  by component (inclusive): " + ", ".join(parts))
    ops = sorted((e for e in averages if e.key not in COMPONENTS),
                 key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    lines.append(f"  {'operator':48} {'self ms/step':>12} {'share':>6} {'calls/step':>10}")
    for e in ops:
        lines.append(f"  {e.key[:48]:48} {e.self_cpu_time_total / 1e3 / steps:12.3f} "
                     f"{100 * e.self_cpu_time_total / total_us:5.1f}% {e.count / steps:10.1f}")
    copies = sum(by_name[n].self_cpu_time_total for n in COPY_OPS if n in by_name)
    names = ", ".join(n.removeprefix("aten::") for n in COPY_OPS[:6])
    lines.append(f"  copies and layout changes ({names}, ...): {100 * copies / total_us:.1f}% "
                 "of the step")
    return lines


class StepProfiler:
    """torch.profiler over the steps between start() and stop(), with component ranges."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._prof: Any = None
        self._hooks: list = []

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._hooks = instrument(self.model)
        self._prof = profile(activities=[ProfilerActivity.CPU])
        self._prof.__enter__()

    def stop(self, steps: int, trace_file: str = "", phase: str = "steps",
             top: int = 25) -> list[str]:
        """The operator table over `steps` steps (text lines, headed `phase`); the trace
        written if asked."""
        prof, self._prof = self._prof, None
        try:
            prof.__exit__(None, None, None)
        finally:
            for handle in self._hooks:
                handle.remove()
            self._hooks = []
        if trace_file:
            prof.export_chrome_trace(trace_file)
        if steps == 0:
            return ["no step ran while profiling"]
        return report(prof, phase, steps, top)


class ProfileControl:
    """The engine's operator profiles (a part Engine holds, `engine.profile`)."""

    def __init__(self, owner: object) -> None:
        self._owner = owner  # its `model` (none in the mock engine), read when a profile starts
        self._profiler: StepProfiler | None = None

    @property
    def running(self) -> bool:
        return self._profiler is not None

    def start(self) -> None:
        """torch.profiler over the steps until stop (component ranges included)."""
        self._profiler = StepProfiler(getattr(self._owner, "model", None))
        self._profiler.start()

    def stop(self, steps: int, trace_file: str = "", phase: str = "steps",
             top: int = 25) -> list[str]:
        """The operator table over those `steps` steps; the Chrome trace written if asked."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return ["no profile was running"]
        return profiler.stop(steps, trace_file, phase, top)
