"""`python -m prefill_worker`: run one prefill worker."""

from __future__ import annotations

import argparse
import asyncio

from baton.worker_args import add_common_args
from baton.worker_runtime import setup_logging


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m prefill_worker", description=__doc__)
    add_common_args(parser, "prefill")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    from prefill_worker.worker import PrefillWorker

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(PrefillWorker(args).run())


if __name__ == "__main__":
    main()
