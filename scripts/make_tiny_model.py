"""Build (or find) the tiny local test model and print its directory.

    python scripts/make_tiny_model.py [--out DIR] [--force] [--quiet]

Without ``--out`` the model goes to ``$AGENTLOOP_CACHE_DIR/tiny-qwen2`` (default
``~/.cache/agentloop/models/tiny-qwen2``).  An up-to-date model is reused; otherwise the trained
copy shipped in the package (``agentloop/assets``) is copied there (no training).  ``--force``
trains it again from scratch (~4-6 min on 2 idle cores) and says whether the result is bit-for-bit
the shipped model (same content hash).
"""

from __future__ import annotations

import argparse
import sys
import time

from agentloop.testing.tiny_model import (
    SHIPPED_DIR,
    content_hash,
    ensure_tiny_model,
    tiny_model_path,
)


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, build or reuse the model, print its path (last line of stdout)."""
    parser = argparse.ArgumentParser(
        description="Build (or find) the tiny local test model and print its path."
    )
    parser.add_argument("--out", help=f"model directory (default: {tiny_model_path()})")
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if an up-to-date model is present"
    )
    parser.add_argument("--quiet", action="store_true", help="print only the path")
    parser.add_argument(
        "--train-steps", type=int, default=None,
        help="training steps on synthetic tool-use conversations (default: TRAIN_STEPS; 0: random)",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = ensure_tiny_model(args.out, force=args.force, train_steps=args.train_steps)
    if not args.quiet:
        print(f"tiny model ready in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    shipped = SHIPPED_DIR / path.name
    if args.force and (shipped / "model.safetensors").is_file():
        same = content_hash(path) == content_hash(shipped)
        print(
            f"rebuilt model {'equals' if same else 'DIFFERS FROM'} the shipped one "
            f"({shipped}): content hash "
            f"{content_hash(path)[:16]} vs {content_hash(shipped)[:16]}",
            file=sys.stderr,
        )
    print(path)


if __name__ == "__main__":
    main()
