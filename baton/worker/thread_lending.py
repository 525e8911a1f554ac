"""Cores lent by idle prefill workers to decode workers on the same machine.

`baton serve` splits a machine's cores between its workers (threads are a budget: two processes
each running all cores' worth of OpenMP threads slow down catastrophically). At one to four clients
that split wastes half the machine: the prefill worker idles for the whole of each generation while
the decode worker steps on one core. So an idle prefill worker *lends* its threads, and the decode
worker its cores go to runs its next steps with them; before the prefill worker computes again it
*reclaims* them and waits until no step runs on them (at most one short step: see
`MAX_BORROWING_STEP_S`), so the two never run more threads than cores.

The ledger is a small in-memory file (a memfd) that `baton serve` creates and every worker it
starts inherits and maps (`--core-share /proc/self/fd/N --core-share-slot N`): one record per
prefill worker (lending or busy, its threads, since when) and one per decode worker (the lenders
its running step uses, a bit mask).
A zeroed file means no one lends. Workers started any other way (compose, several machines) have
no ledger and keep their own threads. Prefill worker i's threads go to decode worker i mod D.

A step that borrows carries a thread gate (baton/worker/ledger_gate.py; the model sees only its
`baton.model.thread_gate.ThreadGate` interface) over this ledger: between
its decode layers it looks at its lenders' state words, and once one is reclaiming it finishes on
its own threads and clears its record, so a reclaim waits one layer (or the step's part outside the
layers: embedding, LM head, sampling), not the whole step. So a step may borrow when that ungated
part was short (`MAX_BORROWING_STEP_S`), however long its layers are: at 16 and 64 clients the
prefill worker idles much of the time too, and its core now decodes then.

Ordering: the borrower publishes the lenders it will use and then re-reads that they still lend;
the lender publishes "busy" and then reads the borrower's record (Dekker's handshake). x86 may
complete a load before an earlier store to another address, so each side puts a full fence
between its store and its load (a lock round trip: a locked instruction). If the handshake is
still lost (a dead borrower's stale record), the lender stops waiting after `RECLAIM_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import enum
import mmap
import os
import struct
import threading
import time
from pathlib import Path

import torch

from baton.worker.ledger_gate import LedgerGate

MAGIC = b"BATONCS1"
_HEADER = struct.Struct("<8sii")  # magic, prefill workers, decode workers
_LENDER = struct.Struct("<iid")  # state, threads, since (time.monotonic: one clock for the machine)
_BORROWER = struct.Struct("<Q")  # bit i: the running step uses prefill worker i's threads

# A step whose part outside the gated layers (see above) took longer than this, on as many threads
# as it would borrow, does not borrow: a reclaiming prefill worker waits for that part of the step
# that runs on its core, so this bounds what lending can add to a prompt's TTFT. The default model's
# whole step on Zen 3 is ~17 ms on one thread at one client; its ungated part at 64 clients (LM head
# and sampling of 64 rows) ~40 ms on two threads (docs/performance.md).
MAX_BORROWING_STEP_S = 0.050
# A lender must have been idle this long before its cores are used: back-to-back prompts
# (a gap of a loop turn) do not make the two workers trade cores every step.
LEND_AFTER_S = 0.020
RECLAIM_TIMEOUT_S = 0.250
_POLL_S = 0.0005

_fence_lock = threading.Lock()


def _fence() -> None:
    # A lock round trip is a locked read-modify-write: a full memory fence on x86, and an
    # acquire/release pair elsewhere (Python has no bare fence).
    _fence_lock.acquire()
    _fence_lock.release()


class LenderState(enum.IntEnum):
    BUSY = 0  # the zeroed file: nothing is lent until a prefill worker says so
    LENDING = 1


def _zeroed(prefill_workers: int, decode_workers: int) -> bytes:
    if not 1 <= prefill_workers <= 64 or decode_workers < 1:
        raise ValueError("a core-share ledger holds 1 to 64 prefill workers and at least one decode worker")
    data = bytearray(_HEADER.size + prefill_workers * _LENDER.size + decode_workers * _BORROWER.size)
    _HEADER.pack_into(data, 0, MAGIC, prefill_workers, decode_workers)
    return bytes(data)


def create(path: str | os.PathLike[str], prefill_workers: int, decode_workers: int) -> Path:
    """Write a zeroed ledger for these workers at `path`."""
    path = Path(path)
    path.write_bytes(_zeroed(prefill_workers, decode_workers))
    return path


def create_anonymous(prefill_workers: int, decode_workers: int) -> int | None:
    """A zeroed ledger in memory with no name on any file system (`baton serve`'s: nothing is left
    behind even when it is killed with SIGKILL); its descriptor, which the workers inherit and open
    as /proc/self/fd/N (`path_of`). None where the OS has no memfd (not Linux): no sharing."""
    if not hasattr(os, "memfd_create") or not Path("/proc/self/fd").is_dir():
        return None
    fd = os.memfd_create("baton-core-share", 0)
    os.write(fd, _zeroed(prefill_workers, decode_workers))
    return fd


def path_of(fd: int) -> str:
    """The path a child that inherited `fd` opens the ledger by."""
    return f"/proc/self/fd/{fd}"


class Ledger:
    """The mapped file. Every record is written by one worker only (its slot) and read by others."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self._words: torch.Tensor | None = None
        magic, self.prefill_workers, self.decode_workers = _HEADER.unpack_from(self._map, 0)
        if magic != MAGIC:
            self._map.close()
            raise ValueError(f"{path} is not a Baton core-share ledger")

    def _lender_offset(self, i: int) -> int:
        if not 0 <= i < self.prefill_workers:
            raise ValueError(f"prefill slot {i} is not in a ledger of {self.prefill_workers}")
        return _HEADER.size + i * _LENDER.size

    def _borrower_offset(self, j: int) -> int:
        if not 0 <= j < self.decode_workers:
            raise ValueError(f"decode slot {j} is not in a ledger of {self.decode_workers}")
        return _HEADER.size + self.prefill_workers * _LENDER.size + j * _BORROWER.size

    def lender(self, i: int) -> tuple[LenderState, int, float]:
        state, threads, since = _LENDER.unpack_from(self._map, self._lender_offset(i))
        return LenderState(state), threads, since

    def write_lender(self, i: int, state: LenderState, threads: int, since: float) -> None:
        offset = self._lender_offset(i)
        # `since` and `threads` first, the state last: a reader that sees LENDING sees them too
        struct.pack_into("<id", self._map, offset + 4, threads, since)
        struct.pack_into("<i", self._map, offset, int(state))

    def borrowed(self, j: int) -> int:
        return _BORROWER.unpack_from(self._map, self._borrower_offset(j))[0]

    def write_borrowed(self, j: int, mask: int) -> None:
        _BORROWER.pack_into(self._map, self._borrower_offset(j), mask)

    def lender_state_word(self, i: int) -> int:
        """The int32 index of prefill worker i's state (what a thread gate watches)."""
        return self._lender_offset(i) // 4

    def borrowed_words(self, j: int) -> list[int]:
        """The int32 indices of decode worker j's record (what a gate clears when it gives back)."""
        offset = self._borrower_offset(j) // 4
        return [offset, offset + 1]

    def words(self) -> torch.Tensor:
        """The ledger as int32 words, sharing its memory (a thread gate reads and writes them)."""
        if self._words is None:
            self._words = torch.frombuffer(self._map, dtype=torch.int32)
        return self._words

    def close(self) -> None:
        self._words = None  # the tensor exports the map's buffer: drop it first
        self._map.close()


