"""Every `evenflow ...` command in README.md and docs/*.md is real: its subcommand exists and
every flag it names is one the CLI's own parser accepts (for `bench NAME`, `doctor`, `profile`
and `dev hosts`, the parser of the module they hand their arguments to). README.md stays the
front door: at most 250 lines, linking every docs page; relative links resolve; LICENSE exists.

Commands are read from fenced code blocks (a trailing backslash joins lines) and inline code
spans (which may wrap). From each, the parts after `|`, `&&`, `;`, a `#` comment or a
redirection are shell, not evenflow; a leading `$ ` and `FOO=1` assignments are dropped.
Synopsis notation is understood: `[--opt V]` is optional, `a|b` and `--x A | --y B` are
alternatives, `...` ends what is checked, placeholders (`MODEL`, `<dir>`) stand for values.

The parsers are reached through the real dispatch (`evenflow.cli.main`, then each
subcommand's `func`), with `ArgumentParser.parse_args` replaced by a stub that hands back the
parser and its arguments, so nothing runs and no subprocess starts."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import re
import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

from evenflow import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 250
SETUP_COMMANDS = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]' && evenflow up",
    ". .venv/bin/activate && python -m pytest -q",
)

ELLIPSIS = {"...", "…"}
SEPARATORS = {"|", "||", "&&", ";", "&"}
REDIRECTION = re.compile(r"\d*(>>?|>&\d*|<<?)(.*)|&>.*")
PLACEHOLDER_VALUE = re.compile(r"<[^<>\s]+>")  # `<dir>`, not a redirection
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")
NEGATIVE_NUMBER = re.compile(r"-\d+(\.\d+)?")
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*(\.\.\.)?|<[^<>]+>|.*(\.\.\.|…).*")


class Command(NamedTuple):
    path: str  # relative to the repository
    line: int
    text: str  # as checked: shell parts and the program name removed
    argv: list[str]
    module: str | None  # None for the `evenflow` command, else the module `python -m` runs


# --- reading commands out of markdown -----------------------------------------------------


def code_snippets(markdown: str) -> Iterator[tuple[int, str]]:
    """(line number, code) for each logical line of a fenced block and each inline span."""
    lines = markdown.splitlines()
    fence: str | None = None
    paragraph: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        opening = re.match(r"\s*(`{3,}|~{3,})", line)
        if fence is None and opening:
            yield from _inline_spans(paragraph)
            paragraph, fence = [], opening.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is not None:
            start = i + 1
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i]
            yield start, line
        elif not line.strip():
            yield from _inline_spans(paragraph)
            paragraph = []
        else:
            paragraph.append((i + 1, line))
        i += 1
    yield from _inline_spans(paragraph)


def _inline_spans(paragraph: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    if not paragraph:
        return
    text = "\n".join(line for _, line in paragraph)
    for span in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", text, re.DOTALL):
        line = paragraph[0][0] + text.count("\n", 0, span.start())
        yield line, " ".join(span.group(2).split())


def _tokens(code: str) -> list[str]:
    try:
        return shlex.split(code, comments=True)
    except ValueError:  # an unbalanced quote: prose, or a JSON body across lines
        return code.split()


def _segments(tokens: list[str]) -> Iterator[list[str]]:
    """The simple commands of a shell line, synopsis alternatives (`[-a | -b]`, `-a X | -b Y`)
    kept in one command; a redirection ends its command's arguments."""
    current: list[str] = []
    depth = 0
    redirected = False
    for at, token in enumerate(tokens):
        following = tokens[at + 1] if at + 1 < len(tokens) else ""
        if token == "|" and (depth > 0 or following.startswith("-")):
            continue  # alternatives, not a pipe
        if token in SEPARATORS:
            yield current
            current, depth, redirected = [], 0, False
            continue
        if REDIRECTION.fullmatch(token) and not PLACEHOLDER_VALUE.fullmatch(token):
            redirected = True
        if redirected:
            continue
        depth += token.count("[") - token.count("]")
        current.append(token)
    yield current


def commands_in(path: Path) -> Iterator[Command]:
    return commands_in_text(str(path.relative_to(ROOT)), path.read_text())


def commands_in_text(where: str, markdown: str) -> Iterator[Command]:
    for line, code in code_snippets(markdown):
        for segment in _segments(_tokens(code)):
            while segment and (segment[0] == "$" or ENV_ASSIGNMENT.fullmatch(segment[0])):
                segment = segment[1:]
            if segment[:1] == ["evenflow"]:
                module, args = None, segment[1:]
            elif (len(segment) >= 3 and segment[0] in ("python", "python3") and segment[1] == "-m"
                  and re.fullmatch(r"evenflow(\.\w+)*", segment[2])):
                module, args = segment[2], segment[3:]
            else:
                continue
            argv = [t.lstrip("[").rstrip("]") for t in args]
            argv = [t for t in argv if t]
            if argv[:1] and argv[0].endswith(":"):
                continue  # a line the program prints ("evenflow up: stopping ..."), not a command
            yield Command(where, line, " ".join([module or "evenflow", *args]), argv, module)


