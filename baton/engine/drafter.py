"""The draft model of `{"method": "draft_model"}`, run by the engine after each schedule.

The scheduler's speculation policy reserved the slots and marked the rows (`DraftJob`); the drafter
turns them into plain rows for the draft's runtime (`ModelRuntime.propose`: k greedy steps of its
own), sets each row's proposals and moves its cursor (baton/engine/draft_cursor.py, which states
the rules).
"""

from __future__ import annotations

import json
from pathlib import Path

from baton.engine.draft_cursor import DraftCursor
from baton.engine.sequence import Sequence
from baton.engine.speculator import DraftJob
from baton.model.runtime import DraftRow, ModelRuntime, RuntimeConfig, load_runtime, step_row


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


class DraftCache:
    """A draft's runtime, its KV cache allocated later (`allocate`): the engine sizes the target's and
    the draft's KV together from one budget, which needs the draft's bytes per block. The cache has a
    block per target block, indexed by the target's ids (baton/engine/draft_cursor.py)."""

    def __init__(self, runtime: ModelRuntime, block_size: int) -> None:
        self.runtime = runtime
        self.config = runtime.config
        self.block_size = block_size
        self.num_forwards = 0

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of the draft's KV cache (it holds one per target block)."""
        return self.runtime.block_bytes(self.block_size, one_table=True)

    def allocate(self, num_blocks: int) -> None:
        """Make the draft's KV cache: `num_blocks`, the target's count (it is indexed by its ids)."""
        # one table (window layers too): its rows carry the target's global table only
        self.runtime.allocate(num_blocks, self.block_size, one_table=True)


class Drafter(DraftCache):
    """A draft model of its own (`{"method": "draft_model"}`)."""

    def __init__(self, model_dir: Path, dtype: str, device: str, block_size: int, target_vocab_size: int) -> None:
        # the draft's own weights as they are (no quantization), each held once; its cache in its dtype
        super().__init__(load_runtime(RuntimeConfig(model_dir, dtype, device, quantization="none",
                                                    release_load_copies=True)), block_size)
        self.vocab = min(target_vocab_size, self.config.vocab_size)  # proposals are target ids
        if self.runtime.has_state_layers:  # its cursor cuts its KV back; a state cannot be cut back
            raise ValueError(f"the draft model {Path(model_dir).name} has state layers: a draft must be a "
                             "transformer (its KV is cut back to the target's accepted tokens)")

    def run(self, job: DraftJob) -> None:
        """Set the proposals of `job.proposing`'s rows (their slots for positions up to
        num_tokens - 1 + k are reserved), greedy; every row's cursor then says what its draft KV holds."""
        bs = self.block_size
        rows = [DraftRow(seq.seq_id, seq.token_ids, _cursor(seq).done, seq.block_table, k) for seq, k in job.proposing]
        catch_up = [step_row(seq.seq_id, seq.token_ids, _cursor(seq).done, n, seq.block_table)
                    for seq, n in job.catching_up]
        proposals, forwards = self.runtime.propose(rows, catch_up, self.vocab)
        self.num_forwards += forwards
        for (seq, k), tokens in zip(job.proposing, proposals):
            assert seq.speculation is not None
            seq.speculation.proposals = tokens
            # computed: every real token and the first k - 1 proposals (the last one was never run)
            _cursor(seq).advance(seq.num_tokens - 1 + k, seq.block_table, seq.num_preemptions, bs)
        for seq, n in job.catching_up:
            cursor = _cursor(seq)
            cursor.advance(cursor.done + n, seq.block_table, seq.num_preemptions, bs)


def _cursor(seq: Sequence) -> DraftCursor:
    assert seq.speculation is not None and isinstance(seq.speculation.proposer, DraftCursor)
    return seq.speculation.proposer
