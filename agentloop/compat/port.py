"""``agentloop port FILE... [--write]``: rewrite a verl agent-loop file's imports to agentloop's.

:func:`port_source` rewrites only the module names in import statements (and, after a plain
``import verl.x``, the ``verl.x.attr`` references) by
:data:`~agentloop.compat.import_map.VERL_IMPORT_MAP`, keeping everything else byte for byte; the
result is idempotent.  Modules not in the map, moved submodules and (with name checking) names the
agentloop module lacks are reported, not raised; the CLI prints a diff (``--write`` edits in place)
and exits 1 when anything was reported. Spec: docs/porting-from-verl.md#agentloop-port.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import io
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from agentloop.compat.import_map import (
    DOCS_IMPORT_MAP,
    VERL_IMPORT_MAP,
    MissingVerlNameError,
    is_verl_module,
    map_module,
    map_reference,
    missing_verl_name,
    not_provided_reason,
    unknown_module_message,
)

_SKIP = {tokenize.NL, tokenize.COMMENT}


@dataclass(frozen=True)
class PortIssue:
    """Something ``port`` could not rewrite (or a rewritten name agentloop lacks), at a 1-based
    line."""

    line: int
    message: str


@dataclass
class PortResult:
    """The ported text of one file and what could not be ported."""

    path: str
    original: str
    text: str
    issues: list[PortIssue] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """Whether any import was rewritten."""
        return self.text != self.original

    def diff(self) -> str:
        """A unified diff from the original to the ported text (empty when unchanged)."""
        absolute = Path(self.path).is_absolute()
        lines = difflib.unified_diff(
            self.original.splitlines(keepends=True), self.text.splitlines(keepends=True),
            fromfile=self.path if absolute else f"a/{self.path}",
            tofile=self.path if absolute else f"b/{self.path}",
        )
        return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


@dataclass(frozen=True)
class _Edit:
    start: int
    end: int
    text: str


class _Source:
    """The file as tokens, with (row, col) → offset conversion for both tokenize and ast
    positions."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = io.StringIO(text).readlines()
        self.offsets = [0]
        for line in self.lines:
            self.offsets.append(self.offsets[-1] + len(line))
        self.tokens = [
            t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type not in _SKIP
        ]
        self.starts = [t.start for t in self.tokens]

    def offset(self, pos: tuple[int, int]) -> int:
        return self.offsets[pos[0] - 1] + pos[1]

    def char_col(self, lineno: int, byte_col: int) -> int:
        """ast columns count UTF-8 bytes; tokenize columns count characters."""
        return len(
            self.lines[lineno - 1].encode("utf-8")[:byte_col].decode("utf-8", errors="replace")
        )

    def token_index(self, node: ast.stmt) -> int:
        """Index of the first token of ``node`` (its ``import`` / ``from`` keyword)."""
        pos = (node.lineno, self.char_col(node.lineno, node.col_offset))
        lo, hi = 0, len(self.starts)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.starts[mid] < pos:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def dotted(self, i: int) -> tuple[str, int, int]:
        """The dotted name starting at token ``i``:
        ``(name, index of its last token, index after it)``."""
        parts = [self.tokens[i].string]
        last = i
        while (
            last + 2 < len(self.tokens) and self.tokens[last + 1].string == "."
            and self.tokens[last + 2].type == tokenize.NAME
        ):
            parts.append(self.tokens[last + 2].string)
            last += 2
        return ".".join(parts), last, last + 1

    def span(self, first: int, last: int) -> tuple[int, int]:
        return self.offset(self.tokens[first].start), self.offset(self.tokens[last].end)


def _common_parent(module: str, names: list[ast.alias]) -> str | None:
    """The agentloop package ``P`` when every name of ``from <module> import a, b`` is a verl module
    that is ``P.a``, ``P.b`` in agentloop (so ``from P import a, b`` binds the same modules); else
    None."""
    parents = set()
    for alias in names:
        moved = map_module(f"{module}.{alias.name}") if alias.name != "*" else None
        if moved is None or not moved.endswith(f".{alias.name}"):
            return None
        parents.add(moved[: -len(alias.name) - 1])
    return parents.pop() if len(parents) == 1 else None


