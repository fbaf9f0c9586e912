"""The package's shape (scripts/check_structure.py): no import cycles, no module over 500 lines, few
top-level modules, explained in-function imports, no nested conditional expressions; and the checker
itself on small trees it must judge."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "check_structure", REPO / "scripts" / "check_structure.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


check_structure = _load_checker()


@pytest.fixture(scope="module")
def report():  # type: ignore[no-untyped-def]
    return check_structure.analyse(REPO / "agentloop")


def test_no_import_cycles(report) -> None:  # type: ignore[no-untyped-def]
    problems = report.problems(("cycles",), 6)
    assert not problems, "\n".join(problems)


def test_no_module_over_500_lines(report) -> None:  # type: ignore[no-untyped-def]
    problems = report.problems(("lines",), 6)
    assert not problems, "\n".join(problems)


def test_at_most_six_top_level_modules_with_code(report) -> None:  # type: ignore[no-untyped-def]
    problems = report.problems(("top",), 6)
    assert not problems, "\n".join(problems)


def test_every_import_inside_a_function_says_why(report) -> None:  # type: ignore[no-untyped-def]
    problems = report.problems(("inline",), 6)
    assert not problems, "\n".join(problems)


def test_no_nested_conditional_expressions(report) -> None:  # type: ignore[no-untyped-def]
    problems = report.problems(("nested-ifexp",), 6)
    assert not problems, "\n".join(problems)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_checker_finds_a_cycle_through_a_function_level_and_a_relative_import(
    tmp_path: Path,
) -> None:
    pkg = _tree(tmp_path, {
        "__init__.py": "", "a.py": "from pkg.sub import b\n", "sub/__init__.py": "",
        "sub/b.py": "def f():\n    from .. import c  # lazy\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
    })
    report = check_structure.analyse(pkg)
    assert report.cycles == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
    assert report.problems(("cycles",), 6) == ["cycle: pkg.a -> pkg.sub.b -> pkg.c -> pkg.a"]


def test_checker_counts_the_package_init_an_import_runs_but_not_the_importers_own(
    tmp_path: Path,
) -> None:
    pkg = _tree(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg.sub.b import x\n",  # runs pkg/sub/__init__.py, which imports pkg.a
        "sub/__init__.py": "from pkg.a import y\n",
        "sub/b.py": "from pkg.sub.c import z\n",  # inside pkg.sub: its own package is no edge
        "sub/c.py": "",
    })
    report = check_structure.analyse(pkg)
    assert report.cycles == [["pkg.a", "pkg.sub", "pkg.a"]]
    assert report.graph["pkg.sub.b"] == {"pkg.sub.c"}


def test_checker_flags_long_modules_unexplained_inline_imports_and_counts_faces(
    tmp_path: Path,
) -> None:
    pkg = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "face.py": '"""A face."""\nfrom pkg.big import x\n__all__ = ["x"]\n',
            "big.py": "x = 1\n" * 501,
            "lazy.py": "def f():\n    import json\n    # optional dependency\n    import yaml\n\n"
            "def g():\n    import csv  # heavy\n\n"
            "def h():\n    # heavy, both\n    import csv\n    from json import (\n   "
            "     dumps,\n    )\n",
        },
    )
    report = check_structure.analyse(pkg, max_lines=500)
    assert report.long_modules == ["lines: pkg/big.py has 501 lines (at most 500)"]
    assert report.top_modules == ["pkg.big", "pkg.lazy"]  # face.py only re-exports
    assert report.unexplained_inline == [
        "inline: pkg/lazy.py:2: import inside a function without a comment saying why"
    ]
    assert report.problems(("top",), 1)[0].startswith("top: 2 top-level modules")


def test_checker_flags_each_outermost_nested_conditional_expression_once(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "flat.py": "x = 1 if a else 2\ny = (1 if a else 2) + (3 if b else 4)\nz = [i if i "
            "else 0 for i in r]\n",
            "deep.py": "def f(a, b, c):\n"
            "    return 1 if a else 2 if b else 3 if c else 4\n"  # a chain: one finding
            "x = (1 if a else 2) if b else 3\n"  # in the value
            "y = 1 if (a if b else c) else 2\n"  # in the test
            "z = 1 if a else (2 or (3 if b else 4))\n",  # not directly inside: allowed
        },
    )
    report = check_structure.analyse(pkg)
    assert report.nested_ifexps == [
        f"nested-ifexp: pkg/deep.py:{line}: nested conditional expression" for line in (2, 3, 4)
    ]
    assert check_structure.main(["--package", str(pkg)]) == 1
    assert check_structure.main(["--package", str(pkg), "--checks", "cycles,lines,top,inline"]) == 0


def test_command_line_fails_on_a_problem_and_reports_without_failing(
    tmp_path: Path, capsys
) -> None:  # type: ignore[no-untyped-def]
    pkg = _tree(tmp_path, {"__init__.py": "", "a.py": "import pkg.b\n", "b.py": "import pkg.a\n"})
    assert check_structure.main(["--package", str(pkg), "--checks", "cycles"]) == 1
    assert capsys.readouterr().out.splitlines() == ["cycle: pkg.a -> pkg.b -> pkg.a"]
    assert check_structure.main(["--package", str(pkg), "--report"]) == 0
