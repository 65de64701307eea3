"""The codec evenflow used before proto/codec.py, kept only as `evenflow bench wire`'s baseline:
per-element Python recursion on encode, exact field counts and annotation-string type checks on
decode. Never used on the wire."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from evenflow.proto import messages as m
from evenflow.proto.sampling import SamplingParams

_NESTED: dict[tuple[type, str], type] = {
    (m.PrefillRequest, "sampling"): SamplingParams, (m.DecodeRequest, "sampling"): SamplingParams,
    (m.KVTransferComplete, "sampling"): SamplingParams}
_NESTED_LISTS: dict[tuple[type, str], type] = {(m.TokenDeltas, "deltas"): m.TokenDelta}
_SCALARS: dict[str, Any] = {"str": str, "int": int, "float": (int, float), "bool": bool,
                            "bytes": bytes}


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [_to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, list):
        return [_to_wire(v) for v in value]
    return value


def encode(message: Any) -> bytes:
    return msgpack.packb({"t": message.TYPE, "v": message.VERSION, "d": _to_wire(message)},
                         use_bin_type=True)


def _build(cls: type, values: Any) -> Any:
    fields = dataclasses.fields(cls)
    if not isinstance(values, list) or len(values) != len(fields):
        raise TypeError(f"{cls.__name__} wants {len(fields)} fields")
    kwargs = {}
    for f, v in zip(fields, values, strict=True):
        nested = _NESTED.get((cls, f.name))
        if nested is not None:
            v = _build(nested, v)
        elif (cls, f.name) in _NESTED_LISTS:
            v = [_build(_NESTED_LISTS[(cls, f.name)], d) for d in v]
        kwargs[f.name] = v
    obj = cls(**kwargs)
    _check_types(obj)
    return obj


def _check_types(obj: Any) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        ann = str(f.type).replace(" ", "")
        base = ann.removesuffix("|None")
        if value is None:
            continue
        if base in _SCALARS:
            if not isinstance(value, _SCALARS[base]) or (base == "int" and isinstance(value, bool)):
                raise TypeError(f"{f.name} must be {base}")
        elif base == "list[int]":
            if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
                raise TypeError(f"{f.name} must be a list of ints")
        elif base == "dict[str,int]":
            if not isinstance(value, dict) or not all(
                    isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                    for k, v in value.items()):
                raise TypeError(f"{f.name} must map strings to ints")


def decode(payload: bytes) -> Any:
    envelope = msgpack.unpackb(payload, raw=False)
    return _build(m.REGISTRY[envelope["t"]], envelope["d"])