class Lender:
    """A prefill worker's side: `lend()` when it has nothing to compute, `reclaim()` before it does."""

    def __init__(self, ledger: Ledger, slot: int, threads: int) -> None:
        self.ledger, self.slot, self.threads = ledger, slot, threads
        self.borrower_slot = slot % ledger.decode_workers
        self.lending = False
        self.num_reclaim_timeouts = 0
        ledger.write_lender(slot, LenderState.BUSY, threads, 0.0)

    def lend(self) -> None:
        if not self.lending:
            self.ledger.write_lender(self.slot, LenderState.LENDING, self.threads, time.monotonic())
            self.lending = True

    def withdraw(self) -> None:
        """Mark this worker busy (lending nothing) without waiting for a step on its threads."""
        self.ledger.write_lender(self.slot, LenderState.BUSY, self.threads, 0.0)
        self.lending = False

    async def reclaim(self, timeout: float = RECLAIM_TIMEOUT_S) -> float:
        """Take the cores back; returns once no decode step runs on them (or after `timeout`:
        a borrower that died mid-step leaves its record set). Returns the seconds waited."""
        if not self.lending:
            return 0.0
        self.withdraw()
        _fence()
        started = time.monotonic()
        bit = 1 << self.slot
        while self.ledger.borrowed(self.borrower_slot) & bit:
            if time.monotonic() - started >= timeout:
                self.num_reclaim_timeouts += 1
                break
            await asyncio.sleep(_POLL_S)
        return time.monotonic() - started


