"""The wire codec: typed messages <-> msgpack bytes, with one compiled schema per message type.

Envelope: a msgpack map {"t": type tag, "v": version, "d": [field values in declaration order]}.
Plain values (ints, floats, strings, bytes, lists or tuples of them, str->int maps) go to
msgpack's C packer as they are: no per-element Python work on encode. Nested structs are packed
as arrays of their fields; members of a tagged union (the KV events) as `[tag, *fields]`, which
is how msgspec's `tag=True, array_like=True` structs (vLLM's KV events) look on the wire.

Compatibility: fields are positional and only ever appended. A decoder fills missing trailing
fields from their defaults and ignores unknown trailing ones, so versions N and N+1 talk both
ways during a rolling upgrade. A message older than its type's MIN_VERSION is refused.

Validation: each field is checked against its resolved type hint (`typing.get_type_hints`),
compiled once per type into a checker. A malformed, unknown or oversized payload decodes to a
`WireError` value, never an exception.
"""

from __future__ import annotations

import enum
import operator
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any, ClassVar, Protocol

import msgpack

MAX_MESSAGE_BYTES = 64 * 2**20  # after reassembly of frames; NATS' own max_payload is smaller


class WireMessage(Protocol):
    """What every top-level message type declares (besides being a frozen dataclass)."""

    TYPE: ClassVar[str]
    VERSION: ClassVar[int]


@dataclass(frozen=True)
class WireError:
    """Why a payload was rejected; services count these and drop the message."""

    reason: str


class _Invalid(Exception):
    pass


Check = Callable[[Any], Any]  # value off the wire -> value for the field, or raises _Invalid
Pack = Callable[[Any], Any]  # field value -> plain msgpack-able value


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _scalar_check(kind: type) -> Check:
    if kind is float:
        def check(v: Any) -> Any:
            if type(v) is float:
                return v
            if type(v) is int:
                return float(v)
            raise _Invalid("must be a number")
        return check
    if kind is bytes:
        def check_bytes(v: Any) -> Any:
            if type(v) is bytes:
                return v
            raise _Invalid("must be bytes")
        return check_bytes

    def check_exact(v: Any) -> Any:  # exact type: a bool is not an int on our wire
        if type(v) is kind:
            return v
        raise _Invalid(f"must be {kind.__name__}")
    return check_exact


def _list_check(item: Any) -> Check:
    if item in (int, str, bytes):  # the hot path: token ids, hashes, counts
        allowed = {item}

        def check_plain(v: Any) -> Any:
            if type(v) is not list or not set(map(type, v)) <= allowed:
                raise _Invalid(f"must be a list of {item.__name__}")
            return v
        return check_plain
    if item is float:
        numbers = {int, float}

        def check_numbers(v: Any) -> Any:
            if type(v) is not list or not set(map(type, v)) <= numbers:
                raise _Invalid("must be a list of numbers")
            return v
        return check_numbers
    inner = _compile_check(item)
    if is_dataclass(item) and isinstance(item, type):
        struct: type = item

        def check_structs(v: Any) -> Any:  # (TokenDeltas.deltas: the hot one)
            if type(v) is not list:
                raise _Invalid("must be a list")
            s = schema(struct)
            whole, n = s.whole, len(s.names)
            if whole is not None:
                try:
                    return [whole(x) if type(x) is list and len(x) == n else inner(x) for x in v]
                except _Invalid:
                    pass  # said again below, naming the field
            return [inner(x) for x in v]
        return check_structs

    def check_items(v: Any) -> Any:
        if type(v) is not list:
            raise _Invalid("must be a list")
        return [inner(x) for x in v]
    return check_items


def _tuple_check(items: tuple[Any, ...]) -> Check:
    """tuple[X, ...] (an array of X) or tuple[A, B] (an array of exactly an A and a B), made a
    tuple again on decode (msgpack packs a tuple as an array)."""
    if len(items) == 2 and items[1] is Ellipsis:
        as_list = _list_check(items[0])
        return lambda v: tuple(as_list(v))
    checks = tuple(_compile_check(item) for item in items)

    def check_fixed(v: Any) -> Any:
        if type(v) is not list or len(v) != len(checks):
            raise _Invalid(f"must be an array of {len(checks)}")
        return tuple(c(x) for c, x in zip(checks, v, strict=True))
    return check_fixed


