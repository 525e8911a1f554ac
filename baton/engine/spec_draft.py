"""The draft model of `{"method": "draft_model"}`: a small model with the target's tokenizer that
proposes k tokens per speculating row, greedily, k steps of its own.

Rules:
- Its KV lives in its own cache, indexed by the target's block ids: a row's draft KV for position p
  sits in the slot the target's block table gives p. So the draft needs no block accounting of its
  own, and the slots of the proposals are the ones the target reserves to verify them.
  Its cache has as many blocks as the target's and counts in the same `kv_cache_memory` budget
  (the engine divides it by the target's plus the draft's bytes per block).
- Proposals need not be right, only likely (the target verifies every one), so the draft's KV may
  be stale anywhere it does not know to be valid: each row keeps a cursor (how many leading
  positions hold its draft KV, and the block ids they were written under). Before proposing, the
  cursor is cut back to the target's computed tokens (rejected proposals' KV is then recomputed)
  and to the leading blocks still in the row's table under the same ids (a preemption, a rollback
  or a handoff's fresh table resets it). The draft then catches up on what it lacks (a handed-off
  prompt: all of it, up to `CATCH_UP_TOKENS` per step; a row that needs more catches up over
  several steps without proposing) and runs k one-token steps, appending its argmax each time.
- Blocks a prefix-cache hit shares were written by the draft of the request that computed them, or
  not at all (a block loaded from the store): a new row's cursor starts at 0, so it never reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from baton.engine.block_manager import blocks_for
from baton.model.runtime import RuntimeConfig, load_runtime
from baton.engine.sequence import Sequence

CATCH_UP_TOKENS = 512  # draft prefill per step, all rows together: bounds the step a handoff adds


@dataclass
class DraftCursor:
    """How much of a row the draft's cache holds: positions [0, done), written under `blocks`."""

    done: int = 0
    blocks: list[int] = field(default_factory=list)
    preemptions: int = 0  # the row's count when written: a preempted row starts over


@dataclass
class _PromptLess:
    prompt_logprobs: None = None


@dataclass
class _DraftRow:
    """What ModelRunner.execute reads of a row, for the draft's own forward."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    spec_token_ids: list[int] = field(default_factory=list)
    sampling_params: _PromptLess = field(default_factory=_PromptLess)
    pool: None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)


def check_same_tokenizer(target_dir: Path, draft_dir: Path) -> None:
    """A draft must speak the target's token ids: where both ship a tokenizer.json, their
    vocabularies must be equal (else ValueError naming both)."""
    files = [Path(target_dir) / "tokenizer.json", Path(draft_dir) / "tokenizer.json"]
    if not all(f.is_file() for f in files):
        return
    vocabs = [json.loads(f.read_text()).get("model", {}).get("vocab") for f in files]
    if vocabs[0] != vocabs[1]:
        raise ValueError(f"the draft model {draft_dir} does not share the target's tokenizer ({target_dir}): "
                         "a draft must propose the target's token ids")


class DraftModel:
    """Loaded first, its cache allocated later (`allocate`): the engine sizes the target's and the
    draft's KV together from one budget, which needs the draft's bytes per block."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device, block_size: int,
                 target_vocab_size: int) -> None:
        # the draft's own weights as they are (no quantization), each held once; its cache in its dtype
        self.runtime = load_runtime(RuntimeConfig(model_dir, str(dtype).removeprefix("torch."), str(device),
                                                  quantization="none", release_load_copies=True))
        self.config = self.runtime.config
        self.dtype = self.runtime.dtype
        self.block_size = block_size
        self.vocab = min(target_vocab_size, self.config.vocab_size)  # proposals are target ids
        self.num_forwards = 0

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of the draft's KV cache (it holds one per target block)."""
        return self.runtime.block_bytes(self.block_size)

    def allocate(self, num_blocks: int) -> None:
        """Make the draft's KV cache: `num_blocks`, the target's count (it is indexed by its ids)."""
        self.runtime.allocate(num_blocks, self.block_size)

    def _valid(self, seq: Sequence, cursor: DraftCursor) -> int:
        """Leading positions of `seq` whose draft KV is in the cache now (or need not be: blocks
        the target released, out of every window, hold the reserved block 0, which nothing may
        write; the draft reads zeros there)."""
        table, bs = seq.block_table, self.block_size
        released = 0
        while released < len(table) and table[released] == 0:
            released += 1
        done = min(cursor.done, seq.num_computed_tokens) if cursor.preemptions == seq.num_preemptions else 0
        for index in range(released, blocks_for(done, bs)):
            if index >= len(table) or table[index] != cursor.blocks[index]:
                done = index * bs
                break
        return max(done, min(released * bs, seq.num_computed_tokens))

    def catch_up_need(self, seq: Sequence) -> int:
        """Tokens the draft must run before `seq` (a decode row) can propose."""
        cursor = seq.spec.index
        cursor.done = self._valid(seq, cursor)
        return seq.num_tokens - 1 - cursor.done

    @torch.inference_mode()
    def propose(self, rows: list[tuple[Sequence, int]], catch_up: list[tuple[Sequence, int]]) -> list[list[int]]:
        """k_i proposals for each (row, k_i) of `rows`, whose slots for positions up to
        num_tokens - 1 + k_i are allocated; `catch_up`: rows that only advance their draft KV by
        the given count this step (not proposing). Greedy: the draft's argmax each time."""
        views = [(seq, _DraftRow(list(seq.token_ids), seq.spec.index.done, seq.block_table)) for seq, _ in rows]
        first = [(view, view.num_tokens - view.num_computed_tokens) for _, view in views]
        partial = [(_DraftRow(list(seq.token_ids), seq.spec.index.done, seq.block_table), n) for seq, n in catch_up]
        proposals: list[list[int]] = [[] for _ in rows]
        scheduled = first + partial
        for step in range(max((k for _, k in rows), default=0)):
            if step:
                scheduled = [(view, 1) for (_, view), (_, k) in zip(views, rows) if k > step]
            result = self.runtime.execute(scheduled)
            self.num_forwards += 1
            picks = result.logits[:len(result.sample_seqs), :self.vocab].argmax(dim=-1).tolist()
            chosen = {id(view): token for view, token in zip(result.sample_seqs, picks)}
            for i, ((seq, view), (_, k)) in enumerate(zip(views, rows)):
                if k > step:
                    token = chosen[id(view)]
                    view.num_computed_tokens = view.num_tokens
                    view.token_ids.append(token)
                    proposals[i].append(token)
        if not rows and partial:
            self.runtime.execute(partial)
            self.num_forwards += 1
        for (seq, view), (_, k) in zip(views, rows):
            # computed: every real token and the first k - 1 proposals (the last one was never run)
            self._advance(seq, seq.num_tokens - 1 + k)
        for seq, n in catch_up:
            self._advance(seq, seq.spec.index.done + n)
        return proposals

    def _advance(self, seq: Sequence, done: int) -> None:
        cursor = seq.spec.index
        cursor.done, cursor.preemptions = done, seq.num_preemptions
        cursor.blocks = list(seq.block_table[:blocks_for(done, self.block_size)])
