"""Build (or find) the tiny local test model and print its directory.

    python scripts/make_tiny_model.py [--out DIR] [--force] [--quiet]
"""

from __future__ import annotations

import argparse
import time

from agentloop.testing.tiny_model import ensure_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--out", help="model directory (default: ~/.cache/agentloop/models/tiny-qwen2)")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    parser.add_argument("--quiet", action="store_true", help="print only the path")
    args = parser.parse_args()
    t0 = time.perf_counter()
    path = ensure_tiny_model(args.out, force=args.force)
    if not args.quiet:
        print(f"tiny model ready in {time.perf_counter() - t0:.1f}s:")
    print(path)


if __name__ == "__main__":
    main()
