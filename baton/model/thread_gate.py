"""Threads lent for part of a step, given back between layers when their owner asks.

A decode worker may run its steps on threads another process lends it (baton/worker/core_share.py:
an idle prefill worker's cores). The owner takes them back before it computes, and waits until no
step runs on them. Without a gate that wait lasts until the running step ends: one step at 64
clients is 200-350 ms on a 2-core machine, so long steps could not borrow at all. With a gate the
step looks between its layers: once the owner's word says "no longer lent", the rest of the step
runs on the step's own threads and the step clears its "borrowing" words, so the owner waits one
layer at most, or the part of the step outside the layers (the LM head, sampling).

The gate reads and writes 32-bit words of shared memory the caller maps (the core-share ledger),
from Python (`poll`) and from the all-layers native call (decode_layers.cpp, between layers). It is
armed per step by the worker and does nothing when disarmed; the engine never creates one.
"""

from __future__ import annotations

import time

import torch


class ThreadGate:
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


def no_gate_args() -> tuple[torch.Tensor, list[int], list[int], int]:
    """decode_layers' gate arguments for a step without a gate."""
    return torch.empty(0, dtype=torch.int32), [], [], 0
