"""A request inside an engine: its tokens, its block table and its counts (it owns them).

A feature keeps its per-request state in a companion its own module defines (the grammar matcher in
baton.engine.structured, the speculation in baton.engine.speculator, the pooling in
baton.engine.pooling): this class only holds the slot, typed, so a feature touches its own files
and the seams it needs, not this one. `remote_kv` and `remote_decode` are where the request's KV
comes from and goes to (the disaggregated workers), the request's own routing.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from baton.common.finish_reason import FinishReason
from baton.common.sampling_params import SamplingParams
from baton.engine.kv_types import RemoteKV
from kvstore.hashing import hash_block

if TYPE_CHECKING:
    from baton.engine.pooling import PoolState
    from baton.engine.grammar_state import GrammarState
    from baton.engine.speculation import Speculation


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # admitted: blocks allocated, their KV loading from the store
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 arrival_time: float | None = None, output_token_ids: list[int] | None = None,
                 remote_kv: RemoteKV | None = None, remote_decode: bool = False,
                 block_hashes: list[str] | None = None, pooling: PoolState | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("a prompt needs at least one token")
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids) + list(output_token_ids or [])
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_table: list[int] = []
        # a model with window layers in tables of their own (kv_groups.KVGroups): one table per
        # group of window layers, as long as block_table (BlockManager keeps them in step)
        self.window_tables: list[list[int]] = []
        self.num_computed_tokens = 0
        self.num_registered_blocks = 0  # leading full blocks already registered in the prefix cache
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at the last admission
        self.num_preemptions = 0
        self.output_len_at_admission = 0  # progress check: a resumed request must advance
        self.logprobs: list[float] = []
        # Per prompt position, once computed: None for the first token, else [logprob, top]
        # (only for requests that ask for prompt_logprobs; see baton.engine.logprobs)
        self.prompt_logprobs: list[list | None] | None = None
        self.top_logprobs: list[list] = []  # per output token, when the request asks for logprobs
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.error: str | None = None  # why it ended with FinishReason.ERROR
        # Structured output: the grammar matcher, built from the output tokens whenever this
        # request is (re)created
        self.grammar: GrammarState | None = None
        # Speculative decoding: this step's proposals and the row's proposer and acceptance state
        self.speculation: Speculation | None = None
        # An embedding request: its prompt is pooled, nothing is sampled
        self.pooling = pooling
        self._block_hashes: list[str] = []
        # What the block store holds of this request's leading tokens (the KV connector loads it).
        self.remote_kv = remote_kv
        # Finish after the first token with reason "handoff", saving the prompt's blocks: a prefill
        # worker's request, which a decode worker continues.
        self.remote_decode = remote_decode
        if block_hashes is not None or remote_kv is not None:
            # Ids already chained over these tokens by the same model and block size (a prefill
            # worker's probe, a handoff's stored blocks) are not hashed again.
            self._block_hashes = list(block_hashes if block_hashes is not None else remote_kv.block_hashes)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)

    def block_hashes(self, block_size: int, model_id: str) -> list[str]:
        """Chained ids of every full block of the tokens so far (extended incrementally), salted by
        the request's cache_salt: only requests with the same salt share its blocks."""
        hashes = self._block_hashes
        parent = hashes[-1] if hashes else None
        for index in range(len(hashes), self.num_tokens // block_size):
            parent = hash_block(parent, self.token_ids[index * block_size:(index + 1) * block_size], model_id,
                                self.sampling_params.cache_salt)
            hashes.append(parent)
        return hashes

    def block_ids(self, index: int) -> tuple[int, ...]:
        """The blocks holding position block `index`: the global table's, then each window table's."""
        return (self.block_table[index], *(table[index] for table in self.window_tables))

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table}, {self.status.value})")
