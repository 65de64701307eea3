"""docs/serving.md's list of per-kernel switches names every EVENFLOW_NATIVE_* switch the
engine declares (engine/config/settings.py ENGINE_SWITCHES): a kernel added with its switch
and left out of the docs fails here."""

from __future__ import annotations

import re
from pathlib import Path

from evenflow.engine.config.settings import ENGINE_SWITCHES

ROOT = Path(__file__).resolve().parents[2]


def test_every_native_switch_is_in_the_serving_docs():
    text = (ROOT / "docs" / "serving.md").read_text()
    section = text[text.index("### Engine switches"):]
    section = section[: section.index("\n#", 1)]
    named = set(re.findall(r"`EVENFLOW_(\w+)`", section)) | {
        "NATIVE_" + short for short in re.findall(r"`([A-Z0-9_]+)`", section)}
    missing = sorted(name for name in ENGINE_SWITCHES
                     if name.removeprefix("EVENFLOW_") not in named)
    assert not missing, f"docs/serving.md's engine switches lack: {', '.join(missing)}"
