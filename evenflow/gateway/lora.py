"""The LoRA adapters a gateway serves, by name (vLLM's API): `--lora-modules NAME=PATH ...` at
start, `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` at run time, each listed in
/v1/models with the base model as its parent. A request whose "model" names an adapter carries
its name and PEFT checkpoint path to the workers (SamplingParams.lora_name / lora_path), which
load it on first use (engine/model/lora.py): the path must be readable where the workers run,
as a model directory is. The adapter salts the request's block hashes (proto/hashing.py
adapter_salt), so the router, the KV index and the engines never match K/V across adapters.

Adapters loaded at run time belong to the gateway process that loaded them; with several
gateways, name them in --lora-modules (each gateway starts with those)."""

from __future__ import annotations

import re
from pathlib import Path

from evenflow.gateway.protocol import APIError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def check_adapter(name: str, path: str, base_model: str) -> str:
    """The adapter's directory, absolute; raises APIError (400) naming what is wrong."""
    if not _NAME.match(name) or name == base_model:
        raise APIError(400, f"lora_name {name!r}: 1-128 letters, digits or ._:/-, and not the "
                       "base model's name", param="lora_name")
    root = Path(path).expanduser()
    if not (root / "adapter_config.json").is_file() or \
            not (root / "adapter_model.safetensors").is_file():
        raise APIError(400, f"lora_path {path!r} is not a PEFT LoRA checkpoint (it needs "
                       "adapter_config.json and adapter_model.safetensors)", param="lora_path")
    return str(root.resolve())


class LoRAAdapters:
    def __init__(self, modules: tuple[str, ...], base_model: str) -> None:
        self.base_model = base_model
        self.paths: dict[str, str] = {}
        for item in modules:
            name, sep, path = item.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules {item!r}: give NAME=PATH")
            try:
                self.paths[name] = check_adapter(name, path, base_model)
            except APIError as exc:
                raise ValueError(f"--lora-modules {item!r}: {exc.message}") from None

    def load(self, name: str, path: str) -> None:
        if name in self.paths:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.",
                           param="lora_name", code="lora_adapter_exists")
        self.paths[name] = check_adapter(name, path, self.base_model)

    def unload(self, name: str) -> None:
        if self.paths.pop(name, None) is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError",
                           "lora_name", "lora_adapter_not_found")

    def path_of(self, name: str) -> str | None:
        return self.paths.get(name)
