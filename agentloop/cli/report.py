"""``agentloop report OUTPUT_DIR [--embed]``: plots and an HTML page for a finished rollout.

Writes ``OUTPUT_DIR/report/*.png`` and ``OUTPUT_DIR/report.html`` (see
:mod:`agentloop.report.html`).  Exit codes follow the CLI's contract: 0 written; 2 bad input (no
such directory, no ``rollout.dataproto``, not a rollout), printed as one line
``agentloop: error: ...``.
"""

from __future__ import annotations

import argparse
from typing import Any

from agentloop.report.html import write_report


def add_report_parser(sub: Any) -> None:
    """Register the ``report`` subcommand on ``sub`` (an argparse subparsers object)."""
    parser = sub.add_parser(
        "report",
        help="plots + report.html for a rollout's output directory",
        description="Writes OUTPUT_DIR/report/*.png (response lengths, turns, tool calls, "
        "status, reward by turns, "
        "per-server timeline of generate calls) and OUTPUT_DIR/report.html. Exit codes: 0 "
        "written; 2 bad input.",
    )
    parser.add_argument(
        "output_dir", help="the output_dir of an `agentloop rollout` run (holds rollout.dataproto)"
    )
    parser.add_argument(
        "--embed", action="store_true",
        help="inline the PNGs in report.html (one self-contained file)",
    )


def run_report(args: argparse.Namespace) -> int:
    """Write the report for ``args.output_dir``; returns the exit code (errors raise
    AgentLoopError)."""
    page = write_report(args.output_dir, embed=bool(args.embed))
    print(f"report: {page.resolve()}")
    return 0
