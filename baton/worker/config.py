"""`WorkerConfig`: everything one worker process runs with, from its flags (`python -m <kind>_worker
--flags`) or as one JSON object from `baton serve` (baton.common.service_config)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from baton.common.service_config import config_from_json, config_to_json

if TYPE_CHECKING:
    from baton.engine.speculative_config import SpeculativeConfig

# Left out of the JSON: a secret (the URL may hold a password), which travels in REDIS_URL.
SECRET_FIELDS = ("redis_url",)


@dataclass(frozen=True)
class WorkerConfig:
    """The flags of baton.worker.args, one field each (the same names); the last three belong to
    one kind of worker and keep their defaults in the other."""
    model: str | None
    redis_url: str
    dtype: str
    quantization: str
    kv_cache_dtype: str
    device: str | None
    threads: int | None
    core_share: str | None
    core_share_slot: int
    block_size: int
    num_kv_blocks: int | None
    kv_cache_memory: int  # bytes
    max_num_seqs: int
    max_num_batched_tokens: int
    metrics_port: int | None
    metrics_host: str
    worker_id: str | None
    claim_idle_ms: int
    drain_timeout: float
    gateway_grace: float
    log_level: str
    log_format: str
    stall_timeout: float
    pooling_step_tokens: int | None = None  # prefill
    scheduler_policy: str = "max-utilization"  # decode
    speculative_config: SpeculativeConfig | None = None  # decode

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerConfig:
        """From a worker's parsed flags (a kind's parser has only its own kind's extra flags)."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in vars(args).items() if name in names})

    def to_json(self) -> str:
        spec = self.speculative_config
        return config_to_json(self, SECRET_FIELDS, {"speculative_config": spec.to_dict() if spec else None})

    @classmethod
    def from_json(cls, text: str, redis_url: str) -> WorkerConfig:
        from baton.engine.speculative_config import parse_speculative_config  # no torch: plain parsing

        config = config_from_json(cls, text, redis_url=redis_url)
        return dataclasses.replace(config, speculative_config=parse_speculative_config(config.speculative_config))
