"""Reading tensors out of a .safetensors file with plain reads into fresh buffers.

safetensors' own reader hands out views of a file mapping; every page it touches then counts in
the process's RSS for as long as the file stays open, on top of the copy the loader keeps. A
load that quantizes as it reads would peak at the quantized model plus two copies of a layer.
Here a tensor is read with one `readinto` into memory the loader owns, and nothing else stays
resident. The format: 8 bytes little-endian header length, a JSON header {name: {dtype, shape,
data_offsets: [begin, end]}} (plus an optional "__metadata__"), then the data.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
          "F64": torch.float64, "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16,
          "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


class SafetensorsError(ValueError):
    """The file is not a safetensors file this reader can take."""


@dataclass(frozen=True)
class Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets of the tensor's bytes
    end: int


@functools.lru_cache(maxsize=64)
def _header(path: str, mtime_ns: int, size: int) -> dict[str, Entry]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{path}: shorter than a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise SafetensorsError(f"{path}: header length {length} is not plausible")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise SafetensorsError(f"{path}: header is not JSON ({exc})") from exc
    entries: dict[str, Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            begin, end = (8 + length + int(x) for x in info["data_offsets"])
            shape = tuple(int(n) for n in info["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SafetensorsError(f"{path}: tensor {name}: unreadable entry {info!r}") from exc
        numel = 1
        for n in shape:
            numel *= n
        if end > size or end - begin != numel * dtype.itemsize:
            raise SafetensorsError(f"{path}: tensor {name}: offsets do not match its shape")
        entries[name] = Entry(dtype, shape, begin, end)
    return entries


def header(path: Path) -> dict[str, Entry]:
    """The file's tensors by name (cached per path, modification time and size)."""
    stat = path.stat()
    return _header(str(path), stat.st_mtime_ns, stat.st_size)


def read(path: Path, names: list[str]) -> dict[str, Tensor]:
    """`names` from one file, each in a buffer of its own (in file order: one forward pass)."""
    entries = header(path)
    out: dict[str, Tensor] = {}
    with open(path, "rb", buffering=0) as f:
        for name in sorted(names, key=lambda n: entries[n].begin):
            entry = entries[name]
            data = torch.empty(entry.end - entry.begin, dtype=torch.uint8)
            view, done = memoryview(data.numpy()), 0  # type: ignore[arg-type]
            f.seek(entry.begin)
            while done < len(view):  # (one read returns at most ~2 GiB on Linux)
                got = f.readinto(view[done:])
                if not got:
                    raise SafetensorsError(f"{path}: tensor {name}: file ends inside its data")
                done += got
            out[name] = data.view(entry.dtype).reshape(entry.shape)
    return out
