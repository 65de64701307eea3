"""The loader's own safetensors reader gives back exactly what safetensors wrote, for every
dtype a checkpoint uses, and refuses a damaged file with a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from evenflow.engine.weights import safetensors_io


def test_reads_what_safetensors_wrote(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "f32": torch.randn(7, generator=g),
        "f16": torch.randn(2, 2, 2, generator=g).half(),
        "i8": torch.randint(-128, 127, (4, 3), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (9,), dtype=torch.uint8, generator=g),
        "i32": torch.randint(-9, 9, (2, 3), dtype=torch.int32, generator=g),
        "i64": torch.arange(5),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    header = safetensors_io.header(path)
    assert set(header) == set(tensors)
    got = safetensors_io.read(path, list(tensors))
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name], want), name
    some = safetensors_io.read(path, ["i8"])
    assert list(some) == ["i8"]


def test_a_damaged_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(64, 64)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-100])  # cut inside the tensor's data
    with pytest.raises(safetensors_io.SafetensorsError, match="offsets|ends"):
        safetensors_io.read(path, ["w"])
    path.write_bytes(b"\xff" * 16)
    with pytest.raises(safetensors_io.SafetensorsError, match="header"):
        safetensors_io.header(path)
