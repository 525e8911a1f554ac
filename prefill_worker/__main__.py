"""`python -m prefill_worker`: run one prefill worker (flags: baton.worker.args)."""

from __future__ import annotations

from baton.worker.args import run_worker
from prefill_worker.worker import PrefillWorker


def main(argv: list[str] | None = None) -> None:
    run_worker(PrefillWorker, argv)


if __name__ == "__main__":
    main()
