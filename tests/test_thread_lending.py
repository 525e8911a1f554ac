"""The core-share ledger (baton/worker/thread_lending.py): an idle prefill worker lends its threads to a
decode worker of the same machine, and takes them back before it computes, waiting for the step
that runs on them. Real files, mapped as the workers map them; both sides in one process."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from baton.worker import thread_lending
from baton.worker.thread_lending import (LEND_AFTER_S, MAX_BORROWING_STEP_S, Borrower, Ledger, Lender, StepCores,
                                     run_with_threads)


@pytest.fixture
def ledger_path(tmp_path):
    return thread_lending.create(tmp_path / "core-share", prefill_workers=1, decode_workers=1)


def _lent(lender: Lender) -> None:
    """Lend, and let the lend-after delay pass."""
    lender.lend()
    time.sleep(LEND_AFTER_S + 0.005)


def test_a_new_ledger_lends_nothing(ledger_path):
    borrower = Borrower(Ledger(ledger_path), 0)
    assert borrower.acquire(last_ungated_seconds=0.001) == 0
    Lender(Ledger(ledger_path), 0, threads=1)  # a prefill worker that has not been idle yet
    assert borrower.acquire(last_ungated_seconds=0.001) == 0


def test_an_idle_prefill_workers_threads_go_to_the_decode_step_and_come_back(ledger_path):
    lender = Lender(Ledger(ledger_path), 0, threads=3)
    borrower = Borrower(Ledger(ledger_path), 0)
    lender.lend()
    assert borrower.acquire(0.001) == 0, "lent only once idle for LEND_AFTER_S"
    time.sleep(LEND_AFTER_S + 0.005)
    assert borrower.acquire(0.001) == 3
    assert Ledger(ledger_path).borrowed(0) == 0b1  # what the lender reads
    borrower.release()
    assert Ledger(ledger_path).borrowed(0) == 0
    assert asyncio.run(lender.reclaim()) < 0.05  # nothing ran on them: no wait
    assert borrower.acquire(0.001) == 0


def test_a_long_decode_step_does_not_borrow(ledger_path):
    # a reclaiming prefill worker would wait for it: lending must not add a long step to a TTFT
    lender = Lender(Ledger(ledger_path), 0, threads=1)
    borrower = Borrower(Ledger(ledger_path), 0)
    _lent(lender)
    assert borrower.acquire(MAX_BORROWING_STEP_S * 2) == 0
    assert Ledger(ledger_path).borrowed(0) == 0
    assert borrower.acquire(MAX_BORROWING_STEP_S / 2) == 1


def test_reclaim_waits_for_the_step_running_on_the_lent_threads(ledger_path):
    lender = Lender(Ledger(ledger_path), 0, threads=1)
    borrower = Borrower(Ledger(ledger_path), 0)
    _lent(lender)
    assert borrower.acquire(0.001) == 1
    step_ms = 80
    threading.Timer(step_ms / 1000, borrower.release).start()  # the step ends in 80 ms
    waited = asyncio.run(lender.reclaim())
    assert step_ms / 1000 * 0.8 <= waited < 1.0
    assert lender.num_reclaim_timeouts == 0
    assert borrower.acquire(0.001) == 0  # busy now: the next step runs on the decode worker's own


def test_a_borrower_that_sees_the_lender_busy_after_publishing_drops_it(ledger_path):
    # the handshake's other order: the lender turned busy between the borrower's read and its write
    lender = Lender(Ledger(ledger_path), 0, threads=1)
    borrower = Borrower(Ledger(ledger_path), 0)
    _lent(lender)
    lending = borrower._lending(time.monotonic())
    assert lending == {0: 1}
    asyncio.run(lender.reclaim(timeout=0.01))
    assert borrower.acquire(0.001) == 0
    assert Ledger(ledger_path).borrowed(0) == 0


def test_a_dead_borrowers_record_does_not_hold_the_lender_forever(ledger_path):
    lender = Lender(Ledger(ledger_path), 0, threads=1)
    borrower = Borrower(Ledger(ledger_path), 0)
    _lent(lender)
    assert borrower.acquire(0.001) == 1  # ... and the decode worker is killed mid-step
    started = time.monotonic()
    asyncio.run(lender.reclaim(timeout=0.1))
    assert 0.09 <= time.monotonic() - started < 1.0
    assert lender.num_reclaim_timeouts == 1
    Borrower(Ledger(ledger_path), 0)  # its replacement clears the record at start
    assert Ledger(ledger_path).borrowed(0) == 0


def test_prefill_workers_lend_to_decode_workers_round_robin(tmp_path):
    path = thread_lending.create(tmp_path / "ledger", prefill_workers=3, decode_workers=2)
    lenders = [Lender(Ledger(path), i, threads=i + 1) for i in range(3)]
    borrowers = [Borrower(Ledger(path), j) for j in range(2)]
    for lender in lenders:
        lender.lend()
    time.sleep(LEND_AFTER_S + 0.005)
    assert borrowers[0].acquire(0.001) == 1 + 3  # prefill 0 and 2
    assert borrowers[1].acquire(0.001) == 2  # prefill 1
    assert Ledger(path).borrowed(0) == 0b101 and Ledger(path).borrowed(1) == 0b010


def test_serves_ledger_lives_in_memory_and_is_shared_with_the_workers_it_starts(tmp_path):
    # a memfd: nothing on disk to leave behind when `baton serve` is killed; a child process that
    # inherits the descriptor maps the same bytes (here: it lends, this process borrows)
    import subprocess
    import sys

    fd = thread_lending.create_anonymous(prefill_workers=1, decode_workers=1)
    if fd is None:
        pytest.skip("no memfd on this OS: baton serve shares no cores here")
    try:
        borrower = Borrower(Ledger(thread_lending.path_of(fd)), 0)
        child = ("import sys; from baton.worker.thread_lending import Ledger, Lender; "
                 "Lender(Ledger(sys.argv[1]), 0, threads=2).lend()")
        subprocess.run([sys.executable, "-c", child, thread_lending.path_of(fd)], pass_fds=(fd,), check=True, timeout=60)
        time.sleep(LEND_AFTER_S + 0.005)
        assert borrower.acquire(0.001) == 2
    finally:
        os.close(fd)


def test_a_file_that_is_not_a_ledger_is_refused(tmp_path):
    path = tmp_path / "other"
    path.write_bytes(b"x" * 64)
    with pytest.raises(ValueError, match="not a Baton core-share ledger"):
        Ledger(path)
    with pytest.raises(ValueError, match="prefill slot 1"):
        Lender(Ledger(thread_lending.create(tmp_path / "l", 1, 1)), 1, threads=1)


def test_the_step_runs_on_the_threads_it_was_given():
    seen: list[int] = []

    def step() -> None:
        seen.append(torch.get_num_threads())

    def in_a_thread(threads: int | None) -> None:
        t = threading.Thread(target=run_with_threads, args=(step,), kwargs={"threads": threads})
        t.start()
        t.join()

    before = torch.get_num_threads()
    try:
        in_a_thread(2)
        in_a_thread(1)
        assert seen == [2, 1]
    finally:
        torch.set_num_threads(before)


def test_step_cores_of_a_worker_without_a_ledger_change_nothing():
    cores = StepCores.from_args("decode", None, 0, threads=1)
    assert asyncio.run(cores.before_step()) is None
    cores.after_step(0.01)
    cores.idle()
    cores.close()


def test_step_cores_lend_when_idle_and_take_back_at_exit(ledger_path):
    prefill = StepCores.from_args("prefill", str(ledger_path), 0, threads=1)
    decode = StepCores.from_args("decode", str(ledger_path), 0, threads=1)
    prefill.idle()
    time.sleep(LEND_AFTER_S + 0.005)
    assert asyncio.run(decode.before_step()) == 2
    decode.after_step(0.005)
    assert asyncio.run(prefill.before_step()) is None  # reclaimed: the prefill step runs on its own
    assert asyncio.run(decode.before_step()) == 1
    decode.after_step(0.005)
    prefill.idle()
    prefill.close()  # exiting (or killed and restarted): nothing stays lent
    time.sleep(LEND_AFTER_S + 0.005)
    assert asyncio.run(decode.before_step()) == 1