def all_commands() -> list[Command]:
    return [c for path in (README, *DOCS) for c in commands_in(path)]


# --- checking one command against the real parsers ----------------------------------------


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser, args: list[str]) -> None:
        super().__init__(parser.prog)
        self.parser, self.args = parser, args


@contextmanager
def _capturing() -> Iterator[None]:
    def parse_args(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        raise _Captured(self, list(args or []))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args):
        yield


def _parser_of(call: Callable[[], Any]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser `call` would parse its arguments with, and those arguments."""
    with _capturing():
        try:
            returned = call()
        except _Captured as captured:
            return captured.parser, captured.args
    raise AssertionError(f"reached no argument parser (returned {returned!r})")


def _is_flag(token: str) -> bool:
    return (token.startswith("-") and token not in ("-", "--")
            and not NEGATIVE_NUMBER.fullmatch(token))


def _arity(action: argparse.Action) -> tuple[int, float]:
    nargs = action.nargs
    if nargs is None:
        return 1, 1
    if isinstance(nargs, int):
        return nargs, nargs
    return {"?": (0, 1), "*": (0, float("inf")), "+": (1, float("inf"))}.get(
        nargs, (0, float("inf")))


def _choice_problem(action: argparse.Action, name: str, value: str) -> str | None:
    if action.choices is None or PLACEHOLDER.fullmatch(value):
        return None
    choices = [str(c) for c in action.choices]
    wrong = [alt for alt in value.split("|") if alt not in choices]
    return f"{name} {wrong[0]!r} is not one of {', '.join(choices)}" if wrong else None


def _walk(parser: argparse.ArgumentParser, tokens: list[str],
          problems: list[str]) -> Callable[[], Any] | None:
    """Check tokens against parser; the call that hands the rest to another parser, if any
    (a REMAINDER positional of a subcommand with a `func`)."""
    flags = parser._option_string_actions
    positionals = [a for a in parser._actions if not a.option_strings]
    values: dict[str, Any] = {}
    p = i = 0
    unknown = False  # a choice positional not known: nothing to hand off to
    while i < len(tokens):
        token = tokens[i]
        if token in ELLIPSIS:
            return None
        if p < len(positionals) and positionals[p].nargs == argparse.REMAINDER:
            break
        i += 1
        if _is_flag(token):
            name, eq, value = token.partition("=")
            action = flags.get(name)
            if action is None:
                problems.append(f"`{parser.prog}` has no flag {name}")
                continue
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                return None
            taken = [value] if eq else []
            least, most = _arity(action)
            while (not eq and len(taken) < most and i < len(tokens) and not _is_flag(tokens[i])
                   and tokens[i] not in ELLIPSIS):
                taken.append(tokens[i])
                i += 1
            if len(taken) < least and i < len(tokens) and _is_flag(tokens[i]):
                problems.append(f"`{parser.prog}` {name} needs a value")  # (at the end: named)
            problems.extend(f"`{parser.prog}` {problem}" for problem in
                            filter(None, (_choice_problem(action, name, v) for v in taken)))
            continue
        if p >= len(positionals):
            problems.append(f"`{parser.prog}` takes no argument {token!r} here")
            continue
        action = positionals[p]
        if isinstance(action, argparse._SubParsersAction):
            if token not in action.choices:
                problems.append(f"`{parser.prog}` has no subcommand {token!r} "
                                f"(it has: {', '.join(action.choices)})")
                return None
            return _walk(action.choices[token], tokens[i:], problems)
        problem = _choice_problem(action, action.dest, token)
        if problem:
            problems.append(f"`{parser.prog}` {problem}")
        unknown |= action.choices is not None and (bool(problem) or
                                                   bool(PLACEHOLDER.fullmatch(token)))
        if action.nargs in ("+", "*"):
            values.setdefault(action.dest, []).append(token)
        else:
            values[action.dest] = token
            p += 1
    if p >= len(positionals) or positionals[p].nargs != argparse.REMAINDER:
        return None
    values[positionals[p].dest] = tokens[i:]
    if tokens[i : i + 1] == ["--worker"]:
        problems.append("--worker is a benchmark's internal entry point, not a user's flag")
        return None
    func = parser.get_default("func")
    if func is None or unknown:  # `dev hosts exec TAG I CMD...`; `bench NAME`
        return None
    namespace = argparse.Namespace(**values)
    return lambda: func(namespace)


_cli_parser = functools.cache(cli.build_parser)  # main builds it per call; the walk reads it


def check(argv: list[str], module: str | None = None) -> list[str]:
    """What is wrong with `evenflow ARGV`, or `python -m MODULE ARGV`: [] when nothing."""
    if module is not None:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(module + ".__main__")
        if spec is None:
            return [f"`python -m {module}` runs nothing: no such module or __main__"]
        if module != "evenflow":
            return []  # its own arguments, not the CLI's
    problems: list[str] = []
    with mock.patch.object(cli, "build_parser", _cli_parser):
        parser, args = _parser_of(lambda: cli.main(list(argv)))
    while True:
        handoff = _walk(parser, args, problems)
        if handoff is None:
            return problems
        parser, args = _parser_of(handoff)


# --- the tests ----------------------------------------------------------------------------


def test_every_documented_command_parses() -> None:
    commands = all_commands()
    assert len(commands) > 50, f"only {len(commands)} evenflow commands found: the reader broke"
    assert any(c.path == "README.md" and c.argv == ["up"] for c in commands)
    failures = [f"{c.path}:{c.line}: `{c.text}`: {problem}"
                for c in commands for problem in check(c.argv, c.module)]
    assert not failures, "commands in the docs the CLI does not accept:\n" + "\n".join(failures)


def test_the_checker_rejects_what_does_not_exist() -> None:
    assert any("--no-such-flag" in p for p in check(["up", "--no-such-flag"]))
    assert any("--no-such-flag" in p for p in check(["up", "--model", "M", "--no-such-flag=1"]))
    assert any("--no-such-flag" in p for p in check(["bench", "engine", "--no-such-flag"]))
    assert any("--no-such-flag" in p for p in check(["doctor", "--no-such-flag"]))
    assert any("--no-such-flag" in p for p in check(["dev", "hosts", "up", "3", "--no-such-flag"]))
    assert any("no-such-command" in p for p in check(["no-such-command"]))
    assert any("no-such-bench" in p for p in check(["bench", "no-such-bench"]))
    assert any("int5" in p for p in check(["up", "--quantization", "int8|int5"]))
    assert check(["up", "--model", "MODEL", "--quantization", "int8|int4|w8a8", "--tp", "N"]) == []
    assert check(["bench", "engine", "--kv-cache-dtype", "int8"]) == []
    assert check(["gguf", "export", "<dir>", "OUT.gguf", "--type", "q4_k_m"]) == []
    assert check(["profile", "--batch", "8"]) == []


def test_the_reader_finds_commands_as_a_shell_would() -> None:
    text = ("Run `evenflow up --port P [--quantization int8|int4]` or\n"
            "`evenflow generate PROMPT --json-schema '{...}' | --regex R | --choice A`.\n\n"
            "```bash\n"
            "$ FOO=1 evenflow serve --roles gateway \\\n"
            "    --index 2 | tee log  # a comment\n"
            "pip install x && evenflow bench engine --quick > out.txt; echo done\n"
            "```\n")
    found = [(c.line, c.argv) for c in commands_in_text("page.md", text)]
    assert found == [
        (1, ["up", "--port", "P", "--quantization", "int8|int4"]),
        (2, ["generate", "PROMPT", "--json-schema", "{...}", "--regex", "R", "--choice", "A"]),
        (5, ["serve", "--roles", "gateway", "--index", "2"]),
        (7, ["bench", "engine", "--quick"]),
    ]


def test_readme_is_a_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES, (
        f"README.md has {len(text.splitlines())} lines; move detail into docs/")
    for command in SETUP_COMMANDS:
        assert command in text.splitlines(), f"README.md lost its command: {command}"
    unlinked = [p.name for p in DOCS if not re.search(rf"\]\(docs/{re.escape(p.name)}(#[^)]*)?\)",
                                                      text)]
    assert not unlinked, f"README.md does not link: {', '.join(unlinked)}"
    assert (ROOT / "LICENSE").is_file()


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lowercased, punctuation dropped, spaces to hyphens."""
    seen: dict[str, int] = {}
    anchors = set()
    fenced = False
    for line in markdown.splitlines():
        if re.match(r"\s*(```|~~~)", line):
            fenced = not fenced
        heading = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_relative_links_resolve() -> None:
    broken = []
    for page in (README, *DOCS):
        text = page.read_text()
        for match in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = match.group(1)
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            where = f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
            name, _, anchor = target.partition("#")
            linked = (page.parent / name).resolve() if name else page
            if not linked.exists():
                broken.append(f"{where}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text()):
                broken.append(f"{where}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)
