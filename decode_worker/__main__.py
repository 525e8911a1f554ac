"""`python -m decode_worker`: run one decode worker."""

from __future__ import annotations

import argparse

from baton.worker.args import run_worker
from decode_worker.worker import DecodeWorker


def _decode_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scheduler-policy", default="max-utilization", choices=["max-utilization", "no-evict"])


def main(argv: list[str] | None = None) -> None:
    run_worker(DecodeWorker, argv, _decode_args)


if __name__ == "__main__":
    main()