class _Porter:
    """One pass over one file: collects edits and issues
    (docs/porting-from-verl.md#agentloop-port)."""

    def __init__(self, text: str, check_names: bool) -> None:
        self.src = _Source(text)
        self.check_names = check_names
        self.edits: list[_Edit] = []
        self.issues: list[PortIssue] = []
        self.import_tokens: set[int] = set()
        self.bare_rewritten = False

    def run(self, tree: ast.AST) -> str:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and is_verl_module(node.module):
                self._from_import(node)
            elif isinstance(node, ast.Import) and any(is_verl_module(a.name) for a in node.names):
                self._import(node)
        if self.bare_rewritten:
            self._references()
        text = self.src.text
        for edit in sorted(self.edits, key=lambda e: e.start, reverse=True):
            text = text[: edit.start] + edit.text + text[edit.end :]
        return text

    def _issue(self, line: int, message: str) -> None:
        self.issues.append(PortIssue(line, message))

    def _from_import(self, node: ast.ImportFrom) -> None:
        module = str(node.module)
        self._mark_statement(node)
        first = self.src.token_index(node) + 1  # the token after ``from``
        _, last, _ = self.src.dotted(first)
        target = map_module(module)
        # ``from verl.utils import tensordict_utils``: each name a module that moved to one package
        if target is None:
            target = _common_parent(module, node.names)
        problems = [
            p for alias in node.names if (p := self._submodule_problem(module, target, alias))
        ]
        if problems or target is None:
            for problem in problems or [unknown_module_message(module)]:
                self._issue(node.lineno, problem)
            return
        start, end = self.src.span(first, last)
        self.edits.append(_Edit(start, end, target))
        if self.check_names:
            for alias in node.names:
                if alias.name != "*" and (missing := _missing_name(module, target, alias.name)):
                    self._issue(node.lineno, missing)

    def _submodule_problem(self, module: str, target: str | None, alias: ast.alias) -> str | None:
        """``from verl.pkg import mod`` where ``mod`` is a verl module that did not move along
        with ``pkg``."""
        sub = f"{module}.{alias.name}"
        moved = map_module(sub)
        bound = alias.asname or alias.name
        if moved is not None and (target is None or moved != f"{target}.{alias.name}"):
            return (
                f"'from {module} import {alias.name}' imports the verl module {sub}, which "
                f"is {moved} in "
                f"agentloop; write 'import {moved} as {bound}' (see {DOCS_IMPORT_MAP})"
            )
        if (
            moved is None
            and not_provided_reason(sub) is not None
            and not_provided_reason(module) is None
        ):
            return unknown_module_message(sub)
        return None

    def _mark_statement(self, node: ast.stmt) -> None:
        """Keep :meth:`_references` out of this import statement's tokens."""
        first = self.src.token_index(node)
        end_line = node.end_lineno or node.lineno
        end = (end_line, self.src.char_col(end_line, node.end_col_offset or 0))
        last = first
        while last < len(self.src.tokens) and self.src.tokens[last].end <= end:
            last += 1
        self.import_tokens.update(range(first, last))

    def _import(self, node: ast.Import) -> None:
        self._mark_statement(node)
        i = self.src.token_index(node) + 1  # the token after ``import``
        for alias in node.names:
            name, last, after = self.src.dotted(i)
            if is_verl_module(name):
                target = map_module(name)
                if target is None:
                    self._issue(node.lineno, unknown_module_message(name))
                else:
                    self.edits.append(_Edit(*self.src.span(i, last), target))
                    self.bare_rewritten |= alias.asname is None
            if after < len(self.src.tokens) and self.src.tokens[after].string == "as":
                after += 2
            i = after + 1  # skip the comma

    def _references(self) -> None:
        """Rewrite ``verl.x.attr`` in code after a plain ``import verl.x`` became
        ``import agentloop.y``."""
        tokens = self.src.tokens
        i = 0
        while i < len(tokens):
            tok = tokens[i]
            is_root = tok.type == tokenize.NAME and tok.string == "verl"
            after_dot = i > 0 and tokens[i - 1].string == "."
            if not is_root or after_dot or i in self.import_tokens:
                i += 1
                continue
            dotted, last, after = self.src.dotted(i)
            found = map_reference(dotted)
            if found is not None:
                key, target = found
                key_last = i + 2 * key.count(".")
                self.edits.append(_Edit(*self.src.span(i, key_last), target))
            elif "." in dotted:
                self._issue(
                    tok.start[0],
                    f"reference {dotted} is left as it was: " + unknown_module_message(dotted),
                )
            i = after


