"""`python -m decode_worker`: run one decode worker."""

from __future__ import annotations

import argparse

from baton.worker.args import run_worker, speculative_config_arg
from decode_worker.worker import DecodeWorker


def _decode_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scheduler-policy", default="max-utilization", choices=["max-utilization", "no-evict"])
    parser.add_argument("--speculative-config", type=speculative_config_arg, default=None,
                        help='speculative decoding as JSON in vLLM\'s shape, e.g. \'{"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
                             "(default: off)")


def main(argv: list[str] | None = None) -> None:
    run_worker(DecodeWorker, argv, _decode_args)


if __name__ == "__main__":
    main()
