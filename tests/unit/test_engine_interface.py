"""Services see the engine only through services/engine_api.py's ServingEngine: they import
nothing of the engine but its constructor and config, name no engine member the interface does
not declare, and both engines provide every member it declares."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from evenflow.engine.api.mock import MockEngine
from evenflow.engine.serving.engine import Engine, StepOutput
from evenflow.services.engine_api import EngineOutput, ServingEngine

PACKAGE = Path(__file__).resolve().parents[2] / "evenflow"
SERVICE_DIRS = ["services", "prefill", "decode", "kv_index", "balancer", "gateway"]
# the constructor, the config and the registry of its process-wide switches
# (engine/config/settings.py)
ENGINE_CONSTRUCTION = {"create_engine", "EngineConfig", "ENGINE_SWITCHES", "check_engine_switch"}


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


def test_services_name_only_interface_members():
    allowed = protocol_members(ServingEngine)
    for package in SERVICE_DIRS:
        for path in (PACKAGE / package).rglob("*.py"):
            used = engine_member_uses(ast.parse(path.read_text()))
            assert used <= allowed, f"{package}/{path.name} uses {used - allowed}"


def test_both_engines_implement_the_interface():
    for engine in (Engine, MockEngine):
        missing = {m for m in protocol_members(ServingEngine) if not hasattr(engine, m)
                   and m not in inspect.signature(engine.__init__).parameters
                   and m not in ("max_model_len", "placement_version")}  # set in __init__
        assert not missing, f"{engine.__name__} lacks {missing}"
    fields = set(StepOutput.__dataclass_fields__)
    assert protocol_members(EngineOutput) <= fields