class Borrower:
    """A decode worker's side: `acquire()` before a step (the extra threads it may run), `release()`
    after it."""

    def __init__(self, ledger: Ledger, slot: int) -> None:
        self.ledger, self.slot = ledger, slot
        self.lenders = [i for i in range(ledger.prefill_workers) if i % ledger.decode_workers == slot]
        self.borrowing: dict[int, int] = {}  # lender -> threads, of the step that runs now
        ledger.write_borrowed(slot, 0)  # a restarted worker clears its predecessor's record

    def _lending(self, now: float) -> dict[int, int]:
        lending = {}
        for i in self.lenders:
            state, threads, since = self.ledger.lender(i)
            if state is LenderState.LENDING and now - since >= LEND_AFTER_S:
                lending[i] = threads
        return lending

    def acquire(self, last_ungated_seconds: float, last_ungated_threads: int = 0, own_threads: int = 1) -> int:
        """Extra threads the next step may run (0: none lent, or the last step's part outside its
        gated layers, run on `last_ungated_threads` threads (0: unknown), would take too long on
        `own_threads` + the lent ones: a lender may have to wait for that part). The lenders this
        step uses are `self.borrowing` until `release`."""
        self.borrowing = {}
        lending = self._lending(time.monotonic())
        if not lending:
            return 0
        if last_ungated_threads:  # scaled to the threads the step would run on
            last_ungated_seconds *= last_ungated_threads / (own_threads + sum(lending.values()))
        if last_ungated_seconds > MAX_BORROWING_STEP_S:
            return 0
        self.ledger.write_borrowed(self.slot, sum(1 << i for i in lending))
        _fence()
        still = {i: t for i, t in lending.items() if self.ledger.lender(i)[0] is LenderState.LENDING}
        if len(still) != len(lending):
            self.ledger.write_borrowed(self.slot, sum(1 << i for i in still))
        self.borrowing = still
        return sum(still.values())

    def release(self) -> None:
        self.borrowing = {}
        self.ledger.write_borrowed(self.slot, 0)

    def gate(self) -> LedgerGate:
        """A thread gate over this ledger (armed per step by `StepCores`)."""
        return LedgerGate(self.ledger.words(), open_value=int(LenderState.LENDING))


def run_with_threads(fn, *args, threads: int | None):  # type: ignore[no-untyped-def]
    """Run `fn(*args)` (in the engine's step thread) on `threads` torch threads (None: as they are).
    torch's thread count is per calling thread under OpenMP, an executor thread that has not run a
    step yet starts from the process default, and a step whose gate gave lent threads back ends on
    fewer: so read it, and set it whenever it differs."""
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return fn(*args)


class StepCores:
    """The worker shell's view: what to do before and after a step and when idle, for a lender
    (a prefill worker), a borrower (a decode worker), or a worker without a ledger (nothing)."""

    def __init__(self, kind: str, ledger: Ledger | None, slot: int, threads: int) -> None:
        self.threads = threads
        self.lender = Lender(ledger, slot, threads) if ledger is not None and kind == "prefill" else None
        self.borrower = Borrower(ledger, slot) if ledger is not None and kind == "decode" else None
        # the decode layers give lent threads back mid-step through it (the shell hands it to the engine)
        self.gate = self.borrower.gate() if self.borrower is not None else None
        self.last_step_seconds = 0.0
        self.last_ungated_seconds = 0.0  # of the last step: outside its gated layers
        self.last_ungated_threads = 0  # the threads that part ran on
        self.last_step_borrowed = 0  # threads the last step borrowed
        self.reclaim_seconds = 0.0  # waited in all, for the metrics

    @classmethod
    def from_args(cls, kind: str, path: str | None, slot: int, threads: int) -> StepCores:
        return cls(kind, Ledger(path) if path else None, slot, threads)

    async def before_step(self) -> int | None:
        """The thread count the next step runs on (None: this worker does not share cores)."""
        if self.lender is not None:
            self.reclaim_seconds += await self.lender.reclaim()
            return None
        if self.borrower is not None:
            assert self.gate is not None
            borrowed = self.borrower.acquire(self.last_ungated_seconds, self.last_ungated_threads, self.threads)
            self.last_step_borrowed = borrowed
            if borrowed:
                ledger = self.borrower.ledger
                self.gate.arm(watch=[ledger.lender_state_word(i) for i in self.borrower.borrowing],
                              release=ledger.borrowed_words(self.borrower.slot), threads=self.threads)
            else:
                self.gate.disarm()
            return self.threads + borrowed
        return None

    def after_step(self, seconds: float) -> None:
        self.last_step_seconds = seconds
        if self.borrower is not None:
            assert self.gate is not None
            self.last_ungated_seconds = max(0.0, seconds - self.gate.gated_seconds)
            self.last_ungated_threads = self.gate.tail_threads or self.threads + self.last_step_borrowed
            self.gate.disarm()
            self.borrower.release()

    def idle(self) -> None:
        """Nothing to compute now: a prefill worker lends its threads."""
        if self.lender is not None:
            self.lender.lend()

    def close(self) -> None:
        """At exit: a lender takes its cores back (its successor starts by loading the model)."""
        if self.lender is not None:
            self.lender.withdraw()
        if self.borrower is not None:
            self.borrower.release()
