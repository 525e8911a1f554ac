"""The KV connector: how an engine loads blocks from a block store and saves them to it, split as
vLLM v1 splits it: a scheduler side inside the engine (pure: no I/O, no side effects) and a worker
side (`KVConnectorWorker`) that the worker's shell runs (the store-backed one is
baton/worker/kv_transfer.py).

Loading, in three steps, each owned by one party:
1. The scheduler asks `get_num_new_matched_tokens(seq, num_computed_tokens)`: how many tokens beyond
   the local prefix the store holds, answered from what the request carries (`seq.remote_kv`: the
   block ids a prefill worker stored, from the handoff, or those a probe of the store found).
2. The scheduler allocates blocks for the local and the external tokens in one `allocate_slots`,
   parks the request in WAITING_FOR_KV and puts `build_load(...)` in its output.
3. The worker side reads the blocks (re-checking each one's tokens, dtype, shape and size: anyone
   who can write to Redis can write a block's key) and the result enters the engine with its next
   `step(loaded=...)`, which writes the blocks that arrived and resumes the request from that valid
   prefix; the rest is computed.

Saving: when a prefill worker's request finishes by handoff, the scheduler keeps its blocks until
`build_save` has encoded those the store did not hold (and the partial last block); the worker
writes them, and refreshes the TTL of the others, in the same MULTI/EXEC as the handoff.

A hybrid model (state layers: Gated DeltaNet, short conv) also hands over its state at the end of the
prompt, keyed by the request id beside the partial block. The prefill worker already stores every
prompt token's KV (the partial last block included) and the decode worker recomputes only the first
output token, so the state after the whole prompt is exactly the state of the tokens it does not
recompute. That holds only for the whole prompt: the decode worker loads all of the prompt's blocks
and the state or nothing (a missing block or state: the prompt is recomputed from a zeroed state).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from typing import Protocol

import torch

from baton.engine.kv_types import BlockLoad, KVLoad, KVSave, LoadedKV
from baton.engine.sequence import Sequence
from kvstore.codec import encode_block, encode_state
from kvstore.keys import partial_key, state_key


class KVConnectorWorker(Protocol):
    """The worker side: the I/O the scheduler side's records ask for."""

    async def load(self, load: KVLoad) -> LoadedKV: ...

    async def probe(self, block_hashes: Seq[str]) -> list[str]:
        """The leading ids of `block_hashes` that the store holds now (a hint: they may expire)."""
        ...


class KVConnectorScheduler:
    def __init__(self, block_size: int, model_id: str, state_kind: str | None = None) -> None:
        self.block_size = block_size
        self.model_id = model_id
        # a model with state layers (their kind): KV blocks alone do not resume it, so its handoff
        # carries the state at the end of the prompt, and a load is the whole prompt or nothing
        self.state_kind = state_kind

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        """Tokens after the first `num_computed_tokens` (block-aligned local hits) that the store
        holds for `seq`. At least one token is always left to compute: its logits are needed."""
        remote = seq.remote_kv
        if remote is None or seq.sampling_params.prompt_logprobs is not None:
            return 0  # prompt logprobs need every prompt position computed here
        bs = self.block_size
        limit = seq.num_tokens - 1
        num_full = min(len(remote.block_hashes), limit // bs)
        total = num_full * bs
        partial = remote.num_tokens if 0 < remote.num_tokens < bs else 0
        if num_full == len(remote.block_hashes) and partial and total + partial <= limit:
            total += partial
        if self.state_kind is not None and (num_computed_tokens or total != seq.num_prompt_tokens):
            # the handed-off state is the one at the end of the prompt: it resumes only from there
            # (a prefill worker's probe hit, which has no state, is computed)
            return 0
        return max(0, total - num_computed_tokens)

    def build_load(self, seq: Sequence, num_computed_tokens: int, num_external_tokens: int) -> KVLoad:
        """The load for `num_external_tokens` after the local prefix, into the blocks the scheduler
        has just allocated for them."""
        remote = seq.remote_kv
        assert remote is not None and num_computed_tokens % self.block_size == 0
        bs = self.block_size
        blocks = []
        end = num_computed_tokens + num_external_tokens
        for start in range(num_computed_tokens, end, bs):
            index = start // bs
            tokens = tuple(seq.token_ids[start:min(start + bs, end)])
            if len(tokens) == bs:
                blocks.append(BlockLoad(seq.block_table[index], tokens, remote.block_hashes[index]))
            else:
                assert remote.partial_key is not None and start + len(tokens) == end
                blocks.append(BlockLoad(seq.block_table[index], tokens, None, remote.partial_key))
        if self.state_kind is None:
            return KVLoad(seq.seq_id, tuple(blocks))
        return KVLoad(seq.seq_id, tuple(blocks), state_key(seq.seq_id), tuple(seq.token_ids[:end]))

    def build_save(self, seq: Sequence, num_tokens: int, read_block: Callable[[tuple[int, ...]], torch.Tensor],
                   read_state: Callable[[str], dict[str, torch.Tensor]] | None = None) -> KVSave:
        """Encode the first `num_tokens` tokens' blocks of `seq`, except those the store held when
        the request arrived (`seq.remote_kv`, from a fresh probe): those only get their TTL
        refreshed, so a prefix in use does not expire under the requests that share it. A hybrid
        model's state (`read_state`: its slot now, at the end of those tokens) goes with them."""
        bs = self.block_size
        hashes = seq.block_hashes(bs, self.model_id)
        present = set(seq.remote_kv.block_hashes) if seq.remote_kv is not None else set()
        num_full = num_tokens // bs
        full, refresh = [], []
        for index in range(num_full):
            if hashes[index] in present:
                refresh.append(hashes[index])
                continue
            tokens = seq.token_ids[index * bs:(index + 1) * bs]
            full.append((hashes[index], encode_block(tokens, read_block(seq.block_ids(index)))))
        partial = None
        if num_tokens % bs:
            partial = (partial_key(seq.seq_id), encode_block(seq.token_ids[num_full * bs:num_tokens],
                                                             read_block(seq.block_ids(num_full))))
        state = None
        if self.state_kind is not None and read_state is not None:
            state = (state_key(seq.seq_id),
                     encode_state(self.state_kind, seq.token_ids[:num_tokens], read_state(seq.seq_id)))
        return KVSave(tuple(full), partial, tuple(refresh), num_full, tuple(hashes[:num_full]), state)
