"""Check the package's shape without importing it: import cycles, module size, top-level modules,
explained in-function imports, no nested conditional expressions.

Reads every ``.py`` file under the package (``agentloop/`` by default) with :mod:`ast` and builds
the graph of imports between its modules: module-level and in-function imports alike, relative
imports resolved, ``from pkg import mod`` counted as an import of the submodule when ``mod`` is one,
imports under ``if TYPE_CHECKING:`` included (a cycle in the types is a cycle in the design).
Importing ``pkg.sub.mod`` also runs ``pkg/sub/__init__.py``: that is an edge too, except from a
module inside ``pkg.sub`` (its package is being imported already).  ``importlib`` calls (lazy faces)
are not edges.

Problems (one line each; exit status 1 when there is any):

* ``cycle``: an import cycle, printed as ``a -> b -> a``;
* ``lines``: a module over ``--max-lines`` lines (500);
* ``top``: more than ``--max-top`` modules (6) directly under the package with code of their own; a
  module whose body is only a docstring, imports, ``__all__`` and ``if TYPE_CHECKING:`` imports is a
  face and does not count;
* ``inline``: an import inside a function with no comment saying why (optional dependency, heavy
  import, ...) on its line(s) or the line above; a comment above a run of adjacent imports covers
  the run;
* ``nested-ifexp``: a conditional expression (``x if c else y``) whose test, value or alternative is
  another one, reported once per outermost such expression: write it as ``if``/``elif`` statements
  or a small function.

Usage::

    python scripts/check_structure.py                  # all checks; exit 1 on a problem
    python scripts/check_structure.py --checks cycles,lines
    python scripts/check_structure.py --report         # print everything, always exit 0
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

CHECKS = ("cycles", "lines", "top", "inline", "nested-ifexp")
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Module:
    """One parsed source file."""

    name: str
    path: Path
    tree: ast.Module
    lines: int
    comment_lines: set[int]


@dataclass
class ImportSite:
    """One import statement: its targets inside the package and where it sits."""

    module: str
    targets: list[str]
    lineno: int
    end_lineno: int
    in_function: bool


@dataclass
class Report:
    """What :func:`analyse` found; every list holds one printable line per problem."""

    graph: dict[str, set[str]] = field(default_factory=dict)
    cycles: list[list[str]] = field(default_factory=list)
    components: list[list[str]] = field(default_factory=list)
    long_modules: list[str] = field(default_factory=list)
    top_modules: list[str] = field(default_factory=list)
    inline_imports: list[str] = field(default_factory=list)
    unexplained_inline: list[str] = field(default_factory=list)
    nested_ifexps: list[str] = field(default_factory=list)

    def problems(self, checks: tuple[str, ...], max_top: int) -> list[str]:
        """The problem lines of the selected ``checks``."""
        out: list[str] = []
        if "cycles" in checks:
            for cycle, component in zip(self.cycles, self.components, strict=True):
                more = len(component) - len(cycle) + 1
                tail = (
                    f" (and {more} more modules in the same circle: {', '.join(component)})"
                    if more
                    else ""
                )
                out.append("cycle: " + " -> ".join(cycle) + tail)
        if "lines" in checks:
            out += self.long_modules
        if "top" in checks and len(self.top_modules) > max_top:
            out.append(
                f"top: {len(self.top_modules)} top-level modules with code of their "
                f"own (at most "
                f"{max_top}): {', '.join(self.top_modules)}"
            )
        if "inline" in checks:
            out += self.unexplained_inline
        if "nested-ifexp" in checks:
            out += self.nested_ifexps
        return out


def _module_name(package_dir: Path, path: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _comment_lines(source: str) -> set[int]:
    lines: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                lines.add(tok.start[0])
    except (tokenize.TokenError, SyntaxError):
        pass
    return lines


def load_modules(package_dir: Path) -> dict[str, Module]:
    """Parse every ``.py`` file under ``package_dir``.

    Raises:
        SyntaxError: a file does not parse.
    """
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        name = _module_name(package_dir, path)
        modules[name] = Module(name, path, ast.parse(source, str(path)), len(source.splitlines()),
                               _comment_lines(source))
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, in_function: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import under ``node`` with whether it sits in a function (a def or lambda at any
    depth)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        else:
            inner = in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            yield from _walk(child, inner)


def _base_of(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.name.split(".")
    if module.path.name != "__init__.py":
        package.pop()
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _targets(module: Module, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    """The package's modules that ``node`` imports (the longest known prefix of each dotted
    name)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = _base_of(module, node)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            names.append(sub if sub in known else base)
    out = []
    for name in names:
        parts = name.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()
        if parts and ".".join(parts) not in out:
            out.append(".".join(parts))
    return out


def _with_packages(importer: str, targets: list[str], known: set[str]) -> list[str]:
    """``targets`` plus the packages whose ``__init__`` importing them runs, but not
    ``importer``'s own."""
    out = list(targets)
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts)):
            package = ".".join(parts[:i])
            if package in known and not importer.startswith(package + ".") and package not in out:
                out.append(package)
    return out


