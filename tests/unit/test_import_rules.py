"""The import DAG of DESIGN.md: proto imports nothing of ours; engine only proto, parallel and
torch; parallel only torch; services never import engine; the gateway never imports torch or
the engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "evenflow"
SERVICES = ["gateway", "prefill", "decode", "kv_index", "balancer"]
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
            if name == "evenflow.engine.config":
                continue
            assert parts[1] in ALLOWED[package] | {"models", "progress"}, \
                f"{package}/{filename} imports {name}"


def test_nothing_imports_the_deploy_code():
    for package in ALLOWED:
        for filename, name in imports_of(package):
            assert not name.startswith("evenflow.rayserve"), f"{package}/{filename} imports {name}"


def test_gateway_never_imports_torch():
    assert not {n for _, n in imports_of("gateway") if n.split(".")[0] == "torch"}
