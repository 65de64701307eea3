"""The import graph of evenflow's modules, and the engine's floors.

    python scripts/import_graph.py            # the engine's modules by floor, with their imports
    python scripts/import_graph.py --cycles   # import circles anywhere in evenflow/ (none, we hope)

Every `import` counts, also those inside functions and under TYPE_CHECKING: a circle hidden in a
function is still a circle to a reader. tests/unit/test_import_rules.py holds the same rules.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "evenflow"

# The engine's floors, lowest first: a module imports only from its own floor and the ones below
# (evenflow/engine/__init__.py states the same). Keys are module names under evenflow.engine;
# a sub-package stands for every module in it.
ENGINE_FLOORS: list[tuple[str, ...]] = [
    ("spec",),  # speculative decoding's configuration and proposers (torch-free)
    ("config",),
    ("core",),
    ("kernels",),
    ("sample",),
    ("quant",),
    ("model",),
    ("weights",),
    ("runners",),
    ("serving",),
    ("dep",),
    ("api", ""),  # "": the package's own __init__ (naming create_engine)
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The evenflow modules this file imports (a `from pkg import name` of a submodule counts
    as the submodule)."""
    found: set[str] = set()
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {name for name in found if name in modules and name != here}


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def engine_floor(module: str) -> int | None:
    """The floor of an evenflow.engine module, None outside the engine."""
    if module != "evenflow.engine" and not module.startswith("evenflow.engine."):
        return None
    rest = module.removeprefix("evenflow.engine").removeprefix(".")
    head = rest.split(".")[0]
    for floor, names in enumerate(ENGINE_FLOORS):
        if head in names:
            return floor
    raise KeyError(f"{module} sits on no floor: add it to ENGINE_FLOORS")


def floor_violations(edges: dict[str, set[str]]) -> list[str]:
    """'a imports b' for every engine import that reaches a higher floor."""
    bad = []
    for module, targets in sorted(edges.items()):
        floor = engine_floor(module)
        if floor is None:
            continue
        for target in sorted(targets):
            other = engine_floor(target)
            if other is not None and other > floor:
                bad.append(f"{module} (floor {floor}) imports {target} (floor {other})")
    return bad


def main() -> int:
    edges = graph()
    if "--cycles" in sys.argv:
        found = cycles(edges)
        for component in found:
            print("circle:", " <-> ".join(component))
        print(f"{len(found)} import circles in evenflow/")
        return 1 if found else 0
    for floor, names in enumerate(ENGINE_FLOORS):
        print(f"floor {floor}: {', '.join(n or '__init__' for n in names)}")
        for module in sorted(m for m in edges if engine_floor(m) == floor):
            inside = sorted(t.removeprefix("evenflow.engine.") for t in edges[module]
                            if engine_floor(t) is not None)
            print(f"  {module.removeprefix('evenflow.engine.') or '__init__'}"
                  f"{' <- ' + ', '.join(inside) if inside else ''}")
    bad = floor_violations(edges) + [" <-> ".join(c) for c in cycles(edges)]
    print("\n".join(bad) if bad else "every import goes down a floor or stays on it; no circles")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