def import_sites(modules: dict[str, Module]) -> list[ImportSite]:
    """Every import statement of every module that reaches another module of the package."""
    known = set(modules)
    sites = []
    for module in modules.values():
        for node, in_function in _walk(module.tree, False):
            targets = _with_packages(module.name, _targets(module, node, known), known)
            targets = [t for t in targets if t != module.name]
            sites.append(
                ImportSite(
                    module.name, targets, node.lineno, node.end_lineno or node.lineno, in_function
                )
            )
    return sites


def _sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first node, staying inside the component."""
    members = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    return component + [start]


def _is_face(tree: ast.Module) -> bool:
    """A module whose body is only a docstring, imports, ``__all__`` and TYPE_CHECKING imports."""
    for i, stmt in enumerate(tree.body):
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            continue
        if i == 0 and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue
        if isinstance(stmt, ast.If) and _is_type_checking(stmt.test) and not stmt.orelse and all(
                isinstance(s, (ast.Import, ast.ImportFrom)) for s in stmt.body):
            continue
        targets: list[ast.expr] = []
        if isinstance(stmt, ast.Assign):
            targets = stmt.targets
        elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
            targets = [stmt.target]
        if targets and all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            continue
        return False
    return True


def nested_ifexp_lines(tree: ast.AST) -> list[int]:
    """The lines of the conditional expressions whose test, value or alternative is another
    conditional expression; an expression nested that way is not reported again
    (``a if x else b if y else c if z else d`` is one finding)."""
    inner: set[int] = set()  # ids of conditional expressions directly inside another one
    lines: list[int] = []
    for node in ast.walk(tree):  # breadth first: an expression comes before the ones inside it
        if not isinstance(node, ast.IfExp):
            continue
        nested = [
            part for part in (node.test, node.body, node.orelse) if isinstance(part, ast.IfExp)
        ]
        if nested and id(node) not in inner:
            lines.append(node.lineno)
        inner.update(id(part) for part in nested)
    return sorted(lines)


def analyse(package_dir: Path, max_lines: int = 500) -> Report:
    """Parse ``package_dir`` and collect every finding (see the module docstring)."""
    modules = load_modules(package_dir)
    report = Report(graph={name: set() for name in modules})
    sites = import_sites(modules)
    import_lines: dict[str, set[int]] = {name: set() for name in modules}
    for site in sites:
        import_lines[site.module].update(range(site.lineno, site.end_lineno + 1))
    for site in sites:
        report.graph[site.module].update(site.targets)
        if site.in_function:
            module = modules[site.module]
            where = f"{module.path.relative_to(package_dir.parent)}:{site.lineno}"
            report.inline_imports.append(where)
            first = site.lineno
            # the run of adjacent imports it belongs to
            while first - 1 in import_lines[site.module]:
                first -= 1
            explained = any(
                n in module.comment_lines for n in range(first - 1, site.end_lineno + 1)
            )
            if not explained:
                report.unexplained_inline.append(
                    f"inline: {where}: import inside a function without a comment saying why"
                )
    report.components = _sccs(report.graph)
    report.cycles = [_shortest_cycle(report.graph, c) for c in report.components]
    for module in modules.values():
        rel = module.path.relative_to(package_dir.parent)
        if module.lines > max_lines:
            report.long_modules.append(
                f"lines: {rel} has {module.lines} lines (at most {max_lines})"
            )
        report.nested_ifexps += [f"nested-ifexp: {rel}:{line}: nested conditional expression"
                                 for line in nested_ifexp_lines(module.tree)]
    package = package_dir.name
    report.top_modules = sorted(
        name
        for name, module in modules.items()
        if name.count(".") == 1
        and module.path.name != "__init__.py"
        and module.path.parent == package_dir
        and not _is_face(module.tree)
        and name.startswith(package + ".")
    )
    return report


def main(argv: list[str] | None = None) -> int:
    """Command line: print the problems; 1 when there is any (0 with ``--report``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--package", type=Path, default=ROOT / "agentloop", help="package directory"
    )
    parser.add_argument(
        "--checks", default=",".join(CHECKS), help=f"comma-separated subset of {CHECKS}"
    )
    parser.add_argument("--max-lines", type=int, default=500)
    parser.add_argument("--max-top", type=int, default=6)
    parser.add_argument("--report", action="store_true",
                        help="also list top-level modules and in-function imports; never fail")
    args = parser.parse_args(argv)
    checks = tuple(c.strip() for c in args.checks.split(",") if c.strip())
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        parser.error(f"unknown checks {unknown}; choose from {CHECKS}")
    report = analyse(args.package, args.max_lines)
    problems = report.problems(checks, args.max_top)
    for line in problems:
        print(line)
    if args.report:
        print(
            f"# {len(report.top_modules)} top-level modules with code: "
            f"{', '.join(report.top_modules)}"
        )
        print(f"# {len(report.inline_imports)} imports inside functions "
              f"({len(report.unexplained_inline)} without a comment)")
        return 0
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
