"""`hf-triforce demo` (also `python -m hf_triforce demo`)."""

from __future__ import annotations

import argparse
import sys


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-triforce", description="Exact TriForce speculative decoding")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="plain generate vs TriForce on SmolLM2-135M and a Shakespeare play")
    demo.add_argument("--context", type=_positive, default=4096, help="prompt tokens (default 4096)")
    demo.add_argument("--new-tokens", type=_positive, default=96, help="tokens to generate (default 96)")
    demo.add_argument("--draft", action="append", choices=["self", "ngram"],
                      help="Force-1 drafter(s) to run (default: self and ngram)")
    demo.add_argument("--budget", type=_positive, default=512, help="retrieval budget in tokens (default 512)")
    demo.add_argument("--play", default="hamlet", help="Shakespeare tragedy used as the prompt (default hamlet)")
    demo.add_argument("--threads", type=_positive, default=None, help="torch threads (default: torch's choice)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .assets import SHAKESPEARE_PLAYS
        from .demo import run_demo

        if args.play not in SHAKESPEARE_PLAYS:
            raise SystemExit(f"hf-triforce demo: --play must be one of {', '.join(SHAKESPEARE_PLAYS)}")
        return run_demo(args.context, args.new_tokens, args.draft or ["self", "ngram"], args.budget, args.play,
                        args.threads)
    return 2


if __name__ == "__main__":
    sys.exit(main())
