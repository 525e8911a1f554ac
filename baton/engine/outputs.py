"""What leaves the engine: frozen records keyed by request id (vLLM v1's EngineCoreOutput), and a
snapshot of its counts. A caller never sees the engine's `Sequence`s, so nothing outside the engine
can write into a request's state, and a snapshot taken between steps can be read while a step runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from baton.engine.kv_types import KVSave
from baton.common.finish_reason import FinishReason


@dataclass(frozen=True)
class KVHandoff:
    """A request that finished by handoff (a prefill worker's): what its decode worker needs."""

    output_token_ids: tuple[int, ...]  # generated so far (the first token)
    first_token_time: float
    save: KVSave  # its prompt's blocks to write (and to refresh)


@dataclass(frozen=True)
class EngineOutput:
    """What one step changed for one request."""

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    new_logprobs: tuple[float, ...] = ()
    new_top_logprobs: tuple[Any, ...] = ()  # one [[id, logprob], ...] per new token, when asked for
    finish_reason: FinishReason | None = None  # None while it runs
    error: str | None = None  # why, when finish_reason is ERROR
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # after this step
    num_cached_tokens: int = 0  # prompt tokens found computed (prefix cache or store) at admission
    # Per prompt position (None for the first), once the prompt is computed; only on the output
    # that brings the first token, and only for requests that asked for prompt_logprobs.
    prompt_logprobs: tuple[Any, ...] | None = None
    handoff: KVHandoff | None = None  # set when finish_reason is HANDOFF
    # A pooling request's vector (raw: not normalized), once it finished with STOP
    embedding: tuple[float, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    """The engine's counts at one moment between steps (heartbeats, metrics, a worker's room)."""

    num_requests_running: int
    num_requests_waiting: int  # queued inside the engine: its KV pool or batch is full
    num_requests_loading_kv: int
    num_preemptions: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    kv_cache_usage: float
    block_size: int
    max_num_seqs: int
    policy: str
    num_free_seqs: int  # how many more requests it takes before it would queue them
    num_batched_tokens: int  # tokens the last step computed
    num_decode_tokens: int = 0  # of those, decode rows' tokens (a verify row's count too); the rest: prompt chunks
    # bytes of every KV cache the blocks index (the target's and a draft model's): within the budget
    kv_cache_bytes: int = 0
    # tokens computed by every step since start: a gateway tells a busy worker from a stalled one
    # by it (a request queued behind minutes of prefill is waiting, not lost)
    num_tokens_computed: int = 0
    # speculative decoding (all 0 when off): verify rows, proposals verified, proposals accepted,
    # and per proposal position i the verify rows whose proposal i was accepted
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()

    @property
    def num_unfinished(self) -> int:
        """Running, loading KV or waiting: the load a worker compares with its peers'."""
        return self.num_requests_running + self.num_requests_loading_kv + self.num_requests_waiting

    def heartbeat(self) -> dict[str, Any]:
        """The fields a worker's heartbeat advertises."""
        return {"num_requests_running": self.num_requests_running, "num_requests_waiting": self.num_requests_waiting,
                "num_requests_loading_kv": self.num_requests_loading_kv, "num_preemptions": self.num_preemptions,
                "num_kv_blocks_total": self.num_kv_blocks_total, "num_kv_blocks_used": self.num_kv_blocks_used,
                "kv_cache_usage": self.kv_cache_usage, "block_size": self.block_size,
                "max_num_seqs": self.max_num_seqs, "policy": self.policy, "kv_cache_bytes": self.kv_cache_bytes,
                "num_tokens_computed": self.num_tokens_computed}
