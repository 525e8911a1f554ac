"""Prefix caching for hybrid models: snapshots of the state layers' state at block boundaries.

A cached prefix's attention blocks are not enough to resume a hybrid (Qwen3.5, LFM2, Granite 4.0-H):
its state layers keep one fixed-size state per request, the whole prefix folded in. So the state at
the end of block k (after the first (k + 1) * block_size tokens) is kept as a snapshot under block
k's chained hash (`Sequence.block_hashes`: the tokens, the model and the cache salt), in an LRU of
`capacity` snapshots. A request whose prefix hits the cache resumes from the longest prefix that
has both its blocks and a snapshot at its end (`BlockManager.get_computed_blocks` asks `has`); the
engine writes the snapshot into the request's state slot before its first chunk runs (`resume`).

Which states are kept (vLLM's "align" idea; llama.cpp's server re-processes a hybrid's whole prompt
every turn):
- the end of the last full block of every prompt (and of a preempted request's tokens when it is
  recomputed): the scheduler ends a prefill chunk at that boundary (`chunk_end`), so the state there
  exists once, between two chunks, and is copied;
- the last full block a request reached while decoding: at each block boundary the decode step
  passes, the request's latest snapshot is replaced (one pending copy per request, not in the LRU);
  when the request finishes or is preempted it is published, so a chat's next turn (the previous
  prompt + the answer + a new message) recomputes only what is new.
The hashes chain every earlier block and a hit re-checks every block's tokens, so a snapshot is
used only after exactly the tokens it was made from.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from baton.engine.sequence import Sequence

StateTensors = dict[str, torch.Tensor]


def chunk_end(seq: Sequence, num_new: int, block_size: int) -> int:
    """`num_new` cut so that a prefill chunk ends at the last full block boundary of the tokens being
    computed (where the state is snapshot), if it would cross it."""
    boundary = seq.num_tokens // block_size * block_size
    start = seq.num_computed_tokens
    if start < boundary < start + num_new:
        return boundary - start
    return num_new


class StateCache:
    """The snapshots (an LRU keyed by block hash) and each running request's pending one. One owner:
    the engine, which calls `resume` before a step, `after_step` after it, `publish` when a request
    finishes or is preempted and `drop` when it is aborted."""

    def __init__(self, capacity: int, block_size: int, model_id: str,
                 read_state: Callable[[str], StateTensors], write_state: Callable[[str, StateTensors], None],
                 has_state: Callable[[str], bool]) -> None:
        assert capacity >= 1
        self.capacity = capacity
        self.block_size = block_size
        self.model_id = model_id
        self._read, self._write, self._has_state = read_state, write_state, has_state
        self._snapshots: OrderedDict[str, StateTensors] = OrderedDict()  # block hash -> state, LRU first
        self._pending: dict[str, tuple[str, StateTensors]] = {}  # request id -> (hash, state) not yet published
        self.num_stored = 0
        self.num_resumed = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._snapshots)

    def has(self, block_hash: str) -> bool:
        return block_hash in self._snapshots

    def resume(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """Write the snapshot at the end of each newly admitted request's cached prefix into its state
        slot (a request that continues at a position > 0 without a slot hit the prefix cache)."""
        for seq, _ in scheduled:
            start = seq.num_computed_tokens
            if start == 0 or self._has_state(seq.seq_id):
                continue
            assert start % self.block_size == 0, f"{seq.seq_id}: a prefix hit ends at a block boundary"
            key = seq.block_hashes(self.block_size, self.model_id)[start // self.block_size - 1]
            state = self._snapshots.get(key)
            assert state is not None, f"{seq.seq_id}: its prefix hit has no state snapshot"
            self._snapshots.move_to_end(key)
            self._write(seq.seq_id, state)
            self.num_resumed += 1

    def after_step(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """Copy the state of every request this step left at a block boundary: into the LRU after a
        prefill chunk (`chunk_end` makes the last full block of a prompt one such end), as the
        request's pending snapshot after a one-token step (decoding)."""
        bs = self.block_size
        for seq, num_new in scheduled:
            done = seq.num_computed_tokens
            if done == 0 or done % bs or not self._has_state(seq.seq_id):
                continue
            key = seq.block_hashes(bs, self.model_id)[done // bs - 1]
            if num_new > 1:
                self._put(key, self._read(seq.seq_id))
            else:
                self._pending[seq.seq_id] = (key, self._read(seq.seq_id))

    def publish(self, request_id: str) -> None:
        """A request finished or was preempted: its latest decode snapshot joins the LRU."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self._put(*pending)

    def drop(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def _put(self, key: str, state: StateTensors) -> None:
        if key in self._snapshots:
            self._snapshots.move_to_end(key)
            return
        self._snapshots[key] = state
        self.num_stored += 1
        while len(self._snapshots) > self.capacity:
            self._snapshots.popitem(last=False)
            self.num_evicted += 1
