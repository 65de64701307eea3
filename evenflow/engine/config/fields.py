"""Settings declared once. A field of EngineConfig or MeshConfig made by `setting()` carries its
help, range, choices and command-line flag in the field's metadata; everything else is derived
from it: the value's check (`check_settings`), its `EVENFLOW_<NAME>` variable, the flags of
`evenflow up`, `serve` and `generate` (`add_flags`), `evenflow up --help-env` and the table in
docs/configuration.md (`settings_table`; a test keeps the file current). Torch-free.

Adding a setting is one declaration: `name: int = setting(4, help="...", ge=1, flag=True)`."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any

ENV_PREFIX = "EVENFLOW_"
ALL_COMMANDS = ("up", "serve", "generate")


@dataclass(frozen=True)
class Setting:
    """What a field's metadata says about it (see `setting`)."""

    help: str
    ge: float | None = None  # value >= ge
    gt: float | None = None  # value > gt
    le: float | None = None  # value <= le
    choices: tuple[str, ...] = ()
    flag: str = ""  # "--name" on the commands below; "": no flag (the variable only)
    commands: tuple[str, ...] = ("up", "serve")
    hidden: bool = False  # set by the launcher for one process, not by users (no docs row)


def setting(default: Any = MISSING, *, factory: Any = MISSING, help: str,
            ge: float | None = None, gt: float | None = None, le: float | None = None,
            choices: tuple[str, ...] = (), flag: bool | str = False,
            commands: tuple[str, ...] = ("up", "serve"), hidden: bool = False) -> Any:
    """A dataclass field declaring a setting. flag: True for --<name with dashes>, or the flag
    itself ("--tp"); commands: which commands get the flag."""
    name_flag = flag if isinstance(flag, str) else ("*" if flag else "")
    meta = {"setting": Setting(help, ge, gt, le, tuple(choices), name_flag, tuple(commands),
                               hidden)}
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def overridden(cls: type, name: str, default: Any) -> Any:
    """The field `name` of `cls` again with another default (a subclass's: the mesh runs one
    thread per worker where the offline engine takes torch's choice), its declaration kept."""
    parent = next(f for f in dataclasses.fields(cls) if f.name == name)
    return dataclasses.field(default=default, metadata=parent.metadata)


def settings_of(cls: type) -> list[tuple[dataclasses.Field, Setting]]:
    """Every field of `cls` declared with setting(), in declaration order."""
    return [(f, f.metadata["setting"]) for f in dataclasses.fields(cls)
            if "setting" in f.metadata]


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def flag_of(f: dataclasses.Field, s: Setting) -> str:
    return "--" + f.name.replace("_", "-") if s.flag == "*" else s.flag


def bound_text(s: Setting) -> str:
    """The range in words: ">= 0", "> 0 and <= 1", ... ("" when unbounded)."""
    parts = [f">= {s.ge:g}" if s.ge is not None else "", f"> {s.gt:g}" if s.gt is not None else "",
             f"<= {s.le:g}" if s.le is not None else ""]
    return " and ".join(p for p in parts if p)


def check_settings(obj: Any, error: type[ValueError] = ValueError) -> None:
    """Each setting's value against its range and choices; `error` names the field and its
    variable ("kv_cache_gb (EVENFLOW_KV_CACHE_GB) must be > 0, got 0"). None is "unset"."""
    for f, s in settings_of(type(obj)):
        value = getattr(obj, f.name)
        if value is None:
            continue
        who = f"{f.name} ({env_name(f.name)})"
        if s.choices and value not in s.choices:
            raise error(f"{who} must be one of {', '.join(s.choices)}, got {value!r}")
        if (s.ge is not None and value < s.ge) or (s.gt is not None and value <= s.gt) or (
                s.le is not None and value > s.le):
            raise error(f"{who} must be {bound_text(s)}, got {value!r}")


def _base_type(hint: Any) -> Any:
    """int | None -> int; other hints as they are."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def add_flags(parser: argparse._ActionsContainer, cls: type, command: str,
              only: set[str] | None = None, skip: frozenset[str] | set[str] = frozenset()
              ) -> list[str]:
    """The flags of `command` that cls's settings declare (those named in `only`, if given;
    not those in `skip`), each with dest = the field's name and default None (unset: the
    config's own default, or the environment's). Returns their names (for `flag_values`)."""
    hints = typing.get_type_hints(cls)
    names = []
    for f, s in settings_of(cls):
        if not s.flag or command not in s.commands or f.name in skip or (
                only is not None and f.name not in only):
            continue
        kind = _base_type(hints[f.name])
        default = f.default
        shown = "" if default in (None, "", MISSING) else f" (default {default})"
        text = s.help + (shown if kind is not bool else "")
        flag = flag_of(f, s)
        if kind is bool:
            parser.add_argument(flag, dest=f.name, default=None,
                                action=argparse.BooleanOptionalAction, help=text)
        elif typing.get_origin(kind) is tuple:  # one or more values after the flag
            parser.add_argument(flag, dest=f.name, default=None, nargs="+", help=text,
                                metavar=flag[2:].upper().replace("-", "_"))
        else:
            parser.add_argument(flag, dest=f.name, default=None, type=kind,
                                choices=list(s.choices) or None, help=text,
                                metavar=None if s.choices else flag[2:].upper().replace("-", "_"))
        names.append(f.name)
    return names


def flag_values(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """The flags given on the command line (None: not given)."""
    return {name: tuple(value) if isinstance(value, list) else value
            for name in names if (value := getattr(args, name)) is not None}


def default_of(f: dataclasses.Field) -> Any:
    """A field's default value (its factory's, where it has one)."""
    if f.default is MISSING and f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


def settings_table(sections: list[tuple[str, list[tuple[dataclasses.Field, Setting]]]]) -> str:
    """docs/configuration.md's tables: each section's settings with their variable, flag,
    default, range and help (markdown)."""
    lines = []
    for title, rows in sections:
        lines += [f"## {title}", "", "| variable | flag | default | allowed | what it does |",
                  "|---|---|---|---|---|"]
        for f, s in rows:
            if s.hidden:
                continue
            default = default_of(f)
            shown = ",".join(default) if isinstance(default, tuple) else default
            shown = "unset" if shown in (None, "") else f"`{shown}`"
            allowed = ", ".join(s.choices) if s.choices else bound_text(s)
            flag = f"`{flag_of(f, s)}`" if s.flag else ""
            lines.append(f"| `{env_name(f.name)}` | {flag} | {shown} | {allowed} | "
                         f"{s.help.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)
