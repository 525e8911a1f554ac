"""The thread gate over the lending ledger's words: the worker's side of `baton.model.thread_gate`.

A decode step that borrowed a prefill worker's threads (baton/worker/thread_lending.py) carries this
gate: while armed, every watched word (a lender's state in the ledger) must still say "lending", else
the step gives the lent threads back (`torch.set_num_threads(threads)`) and clears its "borrowing"
words, which the reclaiming lender reads to know the step left its cores. The model asks it between
layers through the `ThreadGate` interface (`enter`, `leave`, and `native_args`: the same check in the
form the all-layers native call makes between layers, decode_layers.cpp); the words, what they mean
and when the gate is armed are the worker's (`StepCores`, per step). The engine never creates one.
"""

from __future__ import annotations

import time

import torch

from baton.model.runtime import no_gate_args


class LedgerGate:
    """`words`: an int32 tensor over the shared memory; while armed, every word of `watch` must
    equal `open_value`, else the step gives back its lent threads: `torch.set_num_threads(threads)`
    and every word of `release` set to 0 (the owner reads them to know the step left its cores)."""

    def __init__(self, words: torch.Tensor, open_value: int = 1) -> None:
        if words.dtype != torch.int32 or words.dim() != 1:
            raise ValueError("a thread gate's words are a 1-D int32 tensor")
        self.words = words
        self.open_value = open_value
        self.watch: list[int] = []
        self.release: list[int] = []
        self.threads = 0
        self.armed = False
        self.gated_seconds = 0.0  # of the last step: time inside the gated part (the layers)
        self.tail_threads = 0  # of the last step: the threads the rest ran on (0: it never entered)
        self._gated_since: float | None = None

    def arm(self, watch: list[int], release: list[int], threads: int) -> None:
        """From now until `disarm`, give the step's lent threads back (down to `threads`) as soon as
        a `watch` word stops being `open_value`."""
        if threads < 1 or not watch:
            raise ValueError("an armed gate watches at least one word and falls back to >= 1 thread")
        for index in (*watch, *release):
            if not 0 <= index < self.words.numel():
                raise ValueError(f"word {index} is outside the gate's {self.words.numel()} words")
        self.watch, self.release, self.threads, self.armed = list(watch), list(release), threads, True
        self.gated_seconds, self.tail_threads = 0.0, 0

    def disarm(self) -> None:
        self.armed = False
        self.watch, self.release = [], []
        self.gated_seconds, self.tail_threads = 0.0, 0

    def poll(self) -> bool:
        """Give the lent threads back now if the owner asked (True: given back, now or before)."""
        if not self.armed:
            return False
        if all(int(self.words[i]) == self.open_value for i in self.watch):
            return False
        self._give_back()
        return True

    def _give_back(self) -> None:
        torch.set_num_threads(self.threads)
        for i in self.release:
            self.words[i] = 0
        self.armed = False  # given back: nothing more to watch in this step

    def native_args(self) -> tuple[torch.Tensor, list[int], list[int], int]:
        """decode_layers' gate arguments: the words, watch, release and the fallback thread count
        (an empty tensor and no words when disarmed: the native call then never looks)."""
        if not self.armed:
            return no_gate_args()
        return self.words, self.watch, self.release, self.threads

    def enter(self) -> None:
        """The gated part (the layers) starts: look once before it."""
        self.poll()
        self._gated_since = time.perf_counter()

    def leave(self) -> None:
        """The gated part ended: look once more (the native call may have given the threads back
        already; giving back twice is harmless)."""
        if self._gated_since is not None:
            self.gated_seconds += time.perf_counter() - self._gated_since
            self._gated_since = None
        self.poll()
        self.tail_threads = torch.get_num_threads()