def _dict_check(key: Any, value: Any) -> Check:
    assert key is str and value is int, "only str -> int maps cross the wire"

    def check(v: Any) -> Any:
        if type(v) is not dict or not set(map(type, v)) <= {str} or not set(
                map(type, v.values())) <= {int}:
            raise _Invalid("must map strings to ints")
        return v
    return check


def _union_check(members: tuple[Any, ...]) -> Check:
    optional = type(None) in members
    rest = [m for m in members if m is not type(None)]
    if all(is_dataclass(m) for m in rest) and len(rest) > 1:  # a tagged union of structs
        by_tag = {m.TAG: m for m in rest}

        def check_tagged(v: Any) -> Any:
            if v is None and optional:
                return None
            if type(v) is not list or not v or v[0] not in by_tag:
                raise _Invalid(f"must be one of {sorted(by_tag)}")
            return build(by_tag[v[0]], v[1:])
        return check_tagged
    if len(rest) == 1:
        inner = _compile_check(rest[0])
    elif set(rest) == {bytes, memoryview}:
        inner = _scalar_check(bytes)
    else:
        raise TypeError(f"unsupported union on the wire: {members}")

    def check_optional(v: Any) -> Any:
        if v is None:
            if optional:
                return None
            raise _Invalid("must not be null")
        return inner(v)
    return check_optional


def _compile_check(hint: Any) -> Check:
    origin = typing.get_origin(hint)
    if hint in (int, float, str, bool, bytes):
        return _scalar_check(hint)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        assert issubclass(hint, str), "only str enums cross the wire (packed as strings)"

        def check_enum(v: Any) -> Any:
            try:
                return hint(v)
            except ValueError:
                raise _Invalid(f"must be one of {[m.value for m in hint]}") from None
        return check_enum
    if is_dataclass(hint) and isinstance(hint, type):
        def check_struct(v: Any) -> Any:
            if type(v) is not list:
                raise _Invalid(f"must be a {hint.__name__} array")
            return build(hint, v)
        return check_struct
    if origin is list:
        return _list_check(typing.get_args(hint)[0])
    if origin is tuple:
        return _tuple_check(typing.get_args(hint))
    if origin is dict:
        return _dict_check(*typing.get_args(hint))
    if _is_union(hint):
        return _union_check(typing.get_args(hint))
    raise TypeError(f"unsupported type on the wire: {hint!r}")


def _compile_pack(hint: Any) -> Pack | None:
    """How to turn a field value into plain msgpack data; None: it already is."""
    if is_dataclass(hint) and isinstance(hint, type):
        return to_wire
    # A StrEnum is a str: msgpack packs it as it is.
    if typing.get_origin(hint) is list:
        item = typing.get_args(hint)[0]
        if is_dataclass(item):
            return lambda v: [to_wire(x) for x in v]
        if _is_union(item) and all(is_dataclass(m) for m in typing.get_args(item)):
            return lambda v: [[x.TAG, *to_wire(x)] for x in v]
    if _is_union(hint):
        rest = [m for m in typing.get_args(hint) if m is not type(None)]
        if len(rest) == 1:
            inner = _compile_pack(rest[0])
            if inner is not None:
                return lambda v: None if v is None else inner(v)
    return None


@dataclass
class _Schema:
    names: tuple[str, ...]
    checks: tuple[Check, ...]
    defaults: tuple[Any, ...]  # MISSING where the field is required
    getter: Callable[[Any], tuple[Any, ...]]
    packers: tuple[tuple[int, Pack], ...]  # (field index, packer) for non-plain fields
    # every field present: the instance in one generated call (None where build must do it)
    whole: Callable[[list[Any]], Any] | None = None


_SCHEMAS: dict[type, _Schema] = {}


