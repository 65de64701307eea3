"""Every third-party package the code imports is declared in pyproject.toml (the runtime ones in
`dependencies`; transformers, an optional benchmark oracle, in `dev`; matplotlib, optional for
`bench serve --plot`, in `dev` and `bench`)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# imported inside a guard: `evenflow bench engine` works without transformers, `bench serve
# --plot` draws plain charts without matplotlib
OPTIONAL = {"transformers", "matplotlib"}
# evenflow/bench/offline/vllm_worker.py runs in another venv (--vllm-python), never in ours
OTHER_VENV = {"vllm"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(requirements: list[str]) -> set[str]:
    return {normalize(re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0]) for r in requirements}


def imported_modules() -> set[str]:
    found = set()
    for path in (ROOT / "evenflow").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m != "evenflow"} - OTHER_VENV


def test_every_imported_package_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = declared(project["dependencies"])
    dev = declared(project["optional-dependencies"]["dev"])
    dists = packages_distributions()
    for module in sorted(imported_modules()):
        names = {normalize(d) for d in dists.get(module, [module])}
        allowed = runtime | (dev if module in OPTIONAL else set())
        assert names & allowed, f"evenflow imports {module} ({names}) but does not declare it"
