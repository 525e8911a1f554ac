"""`python -m prefill_worker`: run one prefill worker."""

from __future__ import annotations

import argparse

from baton.worker.args import run_worker
from prefill_worker.worker import PrefillWorker


def prefill_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pooling-step-tokens", type=int, default=None,
                        help="embeddings input tokens per engine step; a chat prompt that arrives meanwhile waits "
                             "for that step, then runs alone (default: --max-num-batched-tokens / 8)")


def main(argv: list[str] | None = None) -> None:
    run_worker(PrefillWorker, argv, prefill_args)


if __name__ == "__main__":
    main()
