"""docs/structure.md lists every module of evenflow/ with a one-line purpose, under a heading
for its folder."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def documented() -> set[str]:
    found, folder = set(), None
    for line in (ROOT / "docs" / "structure.md").read_text().splitlines():
        heading = re.match(r"^## (evenflow/[\w/]*)", line)
        if heading:
            folder = heading.group(1).rstrip("/") + "/"
        elif line.startswith("## "):
            folder = None
        entry = re.match(r"^- `([\w/]+\.py)` — \S", line)
        if entry and folder:
            found.add(folder + entry.group(1))
    return found


def test_every_module_has_its_line_in_docs_structure():
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "evenflow").rglob("*.py")
               if p.name != "__init__.py"}
    missing = sorted(modules - documented())
    assert not missing, f"docs/structure.md lacks: {', '.join(missing)}"
    stale = sorted(documented() - modules)
    assert not stale, f"docs/structure.md lists modules that are gone: {', '.join(stale)}"
