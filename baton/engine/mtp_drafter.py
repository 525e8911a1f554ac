"""The checkpoint's multi-token-prediction layer as the draft of `{"method": "mtp"}`.

The head (baton.model.mtp) predicts t_{p+2} from the token t_{p+1} and the target's final hidden
state h_p, through one decoder layer with a KV of its own. Its KV lives as a draft model's does
(baton/engine/draft_cursor.py): in its own cache indexed by the target's block ids, counted in the
same budget, with a cursor per row saying which leading positions it holds. What differs is its
input: the head cannot compute a position without the target's hidden state there, so

- every target step returns the final hidden state of each token it computed (`StepBatch.hidden_states`),
  and the row keeps those of positions the head has not read (`MtpCursor.record`): a verify row's
  accepted positions only, a prefill chunk's all;
- after the next schedule the head reads them: a decode row whose unread states reach its last
  computed position proposes (one forward over those positions, whose last gives the first proposal,
  then one per further proposal, chained on the head's own output); any other row with unread states
  (a prompt being prefilled, a row backing off) only advances its head's KV, `CATCH_UP_TOKENS` a step
  in all, so a long prompt's states are read chunk by chunk and never pile up;
- positions whose hidden states this engine never saw (a handed-off prompt, a prefix-cache hit of
  blocks another request computed, blocks loaded from the store) are skipped: the head reads the KV
  its cache holds there: written by the head of the request that computed those blocks here, or
  zeros (blocks written from the store are cleared in the head's cache as they arrive). Proposals
  may be worse there, never the output: the target verifies every one.
"""

from __future__ import annotations

from pathlib import Path

from baton.engine.draft_cursor import MtpCursor
from baton.engine.drafter import DraftCache
from baton.engine.sequence import Sequence
from baton.engine.speculator import DraftJob
from baton.model.runtime import ModelRuntime, MtpRow, RuntimeConfig, StepBatch, StepResult, load_runtime


class MtpDrafter(DraftCache):
    """The target checkpoint's MTP layer, loaded as a one-layer model; its cache is a draft model's."""

    def __init__(self, target: ModelRuntime, model_dir: Path, dtype: str, device: str, block_size: int,
                 quantization: str) -> None:
        # the head's projections as the target's (one layer of it); its own cache in its dtype; its
        # embedding and LM head the target's
        super().__init__(load_runtime(RuntimeConfig(model_dir, dtype, device, quantization=quantization,
                                                    release_load_copies=True, mtp=True)), block_size)
        self.runtime.borrow_vocab(target)

    def clear_block(self, block: int) -> None:
        """A target block was written from the store: its positions' head KV is not this engine's."""
        self.runtime.clear_block(block)

    def record(self, batch: StepBatch, result: StepResult, rows: list[tuple[Sequence, MtpCursor]]) -> None:
        """After a target step: each speculating request's hidden states of the positions it kept
        (`rows`: the batch's requests that may speculate, with their cursors)."""
        by_id = {row.request_id: row for row in batch.rows}
        for seq, cursor in rows:
            row = by_id[seq.seq_id]
            end = min(row.end, seq.num_computed_tokens)  # a verify row keeps its accepted positions only
            if end > row.start:
                states = result.row_hidden[seq.seq_id][:end - row.start].to(self.runtime.dtype)
                cursor.record(row.start, states, seq.num_preemptions)

    def run(self, job: DraftJob) -> None:
        """Propose for `job.proposing` (their unread states reach their last computed position; slots
        up to num_tokens - 1 + k reserved) and advance `job.catching_up` by n positions each."""
        # (request, proposals, the position its KV reaches after this step)
        work = ([(seq, k, seq.num_tokens - 1) for seq, k in job.proposing]
                + [(seq, 0, _cursor(seq).done + n) for seq, n in job.catching_up])
        rows = []
        for seq, k, end in work:
            cursor = _cursor(seq)
            # position p reads the token t_{p+1} and the target's h_p
            rows.append(MtpRow(seq.seq_id, cursor.done, seq.token_ids[cursor.done + 1:end + 1],
                               cursor.unread(cursor.done, end), seq.block_table, k))
        proposals, forwards = self.runtime.propose_mtp(rows, self.config.vocab_size)
        self.num_forwards += forwards
        for (seq, k, end), tokens in zip(work, proposals):
            if k:
                assert seq.speculation is not None
                seq.speculation.proposals = tokens
            cursor = _cursor(seq)
            # the chained positions' KV came from the head's own states: they are recomputed from
            # the target's once verified, so the cursor stops at the last position read
            cursor.advance(end, seq.block_table, seq.num_preemptions, self.block_size)


def _cursor(seq: Sequence) -> MtpCursor:
    assert seq.speculation is not None and isinstance(seq.speculation.proposer, MtpCursor)
    return seq.speculation.proposer