def schema(cls: type) -> _Schema:
    """The compiled schema of a message or struct type (built on first use, then cached)."""
    found = _SCHEMAS.get(cls)
    if found is not None:
        return found
    hints = typing.get_type_hints(cls)
    declared = fields(cls)
    names = tuple(f.name for f in declared)
    defaults = tuple(f.default if f.default is not MISSING else (
        f.default_factory if f.default_factory is not MISSING else MISSING) for f in declared)
    getter: Callable[[Any], tuple[Any, ...]]
    if len(names) == 1:
        name = names[0]
        getter = lambda obj: (getattr(obj, name),)  # noqa: E731
    elif names:
        getter = operator.attrgetter(*names)
    else:
        getter = lambda obj: ()  # noqa: E731
    packers = tuple((i, p) for i, name in enumerate(names)
                    if (p := _compile_pack(hints[name])) is not None)
    checks = tuple(_compile_check(hints[n]) for n in names)
    found = _SCHEMAS[cls] = _Schema(names, checks, defaults, getter, packers,
                                    _compile_whole(cls, names, checks,
                                                   tuple(hints[n] for n in names)))
    return found


_EXACT = {int: "int", str: "str", bool: "bool", bytes: "bytes", float: "float"}


def _inline_check(i: int, hint: Any) -> str:
    """The generated expression checking field i: the common case inline (a value of the exact
    type, None where optional, an empty list), the field's check function otherwise (which
    converts, or raises _Invalid)."""
    if hint in _EXACT:
        return f"(v{i} if type(v{i}) is {_EXACT[hint]} else c{i}(v{i}))"
    if _is_union(hint):
        rest = [m for m in typing.get_args(hint) if m is not type(None)]
        if len(rest) == 1 and rest[0] in _EXACT and type(None) in typing.get_args(hint):
            return f"(v{i} if v{i} is None or type(v{i}) is {_EXACT[rest[0]]} else c{i}(v{i}))"
    if typing.get_origin(hint) is list:
        return f"(v{i} if type(v{i}) is list and not v{i} else c{i}(v{i}))"
    return f"c{i}(v{i})"


def _compile_whole(cls: type, names: tuple[str, ...], checks: tuple[Check, ...],
                   hints: tuple[Any, ...]) -> Callable[[list[Any]], Any] | None:
    """A builder of `cls` from a complete field list (what a current sender sends), generated
    as one function: every check, then the instance's fields set at once, as the dataclass's
    own (frozen) __init__ would, without its per-field object.__setattr__ (~3x faster on a
    TokenDelta), then its __post_init__ (as __init__ calls it). Raises _Invalid (the field
    unnamed: `build` names it), or what __post_init__ raises. None for a class with
    __slots__, which needs its __init__."""
    if not names or hasattr(cls, "__slots__"):
        return None
    args = ", ".join(f"v{i}" for i in range(len(names)))
    items = ", ".join(f"{name!r}: {_inline_check(i, hint)}"
                      for i, (name, hint) in enumerate(zip(names, hints, strict=True)))
    source = (f"def whole(values):\n"
              f"    {args}, = values\n"
              f"    obj = new(cls)\n"
              f"    obj.__dict__.update({{{items}}})\n"
              + ("    obj.__post_init__()\n" if hasattr(cls, "__post_init__") else "")
              + "    return obj\n")
    scope: dict[str, Any] = {"new": object.__new__, "cls": cls,
                             **{f"c{i}": check for i, check in enumerate(checks)}}
    exec(source, scope)  # noqa: S102 - generated from the class's own field names
    return scope["whole"]


_FACTORY = object()  # "the default factory's value" in a lean __init__'s signature