_module_cache: dict[str, Any] = {}


def _missing_name(verl_module: str, target: str, name: str) -> str | None:
    """None when ``from <target> import <name>`` works, else what to tell the user."""
    if target not in _module_cache:
        try:
            _module_cache[target] = importlib.import_module(target)
        except Exception as e:  # noqa: BLE001 - report any import failure of the target
            _module_cache[target] = e
    mod = _module_cache[target]
    if isinstance(mod, Exception):
        return (
            f"{verl_module} maps to {target}, which cannot be imported "
            f"({type(mod).__name__}: {mod})"
        )
    try:
        getattr(mod, name)
        return None
    except MissingVerlNameError as e:
        return str(e)
    except AttributeError:
        pass
    try:  # a submodule of a package is importable without being an attribute yet
        importlib.import_module(f"{target}.{name}")
        return None
    except ImportError:
        return missing_verl_name(verl_module, name)


def port_source(text: str, path: str = "<string>", *, check_names: bool = True) -> PortResult:
    """Port the source ``text`` of one file (docs/porting-from-verl.md); ``path`` only labels the
    result."""
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as e:
        return PortResult(
            path, text, text, [PortIssue(e.lineno or 0, f"cannot parse the file: {e.msg}")]
        )
    porter = _Porter(text, check_names)
    ported = porter.run(tree)
    issues = sorted(porter.issues, key=lambda p: p.line)
    return PortResult(path, text, ported, issues)


def port_file(path: str | Path, *, write: bool = False, check_names: bool = True) -> PortResult:
    """Port one file; with ``write`` the file is rewritten in place when anything changed.

    The file's encoding (PEP 263 cookie or UTF-8) and line endings are kept.
    """
    p = Path(path)
    raw = p.read_bytes()
    encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
    text = raw.decode(encoding)
    if text.startswith("\ufeff"):
        text = text[1:]
        encoding = "utf-8-sig"
    result = port_source(text, str(path), check_names=check_names)
    if write and result.changed:
        p.write_bytes(result.text.encode(encoding))
    return result


def port_files(
    paths: list[str], *, write: bool = False, check_names: bool = True,
    out: TextIO | None = None, err: TextIO | None = None,
) -> int:
    """Port ``paths``: diffs to ``out``, issues to ``err``; returns the exit status (1 if any
    issue)."""
    out = out or sys.stdout
    err = err or sys.stderr
    status = 0
    for path in paths:
        try:
            result = port_file(path, write=write, check_names=check_names)
        except OSError as e:
            err.write(f"{path}: error: cannot read the file ({e.strerror or e})\n")
            status = 1
            continue
        out.write(result.diff())
        for issue in result.issues:
            err.write(f"{path}:{issue.line}: warning: {issue.message}\n")
        if result.issues:
            status = 1
    return status


def add_port_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``port`` subcommand to the ``agentloop`` CLI's subparsers."""
    parser = subparsers.add_parser(
        "port",
        help="rewrite a verl agent-loop file's imports to agentloop (prints a unified diff)",
        description=f"Rewrite verl imports by agentloop's import map "
        f"({len(VERL_IMPORT_MAP)} modules; "
        f"see {DOCS_IMPORT_MAP}). Exit status 1 when some import could not be ported.",
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="Python files to port")
    parser.add_argument(
        "--write", action="store_true", help="edit the files in place (the diff is still printed)"
    )
    parser.add_argument(
        "--no-check", action="store_true",
        help="do not import agentloop to check that each imported name exists (faster)",
    )
    return parser


def run_port(args: argparse.Namespace) -> int:
    """Run ``agentloop port`` from parsed arguments; returns the exit status."""
    return port_files(list(args.files), write=bool(args.write), check_names=not args.no_check)
