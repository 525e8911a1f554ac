"""`python -m decode_worker`: run one decode worker."""

from __future__ import annotations

import argparse
import asyncio

from baton.worker_args import add_common_args
from baton.worker_runtime import setup_logging


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m decode_worker", description=__doc__)
    add_common_args(parser, "decode")
    parser.add_argument("--scheduler-policy", default="max-utilization", choices=["max-utilization", "no-evict"])
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    from decode_worker.worker import DecodeWorker

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(DecodeWorker(args).run())


if __name__ == "__main__":
    main()
