"""evenflow: a Python-first serving mesh for Mixture-of-Experts language models.

`LLM` and `SamplingParams` are imported lazily so that torch-free parts of the package (the
gateway, the wire contract) never pull in the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from evenflow.engine.api.llm import LLM
    from evenflow.proto.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from evenflow.engine.api.llm import LLM

        return LLM
    if name == "SamplingParams":
        from evenflow.proto.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'evenflow' has no attribute {name!r}")
