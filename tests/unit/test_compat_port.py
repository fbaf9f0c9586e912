"""``agentloop port``: only verl module names in imports change; unknown modules are reported,
exit 1."""

from __future__ import annotations

import importlib
import re
import textwrap
from pathlib import Path

import pytest

from agentloop.cli.rollout import main as cli_main
from agentloop.compat.import_map import (
    VERL_IMPORT_MAP,
    VERL_NOT_PROVIDED,
    MissingVerlNameError,
    import_map_markdown,
    map_reference,
    not_provided_markdown,
)
from agentloop.compat.port import port_file, port_source

DOCS = Path(__file__).resolve().parents[2] / "docs" / "porting-from-verl.md"


def _port(src: str, check_names: bool = False):
    return port_source(textwrap.dedent(src), "loop.py", check_names=check_names)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("from verl import DataProto\n", "from agentloop import DataProto\n"),
        ("from verl.protocol import DataProto\n", "from agentloop.protocol import DataProto\n"),
        ("import verl.protocol as vp\n", "import agentloop.protocol as vp\n"),
        ("import verl.utils.profiler\n", "import agentloop.compat.profiler\n"),
        ("import os, verl.protocol as p, json\n", "import os, agentloop.protocol as p, json\n"),
        (
            "from verl.experimental.agent_loop import AgentLoopBase, register\n",
            "from agentloop.compat.agent_loop import AgentLoopBase, register\n",
        ),
        (
            "from verl.experimental.agent_loop.tool_agent_loop import AgentData, "
            "ToolAgentLoop as T\n",
            "from agentloop.loops.tool_agent import AgentData, ToolAgentLoop as T\n",
        ),
        (
            "from verl.workers.rollout.replica import TokenOutput\n",
            "from agentloop.types import TokenOutput\n",
        ),
        (
            "from verl.utils.rollout_trace import rollout_trace_op  # verl.protocol\n",
            "from agentloop.compat.rollout_trace import rollout_trace_op  # verl.protocol\n",
        ),
    ],
)
def test_rewrites_one_import(before, after):
    result = _port(before)
    assert result.text == after and result.issues == []


def test_multiline_import_keeps_layout_and_comments():
    result = _port("""\
        from verl.experimental.agent_loop.agent_loop import (  # the base
            AgentLoopBase,
            AgentLoopOutput,  # the output
        )
        """)
    assert result.text == textwrap.dedent("""\
        from agentloop.compat.agent_loop import (  # the base
            AgentLoopBase,
            AgentLoopOutput,  # the output
        )
        """)


def test_strings_comments_and_relative_imports_untouched():
    src = '''\
        """Docs: from verl.protocol import DataProto."""
        from . import verl
        from .verl.protocol import x
        s = "import verl.protocol"  # import verl.utils.profiler
        t = f"{verl} verl.protocol.DataProto"
        def f():
            import verl.tools.schemas as sc  # a nested import is an import too
        '''
    result = _port(src)
    expected = textwrap.dedent(src).replace(
        "import verl.tools.schemas as sc", "import agentloop.tools.schemas as sc"
    )
    assert result.text == expected and result.issues == []


def test_plain_import_rewrites_dotted_references():
    result = _port("""\
        import verl
        import verl.utils.profiler

        def g(timing, verl_like):
            with verl.utils.profiler.simple_timer("gen", timing):
                return verl.DataProto, verl.protocol.DataProto, verl_like.verl.protocol
        """)
    assert result.text == textwrap.dedent("""\
        import agentloop
        import agentloop.compat.profiler

        def g(timing, verl_like):
            with agentloop.compat.profiler.simple_timer("gen", timing):
                return agentloop.DataProto, agentloop.protocol.DataProto, verl_like.verl.protocol
        """)


def test_unmapped_reference_is_reported():
    result = _port("import verl\nworkers = verl.single_controller.ray.RayWorkerGroup\n")
    assert result.text == "import agentloop\nworkers = verl.single_controller.ray.RayWorkerGroup\n"
    (issue,) = result.issues
    assert issue.line == 2 and "verl.single_controller.ray.RayWorkerGroup" in issue.message


def test_aliased_import_leaves_references_alone():
    src = "import verl.protocol as verl\nx = verl.DataProto\n"
    assert _port(src).text == "import agentloop.protocol as verl\nx = verl.DataProto\n"


def test_unknown_module_is_left_and_reported():
    result = _port("""\
        from verl.single_controller.ray import RayWorkerGroup
        from verl.some.future.module import Thing
        from verl.protocol import DataProto
        """)
    assert result.text.splitlines()[:2] == [
        "from verl.single_controller.ray import RayWorkerGroup",
        "from verl.some.future.module import Thing",
    ]
    assert result.text.splitlines()[2] == "from agentloop.protocol import DataProto"
    (a, b) = result.issues
    assert (
        a.line == 1 and "verl.single_controller.ray" in a.message and "#not-provided" in a.message
    )
    assert "worker_group" in a.message
    assert b.line == 2 and "verl.some.future.module" in b.message and "#import-map" in b.message


