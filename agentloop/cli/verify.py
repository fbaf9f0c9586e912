"""``agentloop verify OUTPUT_DIR --model PATH [--atol A] [--temperature T ...]``: check a saved
rollout against the HF model (log-probs) and the chat template (tool/user-turn tokens); see
:mod:`agentloop.report.verify`.

Exit codes: 0 passed; 2 bad input (no rollout / no log-probs / a model that does not fit), one line
``agentloop: error: ...``; :data:`EXIT_VERIFY_FAILED` (3, as the rollout's "ran, but outside the
accepted bounds") when a log-prob differs by more than ``--atol`` or a tool/user turn is not the
template's rendering.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from agentloop.cli.failures import EXIT_TOO_MANY_FAILURES
from agentloop.report.verify import DEFAULT_ATOL, format_result, sampling_of, verify_rollout

EXIT_VERIFY_FAILED = EXIT_TOO_MANY_FAILURES


def add_verify_parser(sub: Any) -> None:
    """Register the ``verify`` subcommand on ``sub`` (an argparse subparsers object)."""
    parser = sub.add_parser(
        "verify",
        help="recompute a rollout's log-probs with the HF model and check tool "
        "turns against the template",
        description="Recomputes rollout_log_probs with the HF model (fp32, CPU) on every "
        "trajectory of "
        "OUTPUT_DIR/rollout.dataproto and, when the rollout saved its conversations "
        "(multi_turn.return_messages), "
        "checks the tool/user-turn tokens (response_mask 0) against the chat template. Exit "
        "codes: 0 passed; "
        f"2 bad input; {EXIT_VERIFY_FAILED} a log-prob off by more than --atol or a turn "
        f"not the template's.",
    )
    parser.add_argument(
        "output_dir", help="the output_dir of an `agentloop rollout` run (holds rollout.dataproto)"
    )
    parser.add_argument(
        "--model", required=True, help="the HF model directory the rollout used (model.path)"
    )
    parser.add_argument(
        "--atol",
        type=float,
        default=DEFAULT_ATOL,
        help=f"largest accepted |rollout - HF| log-prob difference in nats "
        f"(default {DEFAULT_ATOL:g}, "
        "for an fp32 engine; use ~0.1 or more for bf16)",
    )
    parser.add_argument(
        "--temperature", type=float, default=None,
        help="the rollout's temperature (default: OUTPUT_DIR/config.yaml, else 1.0)",
    )
    parser.add_argument(
        "--top-k", type=int, default=None,
        help="the rollout's top_k (default: config.yaml, else -1)",
    )
    parser.add_argument(
        "--top-p", type=float, default=None,
        help="the rollout's top_p (default: config.yaml, else 1)",
    )
    parser.add_argument(
        "--logprobs-mode", choices=("processed_logprobs", "raw_logprobs"), default=None,
        help="the rollout's logprobs_mode (default: config.yaml, else processed_logprobs)",
    )


def run_verify(args: argparse.Namespace) -> int:
    """Verify ``args.output_dir``; prints the numbers and returns the exit code."""
    spec = sampling_of(
        Path(args.output_dir).expanduser(), temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, logprobs_mode=args.logprobs_mode,
    )
    result = verify_rollout(args.output_dir, args.model, spec)
    for line in format_result(result, args.atol, spec):
        print(line)
    return 0 if result.passed(args.atol) else EXIT_VERIFY_FAILED
