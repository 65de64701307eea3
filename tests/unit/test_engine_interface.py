"""Services see the engine only through services/engine_api.py's ServingEngine: they import
nothing of the engine but its constructor and config, name no engine member the interface does
not declare, and both engines provide every member it declares."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

from evenflow.engine.api.mock import MockEngine, MockKernels
from evenflow.engine.dep.lockstep import LockstepPlacement
from evenflow.engine.serving.engine import Engine, StepOutput
from evenflow.engine.serving.engine import EngineLayout as RealLayout
from evenflow.engine.serving.kernel_switch import KernelSwitch
from evenflow.engine.serving.placement_control import ExpertPlacement
from evenflow.engine.serving.prefix_transfer import PrefixCache
from evenflow.engine.serving.profiling import ProfileControl
from evenflow.services.engine_api import EngineLayout, EngineOutput, ServingEngine

PACKAGE = Path(__file__).resolve().parents[2] / "evenflow"
SERVICE_DIRS = ["services", "prefill", "decode", "kv_index", "balancer", "gateway"]
# the constructor, the config and the registry of its process-wide switches
# (engine/config/settings.py)
ENGINE_CONSTRUCTION = {"build_engine", "EngineConfig", "ENGINE_SWITCHES", "check_engine_switch"}


# each port of the seam, and the engines' parts that implement it
PARTS = {"prefix": [PrefixCache], "placement": [ExpertPlacement, LockstepPlacement],
         "profile": [ProfileControl], "kernels": [KernelSwitch, MockKernels]}


def protocol_members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


def test_services_import_only_the_engine_constructor_and_config():
    for package in SERVICE_DIRS:
        for path in (PACKAGE / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if node_module(node) == "evenflow.engine.config.fields":
                    continue  # how settings are declared (torch-free), the mesh's too
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                        "evenflow.engine"):
                    names = {a.name for a in node.names}
                    assert names <= ENGINE_CONSTRUCTION, f"{package}/{path.name} imports {names}"
                elif isinstance(node, ast.Import):
                    assert not any(a.name.startswith("evenflow.engine") for a in node.names)


def node_module(node: ast.AST) -> str:
    return (node.module or "") if isinstance(node, ast.ImportFrom) else ""


def engine_member_uses(tree: ast.AST) -> set[str]:
    """Attributes read off anything called `engine` (self.engine.x, engine.x)."""
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            target = node.value
            name = target.attr if isinstance(target, ast.Attribute) else (
                target.id if isinstance(target, ast.Name) else None)
            if name in ("engine", "_engine"):
                used.add(node.attr)
    return used


def port_member_uses(tree: ast.AST) -> dict[str, set[str]]:
    """Attributes read off an engine's part (engine.prefix.x, self.engine.layout.x), by part."""
    used: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            owner = node.value.value
            name = owner.attr if isinstance(owner, ast.Attribute) else (
                owner.id if isinstance(owner, ast.Name) else None)
            if name in ("engine", "_engine"):
                used.setdefault(node.value.attr, set()).add(node.attr)
    return used


def test_services_name_only_interface_members():
    allowed = protocol_members(ServingEngine)
    for package in SERVICE_DIRS:
        for path in (PACKAGE / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            used = engine_member_uses(tree)
            assert used <= allowed, f"{package}/{path.name} uses {used - allowed}"
            for port, members in port_member_uses(tree).items():
                hint = typing.get_type_hints(ServingEngine.__dict__[port].fget)["return"]
                extra = members - protocol_members(hint)
                assert not extra, f"{package}/{path.name} uses {port}.{extra}"


def has_member(cls: type, name: str) -> bool:
    """A class attribute, or one its (or a base's) __init__ sets."""
    return hasattr(cls, name) or any(
        f"self.{name} =" in inspect.getsource(base) or f", self.{name} =" in inspect.getsource(base)
        for base in cls.__mro__[:-1])


def test_both_engines_implement_the_interface():
    for engine in (Engine, MockEngine):
        members = protocol_members(ServingEngine) - PARTS.keys() - {"layout"}
        missing = {m for m in members if not hasattr(engine, m)}
        assert not missing, f"{engine.__name__} lacks {missing}"
    for port, implementations in PARTS.items():
        wanted = protocol_members(typing.get_type_hints(ServingEngine.__dict__[port].fget)[
            "return"])
        for cls in implementations:
            missing = {m for m in wanted if not has_member(cls, m)}
            assert not missing, f"{cls.__name__} lacks {missing}"
    layout = set(RealLayout.__dataclass_fields__) | set(dir(RealLayout))
    assert protocol_members(EngineLayout) <= layout
    fields = set(StepOutput.__dataclass_fields__)
    assert protocol_members(EngineOutput) <= fields


def test_the_serving_seam_is_a_small_core_and_a_port_per_part():
    """The core a worker drives stays small; everything else is a part with its own port."""
    assert len(protocol_members(ServingEngine)) <= 20
    for port in PARTS:
        hint = typing.get_type_hints(ServingEngine.__dict__[port].fget)["return"]
        assert len(protocol_members(hint)) <= 8, port
