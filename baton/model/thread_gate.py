"""What the model sees of threads lent for part of a step: "may I keep them", asked between layers.

A decode worker may run its steps on threads another process lends it (baton/worker/thread_lending.py:
an idle prefill worker's cores). The owner takes them back before it computes, and waits until no
step runs on them. Without a gate that wait lasts until the running step ends: one step at 64
clients is 200-350 ms on a 2-core machine, so long steps could not borrow at all. With a gate the
step looks between its layers: once the owner says "no longer lent", the rest of the step runs on
the step's own threads, so the owner waits one layer at most, or the part of the step outside the
layers (the LM head, sampling).

The model only calls this interface around its layers (`LayersPlan.run`, or between the layers of
a hybrid model's Python loop: `HybridModel.forward`); the shared memory, its
words and the handshake with the owner are the worker's (`baton.worker.ledger_gate.LedgerGate`, over
the lending ledger), armed per step by the worker. The engine never creates one.
"""

from __future__ import annotations

from typing import Protocol

import torch

# decode_layers' gate arguments: int32 words, the indices to watch (each must equal 1, "lent"), the
# indices to zero when giving back, the thread count to fall back to
NativeGateArgs = tuple[torch.Tensor, list[int], list[int], int]


class ThreadGate(Protocol):
    """Lent threads that the layers give back as soon as their owner asks."""

    def enter(self) -> None:
        """The layers start: give the lent threads back now if the owner asked."""

    def poll(self) -> bool:
        """Between two layers of a Python loop (a hybrid model's): give the lent threads back now
        if the owner asked (True: given back, now or before)."""

    def leave(self) -> None:
        """The layers ended: give them back now if the owner asked meanwhile."""

    def native_args(self) -> NativeGateArgs:
        """The same question in the form the all-layers native call asks it between layers
        (decode_layers.cpp); `no_gate_args()` when nothing is lent."""


def no_gate_args() -> NativeGateArgs:
    """decode_layers' gate arguments for a step without a gate."""
    return torch.empty(0, dtype=torch.int32), [], [], 0