def test_submodule_from_import_gives_replacement():
    result = _port("from verl.experimental.agent_loop import tool_agent_loop\n")
    assert result.text == "from verl.experimental.agent_loop import tool_agent_loop\n"
    assert "import agentloop.loops.tool_agent as tool_agent_loop" in result.issues[0].message
    # a submodule that keeps its place relative to its package needs nothing
    assert _port("from verl import protocol\n").text == "from agentloop import protocol\n"
    # a package verl has no mirror of, whose imported modules all moved under one agentloop package
    # (verl's
    # own DataProto tests import tensordict_utils this way)
    ported = _port("from verl.utils import tensordict_utils as tu\n")
    assert (
        ported.text == "from agentloop.utils import tensordict_utils as tu\n" and not ported.issues
    )
    mixed = _port("from verl.utils import tensordict_utils, no_such_module\n")
    assert (
        mixed.text == "from verl.utils import tensordict_utils, no_such_module\n" and mixed.issues
    )


def test_idempotent():
    src = """\
        import verl.utils.profiler
        from verl import DataProto
        from verl.fancy import Unknown
        x = verl.utils.profiler.simple_timer
        """
    once = _port(src)
    twice = port_source(once.text, "loop.py", check_names=False)
    assert once.changed and twice.text == once.text and not twice.changed
    assert [i.message for i in twice.issues] == [i.message for i in once.issues]


def test_name_check_reports_names_agentloop_lacks():
    result = _port("""\
        from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopWorkerBase
        from verl import DataProto
        """, check_names=True)
    assert result.text.startswith(
        "from agentloop.compat.agent_loop import AgentLoopBase, AgentLoopWorkerBase"
    )
    (issue,) = result.issues
    assert "AgentLoopWorkerBase" in issue.message and "#not-provided" in issue.message


def test_mirror_module_raises_import_error_naming_verl_name():
    with pytest.raises(
        MissingVerlNameError, match=r"AgentLoopWorkerBase.*porting-from-verl.md#not-provided"
    ):
        from agentloop.compat.agent_loop import AgentLoopWorkerBase  # noqa: F401
    mirror = importlib.import_module("agentloop.compat.agent_loop")
    assert not hasattr(mirror, "__wrapped__")  # dunders stay AttributeError (inspect, pickle)
    from agentloop.compat.agent_loop import SingleTurnAgentLoop, ToolAgentLoop
    from agentloop.loops.single_turn import SingleTurnAgentLoop as Ours
    from agentloop.loops.tool_agent import ToolAgentLoop as OursTool

    assert SingleTurnAgentLoop is Ours and ToolAgentLoop is OursTool


def test_syntax_error_is_an_issue():
    result = _port("from verl import (\n")
    assert not result.changed and "cannot parse" in result.issues[0].message


def test_cli_prints_diff_and_exit_status(tmp_path, capsys):
    good = tmp_path / "good.py"
    good.write_text("from verl.protocol import DataProto\n")
    with pytest.raises(SystemExit) as exit_:
        cli_main(["port", str(good), "--no-check"])
    out = capsys.readouterr()
    assert exit_.value.code == 0 and out.err == ""
    assert (
        "-from verl.protocol import DataProto" in out.out
        and "+from agentloop.protocol import DataProto" in out.out
    )
    assert good.read_text() == "from verl.protocol import DataProto\n"  # no --write: untouched

    bad = tmp_path / "bad.py"
    bad.write_text("from verl.utils.fs import copy_to_local\n")
    with pytest.raises(SystemExit) as exit_:
        cli_main(["port", str(good), str(bad), "--no-check"])
    out = capsys.readouterr()
    assert exit_.value.code == 1
    assert re.search(rf"{re.escape(str(bad))}:1: warning: verl.utils.fs .*#not-provided", out.err)


def test_write_edits_in_place_keeping_line_endings(tmp_path, capsys):
    path = tmp_path / "loop.py"
    path.write_bytes(b"import json\r\nfrom verl import DataProto\r\n")
    with pytest.raises(SystemExit) as exit_:
        cli_main(["port", str(path), "--write", "--no-check"])
    assert exit_.value.code == 0 and "+from agentloop import DataProto" in capsys.readouterr().out
    assert path.read_bytes() == b"import json\r\nfrom agentloop import DataProto\r\n"
    assert not port_file(path, check_names=False).changed


def test_map_is_most_specific_first_and_targets_are_agentloop():
    keys = list(VERL_IMPORT_MAP)
    for i, key in enumerate(keys):
        assert all(not key.startswith(earlier + ".") for earlier in keys[:i]), key
    assert all(
        target == "agentloop" or target.startswith("agentloop.")
        for target in VERL_IMPORT_MAP.values()
    )
    assert not set(VERL_IMPORT_MAP) & set(VERL_NOT_PROVIDED)
    assert map_reference("verl.utils.profiler.simple_timer") == (
        "verl.utils.profiler",
        "agentloop.compat.profiler",
    )
    # `verl` alone only covers verl's top-level names
    assert map_reference("verl.utils.fs.copy_to_local") is None


def test_docs_tables_match_the_map():
    text = DOCS.read_text()
    for tag, table in (
        ("import-map", import_map_markdown()),
        ("not-provided", not_provided_markdown()),
    ):
        found = re.search(rf"<!-- {tag}:begin -->\n(.*?)\n<!-- {tag}:end -->", text, re.S)
        assert found, f"docs/porting-from-verl.md lost its {tag} markers"
        assert found.group(1) == table, (
            f"regenerate with: python -m agentloop.compat.import_map ({tag})"
        )


@pytest.mark.parametrize("target", sorted(set(VERL_IMPORT_MAP.values())))
def test_every_target_module_imports(target):
    importlib.import_module(target)
