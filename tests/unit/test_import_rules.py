"""The import DAG of DESIGN.md: proto imports nothing of ours; engine only proto, parallel and
torch; parallel only torch; services never import engine; the gateway never imports torch or
the engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "evenflow"
SERVICES = ["gateway", "prefill", "decode", "kv_index", "balancer", "planner"]
ALLOWED = {
    "proto": set(),
    "engine": {"proto", "parallel"},
    "parallel": set(),
    "services": {"proto"},
    "gateway": {"proto", "services", "kv_index"},
    "prefill": {"proto", "services", "engine"},
    "decode": {"proto", "services", "engine"},
    "kv_index": {"proto", "services"},
    "balancer": {"proto", "services"},
    "planner": {"proto", "services"},
}


def imports_of(package: str) -> set[tuple[str, str]]:
    found = set()
    for path in (PACKAGE / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                found.add((path.name, name))
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_follow_the_dag(package):
    for filename, name in imports_of(package):
        parts = name.split(".")
        if parts[0] == "evenflow" and len(parts) > 1 and parts[1] != package:
            # Torch-free leaves anyone may use: evenflow.models (checkpoint lookup),
            # evenflow.progress (a stderr progress bar; it imports nothing of ours) and the
            # engine's settings (evenflow.engine.config: the one source of engine defaults).
            if name == "evenflow.engine.config" or name.startswith("evenflow.engine.config."):
                continue
            assert parts[1] in ALLOWED[package] | {"models", "progress"}, \
                f"{package}/{filename} imports {name}"


def test_nothing_imports_the_deploy_code():
    for package in ALLOWED:
        for filename, name in imports_of(package):
            assert not name.startswith("evenflow.rayserve"), f"{package}/{filename} imports {name}"


def test_gateway_never_imports_torch():
    assert not {n for _, n in imports_of("gateway") if n.split(".")[0] == "torch"}


def _import_graph():
    """scripts/import_graph.py (the script a user runs to print the engine's floors)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "import_graph.py"
    spec = importlib.util.spec_from_file_location("import_graph", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_circles_in_evenflow():
    graph = _import_graph()
    assert graph.cycles(graph.graph()) == []


def test_engine_modules_import_only_their_floor_and_below():
    graph = _import_graph()
    assert graph.floor_violations(graph.graph()) == []


def test_engine_files_live_in_sub_packages():
    assert {p.name for p in (PACKAGE / "engine").glob("*.py")} == {"__init__.py"}
    graph = _import_graph()
    for module in graph.all_modules():
        graph.engine_floor(module)  # KeyError: a module on no floor


def test_the_import_graph_sees_an_upward_import():
    """The floor check is not vacuous: a kernel importing the model is caught."""
    graph = _import_graph()
    edges = {"evenflow.engine.kernels.native": {"evenflow.engine.model.transformer"},
             "evenflow.engine.model.transformer": {"evenflow.engine.kernels.native"}}
    assert graph.floor_violations(edges)
    assert graph.cycles(edges) == [sorted(edges)]
