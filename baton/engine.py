"""The colocated engine: scheduler + model runner + sampler in one process, stepped in a loop.

It is the offline API's core and the baseline the disaggregated pipeline is measured against. The
prefill and decode workers build on the same parts.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from baton.block_manager import BlockManager
from baton.config import ModelConfig
from baton.loader import default_device, load_model
from baton.model_runner import ModelRunner, kv_bytes_per_block
from baton.sampling import SamplingParams, sample
from baton.scheduler import Scheduler, SchedulerConfig
from baton.sequence import Sequence
from kvstore.block_pool import BlockPool

logger = logging.getLogger("baton.engine")


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


@dataclass
class StepOutput:
    seq: Sequence
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[float] = field(default_factory=list)
    finished: bool = False


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from baton.fetch import resolve_model

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
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.scheduler_policy,
                            max_model_len),
            self.block_manager,
        )
        self.runner = ModelRunner(self.model, self.model_config, num_blocks, config.block_size)
        self.num_steps = 0
        self.num_generated_tokens = 0
        logger.info("engine ready: %s (%s, %s), %d KV blocks of %d tokens, policy %s",
                    self.model_dir.name, self.dtype, device, num_blocks, config.block_size,
                    config.scheduler_policy)

    @property
    def eos_token_ids(self) -> list[int]:
        return self.model_config.eos_token_ids

    def add_request(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def abort_request(self, seq_id: str) -> Sequence | None:
        return self.scheduler.abort(seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """Schedule, run the model once, sample, apply the results; returns what changed."""
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                # Nothing runs and the head of the queue cannot fit: it never will.
                seq = self.scheduler.waiting.popleft()
                seq.finish_reason = "error"
                seq.status = seq.status.FINISHED
                logger.error("request %s needs more KV blocks than the pool has", seq.seq_id)
                return [StepOutput(seq, finished=True)]
            return []
        sample_seqs, logits = self.runner.execute(plan.scheduled)
        self.num_steps += 1
        for seq, num_new in plan.scheduled:
            seq.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(seq)
        if not sample_seqs:
            return []
        tokens, logprobs = sample(
            logits,
            [s.sampling_params for s in sample_seqs],
            [s.token_ids if s.sampling_params.repetition_penalty != 1.0 else [] for s in sample_seqs],
            [s.num_output_tokens for s in sample_seqs],
        )
        now = time.time()
        outputs = []
        for seq, token, logprob in zip(sample_seqs, tokens, logprobs):
            seq.append_token(token, logprob)
            if seq.first_token_time is None:
                seq.first_token_time = now
            self.num_generated_tokens += 1
            reason = self.check_stop(seq)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            outputs.append(StepOutput(seq, [token], [logprob], reason is not None))
        return outputs

    def check_stop(self, seq: Sequence) -> str | None:
        params = seq.sampling_params
        last = seq.token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if last in params.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens:
            return "length"
        if seq.num_tokens >= self.scheduler.config.max_model_len:
            return "length"
        return None


def default_threads() -> int:
    return max(1, os.cpu_count() or 1)