def lean_init(cls: type) -> type:
    """Class decorator (under @dataclass): the same __init__ (signature, defaults, factories,
    __post_init__), generated to set the fields in one __dict__ update instead of one
    object.__setattr__ each, as a frozen dataclass's does: a hot message built per token per
    step (TokenDelta, the engine's StepOutput) costs ~3x less. Frozen stays frozen."""
    declared = [f for f in fields(cls) if f.init]
    positional = [f for f in declared if not f.kw_only]
    keyword = [f for f in declared if f.kw_only]
    scope: dict[str, Any] = {"_FACTORY": _FACTORY}
    params, items = [], []
    for i, f in enumerate(positional + keyword):
        if keyword and f is keyword[0]:
            params.append("*")
        if f.default is not MISSING:
            scope[f"d{i}"] = f.default
            params.append(f"{f.name}=d{i}")
            items.append(f"{f.name!r}: {f.name}")
        elif f.default_factory is not MISSING:
            scope[f"f{i}"] = f.default_factory
            params.append(f"{f.name}=_FACTORY")
            items.append(f"{f.name!r}: f{i}() if {f.name} is _FACTORY else {f.name}")
        else:
            params.append(f.name)
            items.append(f"{f.name!r}: {f.name}")
    source = (f"def __init__(self, {', '.join(params)}):\n"
              f"    self.__dict__.update({{{', '.join(items)}}})\n"
              + ("    self.__post_init__()\n" if hasattr(cls, "__post_init__") else ""))
    exec(source, scope)  # noqa: S102 - generated from the class's own fields
    init = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init  # type: ignore[misc]
    return cls


def to_wire(obj: Any) -> list[Any] | tuple[Any, ...]:
    """A struct's field values, in order, as plain msgpack data (an array: msgpack packs a
    tuple as one, so a struct of plain fields goes as its getter's tuple)."""
    s = schema(type(obj))
    if not s.packers:
        return s.getter(obj)
    values = list(s.getter(obj))
    for index, pack in s.packers:
        values[index] = pack(values[index])
    return values


def build(cls: type, values: list[Any]) -> Any:
    """Field values off the wire -> a checked instance; raises _Invalid."""
    s = schema(cls)
    if s.whole is not None and len(values) == len(s.names):
        try:
            return s.whole(values)
        except _Invalid:
            pass  # said again below, with the field's name
    kwargs = {}
    for i, name in enumerate(s.names):
        if i < len(values):
            try:
                kwargs[name] = s.checks[i](values[i])
            except _Invalid as exc:
                raise _Invalid(f"{cls.__name__}.{name} {exc}") from None
        else:
            default = s.defaults[i]
            if default is MISSING:
                raise _Invalid(f"{cls.__name__}.{name} is missing")
            kwargs[name] = default() if callable(default) else default
    return cls(**kwargs)


class Codec:
    """Encodes and decodes the message types of one registry."""

    def __init__(self, message_types: tuple[type[WireMessage], ...]) -> None:
        self.registry: dict[str, type[WireMessage]] = {}
        for cls in message_types:
            assert cls.TYPE not in self.registry, f"duplicate message type {cls.TYPE}"
            self.registry[cls.TYPE] = cls
            schema(cls)  # compile now: a type the wire cannot carry fails at import
        self._packer = msgpack.Packer(use_bin_type=True)

    def encode(self, message: Any) -> bytes:
        cls = type(message)
        return self._packer.pack({"t": cls.TYPE, "v": cls.VERSION, "d": to_wire(message)})

    def decode(self, payload: bytes) -> Any:
        """Bytes -> message, or a WireError saying why not. Never raises."""
        if len(payload) > MAX_MESSAGE_BYTES:
            return WireError(f"message of {len(payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
        try:
            envelope = msgpack.unpackb(payload, raw=False, max_bin_len=MAX_MESSAGE_BYTES,
                                       strict_map_key=True)
        except Exception as exc:  # msgpack raises several types for garbage
            return WireError(f"not msgpack: {type(exc).__name__}")
        if type(envelope) is not dict or not {"t", "v", "d"} <= envelope.keys():
            return WireError("not an evenflow envelope")
        tag, version, data = envelope["t"], envelope["v"], envelope["d"]
        cls = self.registry.get(tag) if type(tag) is str else None
        if cls is None:
            return WireError(f"unknown message type {tag!r}")
        if type(version) is not int or version < getattr(cls, "MIN_VERSION", 1):
            return WireError(f"{cls.TYPE} version {version!r} is too old or not a number")
        if type(data) is not list:
            return WireError(f"malformed {cls.TYPE}: fields must be an array")
        try:
            return build(cls, data)
        except (_Invalid, TypeError, ValueError) as exc:
            return WireError(f"malformed {cls.TYPE}: {exc}")
