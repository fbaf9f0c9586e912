"""Alternate one benchmark command between two checkouts (A, B, A, B, ...) and print each tree's
per-line figures.

    python scripts/bench_trees.py --base ../base --rounds 4 -- scripts/bench_stack.py --n 8
    --repeats 5

Each round runs the command once in each tree (as a fresh process, with that tree first on
PYTHONPATH) and collects the lines matching --pattern; a figure is the number before --unit on such
a line.  ``--figure LABEL=REGEX`` (repeatable) instead takes the first group of REGEX, searched in
the whole output, as figure LABEL (for figures without a unit, e.g. bench_overhead's ratios):

    python scripts/bench_trees.py --base ../base --rounds 4 \
        --figure "ratio agentloop/raw=paired passes: median ([0-9.]+)" \
        --figure "serial ms=serial time per batch .*median ([0-9.]+) ms" \
        -- scripts/bench_overhead.py --repeats 5

Prints per tree and per label the median over rounds, and the paired ratio new/base.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path


def run(tree: Path, cmd: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run(
        [sys.executable, *cmd], cwd=tree, env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode:
        raise SystemExit(
            f"{tree}: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return proc.stdout


def figures(text: str, pattern: str, unit: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if re.search(pattern, line):
            m = re.search(rf"([0-9.]+)\s*{re.escape(unit)}", line)
            if m:
                out[line[: m.start()].strip()] = float(m.group(1))
    return out


def named_figures(text: str, specs: list[str]) -> dict[str, float]:
    """``LABEL=REGEX`` specs: LABEL's figure is REGEX's first group at its first match in ``text``
    (labels whose REGEX does not match are left out)."""
    out = {}
    for spec in specs:
        label, _, regex = spec.partition("=")
        m = re.search(regex, text)
        if m:
            out[label] = float(m.group(1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="checkout of the baseline commit")
    parser.add_argument("--new", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--pattern", default="µs/row")
    parser.add_argument("--unit", default="µs/row")
    parser.add_argument(
        "--figure", action="append", default=[], metavar="LABEL=REGEX",
        help="a figure: REGEX's first group in the output (repeatable; replaces --pattern)",
    )
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    trees = {"base": args.base.resolve(), "new": args.new.resolve()}
    unit = "" if args.figure else args.unit
    seen: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    for r in range(args.rounds):
        for name, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
            text = run(tree, cmd)
            found = (
                named_figures(text, args.figure)
                if args.figure
                else figures(text, args.pattern, args.unit)
            )
            for label, value in found.items():
                seen[name].setdefault(label, []).append(value)
                print(f"round {r} {name:<4} {label} {value:g} {unit}", flush=True)
    for label in seen["base"]:
        base, new = seen["base"][label], seen["new"].get(label, [])
        if not new:
            continue
        ratios = [n / b for n, b in zip(new, base, strict=False)]
        print(
            f"{label}: base {statistics.median(base):g}, new {statistics.median(new):g} "
            f"{unit} (medians of "
            f"{len(base)}); new/base paired median {statistics.median(ratios):.3f} "
            f"(range {min(ratios):.3f}-{max(ratios):.3f})"
        )


if __name__ == "__main__":
    main()
