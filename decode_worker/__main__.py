"""`python -m decode_worker`: run one decode worker (flags: baton.worker.args)."""

from __future__ import annotations

from baton.worker.args import run_worker
from decode_worker.worker import DecodeWorker


def main(argv: list[str] | None = None) -> None:
    run_worker(DecodeWorker, argv)


if __name__ == "__main__":
    main()
