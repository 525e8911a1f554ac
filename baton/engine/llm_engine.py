"""The engine: scheduler + model runner + sampler in one process, stepped in a loop.

It is the offline API's core, the baseline the disaggregated pipeline is measured against, and the
workers' only way into the scheduler, the block pool and the model runner: a worker adds and aborts
requests, steps, hands over KV loads and their results (through the KV connector), and reads
`stats()`. Nothing else touches a block.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from baton.finish_reason import FinishReason
from baton.engine.block_manager import BlockManager
from baton.engine.loader import default_device, load_model
from baton.engine.logprobs import token_logprobs
from baton.engine.model_runner import ModelRunner, PromptRows, kv_bytes_per_block
from baton.engine.block_pool import BlockPool
from baton.engine.sampling import sample, suppress_early_stops
from baton.engine.scheduler import Scheduler, SchedulerConfig, StepOutput
from baton.engine.structured import StructuredOutput
from baton.engine.sequence import Sequence
from kvstore.connector import KVConnector, KVLoad, LoadedKV

logger = logging.getLogger("baton.engine.llm_engine")


@dataclass
class EngineConfig:
    model: str | None = None
    dtype: str = "auto"
    device: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 1 << 30  # bytes, used when num_kv_blocks is not given
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    scheduler_policy: str = "max-utilization"
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    kv_connector: bool = False  # load from and save to a block store (the workers)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from baton.ops.fetch import resolve_model

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_dir: Path = resolve_model(config.model)
        device = torch.device(config.device) if config.device else default_device()
        self.model, self.model_config = load_model(self.model_dir, config.dtype, device)
        self.dtype = next(self.model.parameters()).dtype
        block_bytes = kv_bytes_per_block(self.model_config, config.block_size, self.dtype)
        num_blocks = config.num_kv_blocks or max(2, config.kv_cache_memory // block_bytes)
        max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.pool = BlockPool(num_blocks, config.block_size)
        self.block_manager = BlockManager(self.pool, self.model_config.model_id, config.enable_prefix_caching)
        self.connector = KVConnector(config.block_size, self.model_config.model_id) if config.kv_connector else None
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.scheduler_policy,
                            max_model_len),
            self.block_manager, self.model_config.eos_token_ids, self.connector,
        )
        self.runner = ModelRunner(self.model, self.model_config, num_blocks, config.block_size)
        self.structured = StructuredOutput(self.model_dir, self.model_config.vocab_size, self.eos_token_ids)
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.last_num_batched_tokens = 0
        self._kv_loads: list[KVLoad] = []
        logger.info("engine ready: %s (%s, %s), %d KV blocks of %d tokens, policy %s",
                    self.model_dir.name, self.dtype, device, num_blocks, config.block_size,
                    config.scheduler_policy)

    @property
    def eos_token_ids(self) -> list[int]:
        return self.model_config.eos_token_ids

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def model_id(self) -> str:
        return self.model_config.model_id

    def add_request(self, seq: Sequence) -> None:
        remote = seq.remote_kv
        if remote is not None and len(remote.block_hashes) * self.block_size > seq.num_prompt_tokens:
            raise ValueError(f"request {seq.seq_id} claims more stored blocks than its prompt has")
        self.structured.start(seq)  # a constrained request's grammar matcher (ValueError if bad)
        self.scheduler.add(seq)

    def abort_request(self, seq_id: str) -> Sequence | None:
        return self.scheduler.abort(seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def has_runnable(self) -> bool:
        """Whether a step would compute something now (not only wait for KV loads)."""
        return bool(self.scheduler.running or self.scheduler.waiting)

    def num_waiting(self) -> int:
        """Requests queued inside the engine (its KV pool or batch is full)."""
        return len(self.scheduler.waiting)

    def num_unfinished(self) -> int:
        """Requests running, loading KV or waiting: the load a worker compares with its peers'."""
        scheduler = self.scheduler
        return len(scheduler.running) + len(scheduler.loading) + len(scheduler.waiting)

    def num_free_seqs(self) -> int:
        """How many more requests this engine can take before it would queue them."""
        scheduler = self.scheduler
        return scheduler.config.max_num_seqs - scheduler.num_admitted - len(scheduler.waiting)

    def step(self) -> list[StepOutput]:
        """Schedule, run the model once, sample, apply the results; returns what changed.

        KV loads the schedule asked for are kept for `take_kv_loads`; a handed-off request's blocks
        are encoded here (into its output's `kv_save`) and then freed.
        """
        plan = self.scheduler.schedule()
        self._kv_loads.extend(plan.kv_loads)
        outputs = [StepOutput(seq, finished=True) for seq in plan.failed]
        self.last_num_batched_tokens = plan.num_batched_tokens
        if not plan.scheduled:
            return outputs
        sample_seqs, all_logits, prompt_rows = self.runner.execute(plan.scheduled)
        logits = all_logits[:len(sample_seqs)]
        self.num_steps += 1
        tokens: list[int] = []
        logprobs: list[float] = []
        top_logprobs: list[list] | None = None
        if sample_seqs:
            params = [s.sampling_params for s in sample_seqs]
            allowed = suppress_early_stops(logits, params, [s.num_output_tokens for s in sample_seqs],
                                           self.eos_token_ids)
            tokens, logprobs = sample(
                self.structured.apply(sample_seqs, allowed),  # grammar masks (a no-op when unconstrained)
                [s.sampling_params for s in sample_seqs],
                [s.token_ids if s.sampling_params.edits_logits else [] for s in sample_seqs],
                [s.num_output_tokens for s in sample_seqs],
                [s.num_prompt_tokens for s in sample_seqs],
            )
            top_logprobs = self._requested_logprobs(sample_seqs, logits, tokens, logprobs)
        if prompt_rows:
            self._record_prompt_logprobs(prompt_rows, all_logits[len(sample_seqs):])
        self.num_generated_tokens += len(tokens)
        step_outputs = self.scheduler.update_from_output(plan, sample_seqs, tokens, logprobs, top_logprobs)
        self._end_broken_grammars(step_outputs)
        for out in step_outputs:
            if out.seq.finish_reason is FinishReason.HANDOFF:
                assert self.connector is not None, "remote_decode needs a KV connector"
                out.kv_save = self.connector.build_save(out.seq, out.seq.num_prompt_tokens, self.runner.read_block)
                self.scheduler.free_finished(out.seq)
        return outputs + step_outputs

    @staticmethod
    def _requested_logprobs(seqs: list[Sequence], logits: torch.Tensor, tokens: list[int],
                            logprobs: list[float]) -> list[list] | None:
        """For the rows that asked for logprobs: the raw logprob of the sampled token (replacing the
        sampler's, which is under the processed distribution) and the top k. logits: [S, V]."""
        rows = [i for i, s in enumerate(seqs) if s.sampling_params.logprobs is not None]
        if not rows:
            return None
        chosen, tops = token_logprobs(logits[rows], [tokens[i] for i in rows],
                                      [seqs[i].sampling_params.logprobs or 0 for i in rows])
        top_logprobs: list[list] = [[] for _ in seqs]
        for i, row in enumerate(rows):
            logprobs[row] = chosen[i]
            top_logprobs[row] = tops[i]
        return top_logprobs

    @staticmethod
    def _record_prompt_logprobs(prompt_rows: list[PromptRows], logits: torch.Tensor) -> None:
        """Store each prompt token's logprob (and top k) on its request. logits: [P, V], the rows of
        `prompt_rows` in order; the row of position p scores the token at p + 1."""
        offset = 0
        for rows in prompt_rows:
            seq = rows.seq
            k = seq.sampling_params.prompt_logprobs or 0
            scored = seq.token_ids[rows.start + 1:rows.start + 1 + rows.count]
            chosen, tops = token_logprobs(logits[offset:offset + rows.count], scored, [k] * rows.count)
            offset += rows.count
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None] * seq.num_prompt_tokens
            for i in range(rows.count):
                seq.prompt_logprobs[rows.start + 1 + i] = [chosen[i], tops[i]]

    def _end_broken_grammars(self, outputs: list[StepOutput]) -> None:
        """A constrained request whose matcher broke (it should not: every token it samples is
        allowed by the mask) ends with "error", handed off or not."""
        for out in outputs:
            seq = out.seq
            error = self.structured.failed(seq) if seq.grammar is not None else ""
            if not error:
                continue
            seq.error = f"structured output failed: {error}"
            if not out.finished:
                self.scheduler.finish(seq, FinishReason.ERROR)
                out.finished = True
            elif seq.finish_reason is FinishReason.HANDOFF:
                self.scheduler.free_finished(seq)
            seq.finish_reason = FinishReason.ERROR

    def take_kv_loads(self) -> list[KVLoad]:
        """The KV loads scheduled since the last call (run them with `kvstore.connector.fetch`)."""
        loads, self._kv_loads = self._kv_loads, []
        return loads

    def finish_kv_loads(self, results: list[LoadedKV]) -> None:
        """Write the blocks that arrived and let their requests run (cancelled ones are skipped:
        their blocks may already belong to another request). Call between steps."""
        for result in results:
            seq = self.scheduler.loading.get(result.seq_id)
            if seq is None:
                continue
            first = seq.num_computed_tokens // self.block_size
            for offset, kv in enumerate(result.kv):
                self.runner.write_block(seq.block_table[first + offset], kv)
            self.scheduler.finish_kv_load(result.seq_id, result.num_tokens)

    def stats(self) -> dict[str, Any]:
        """Counts for heartbeats and metrics."""
        scheduler, pool = self.scheduler, self.pool
        return {"num_requests_running": len(scheduler.running), "num_requests_waiting": len(scheduler.waiting),
                "num_requests_loading_kv": len(scheduler.loading), "num_preemptions": scheduler.num_preemptions,
                "num_kv_blocks_total": pool.num_usable_blocks, "num_kv_blocks_used": pool.num_used_blocks,
                "kv_cache_usage": pool.usage(), "block_size": pool.block_size,
                "max_num_seqs": scheduler.config.max_num_seqs, "policy": scheduler.config.policy}


def default_threads() -> int:
    return max(1, os.cpu_count() or 1)
