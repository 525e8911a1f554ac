"""The engine's one door into the model layer: `load_runtime(RuntimeConfig)` -> `ModelRuntime`.

Every choice of what the forward path is, is made here, once, in one order, from one config: the
weights' dtype and quantization (`quant.resolve_weights`), the load, the matmul plan (`prepare`), the
quantized projections and the re-plan when no quantized kernel runs, the KV cache's dtype, the model
id's suffixes that keep KV of other numbers apart, the batch-invariance mode, the native kernels, the
native matmul's AMX path and the Triton attention (the environment's switches are the config's
defaults, read once by `baton.model.runtime_env`, not deep inside a matmul). The engine above schedules; it asks
the runtime for bytes per block, allocates the cache once it has sized it, and hands each step's
rows to `execute`. Nothing in `baton/engine` imports another module of this layer (tests/test_layers.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from baton.common.model_files import gguf_source
from baton.model import runtime_env
from baton.model.config import ModelConfig
from baton.model.gated_deltanet import StatePool
from baton.model.gguf_checkpoint import drop_all_touched_pages, release_readers
from baton.model.gguf_experts import gguf_block_targets
from baton.model.greedy import greedy_pick
from baton.model.kv_groups import KVGroups, kv_groups
from baton.model.kv_quant import is_quantized, resolve_kv_cache_dtype
from baton.model.loader import default_device, load_model_deferring, resolve_dtype
from baton.model.model import CausalLM
from baton.model.draft import DraftRow, propose_greedy
from baton.model.mtp import MtpHead, MtpRow, mtp_config, mtp_prefix, propose_mtp
from baton.model.moe_quant import experts_description, mxfp4_experts_plan
from baton.model.model_runner import ModelRunner, PoolRows, PromptRows, StepResult, kv_bytes_per_block
from baton.model.fp8_blocks import describe_fp8
from baton.model.quant import (asks_for_quantized, describe_weights, quantize_model, resolve_weights,
                               serves_gguf_blocks)
from baton.model.shared_weights import share_weights
from baton.model.short_conv import state_dims
from baton.model.step_batch import RowKind, StepBatch, StepRow, step_row
from baton.model.thread_gate import ThreadGate, no_gate_args

__all__ = ["DraftRow", "KVGroups", "ModelConfig", "ModelRuntime", "MtpRow", "mtp_config", "mtp_prefix", "PoolRows", "PromptRows", "RowKind", "RuntimeConfig", "StepBatch",
           "StepResult", "StepRow", "step_row",
           "ThreadGate", "default_device", "greedy_pick", "kv_block_bytes", "kv_groups", "load_runtime", "no_gate_args",
           "return_freed_memory"]

logger = logging.getLogger("baton.model.runtime")


@dataclass(frozen=True)
class RuntimeConfig:
    """What runs, stated before anything loads."""

    model_dir: Path
    dtype: str = "auto"  # auto, float32, bfloat16, float16 (baton.model.loader.resolve_dtype)
    device: str | None = None  # None: cuda where there is one, else the CPU
    quantization: str = "auto"  # auto, none, int8, int4 (baton.model.quant)
    kv_cache_dtype: str = "auto"  # auto (the weights' dtype), int8, fp8 (baton.model.kv_quant)
    # free each projection's loaded weight once its op holds the copy it reads (the workers): loading
    # peaks near one copy; `prepare()` cannot run again afterwards
    release_load_copies: bool = False
    # the checkpoint's multi-token-prediction layer alone, as a draft (baton.model.mtp)
    mtp: bool = False
    # The environment's forward-path switches are these fields' defaults, read once
    # (baton/model/runtime_env.py has the table: variable, values, default, effect).
    # full, matmul, off or auto (BATON_BATCH_INVARIANT; None: auto, said in the log)
    batch_invariant: str | None = dataclasses.field(default_factory=runtime_env.batch_invariant)
    # the native CPU kernels, built at first use (BATON_NATIVE_KERNELS); False: the torch path
    native_kernels: bool = dataclasses.field(default_factory=runtime_env.native_kernels)
    # the native bf16 matmul on AMX where the CPU has it (BATON_GEMV_AMX); False: AVX512-BF16
    gemv_amx: bool = dataclasses.field(default_factory=runtime_env.gemv_amx)
    # CUDA attention through the Triton kernels (BATON_TRITON; opt-in)
    triton: bool = dataclasses.field(default_factory=runtime_env.triton)


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: str = "auto", kv_cache_dtype: str = "auto") -> int:
    """Bytes of one KV block of a worker started with these flags, known before anything loads (`baton
    serve`'s memory estimate): `--dtype auto` counts as float32, the widest it may resolve to."""
    model_dtype = torch.float32 if dtype == "auto" else resolve_dtype(dtype, torch.device("cpu"))
    return kv_bytes_per_block(config, block_size, resolve_kv_cache_dtype(kv_cache_dtype, model_dtype))


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS. Loading leaves hundreds of MB of freed transients
    (the checkpoint's fp32 tensors, the weights that packing or quantization replaced) in glibc's
    heap, where RSS still counts them: measured on the default model, 705 -> 345 MB RSS with its
    GGUF's blocks, 978 -> 491 MB in bf16 (with `release_load_copies`)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        pass


class ModelRuntime:
    """A loaded model and, once `allocate` ran, its paged KV cache. `config` is the model's
    (`ModelConfig`, its `model_id` suffixed by the quantization and a quantized cache's format);
    `description`: the start-up line naming the weights that run."""

    def __init__(self, model: CausalLM, config: ModelConfig, device: torch.device, quantization: str,
                 kv_dtype: torch.dtype, description: str) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.quantization = quantization
        self.dtype: torch.dtype = next(model.parameters()).dtype
        self.kv_dtype = kv_dtype
        self.description = description
        self._runner: ModelRunner | None = None

    def block_bytes(self, block_size: int, one_table: bool = False) -> int:
        """Bytes of one KV block (a group of layers' K and V for `block_size` tokens, in the cache's
        format: baton.model.kv_groups); `one_table`: of every layer (a draft's cache)."""
        return kv_bytes_per_block(self.config, block_size, self.kv_dtype, one_table)

    def allocate(self, num_blocks: int, block_size: int, max_num_seqs: int = 1, one_table: bool = False) -> None:
        """Make the paged KV cache: `num_blocks` of `block_size` tokens (block 0 is reserved above),
        and a hybrid's state pool: a slot for each of `max_num_seqs` running requests. `one_table`:
        every layer in one block table, window layers too (a draft model's cache is indexed by the
        target's global table: its rows carry no window tables)."""
        assert self._runner is None, "the KV cache is allocated once"
        self._runner = ModelRunner(self.model, self.config, num_blocks, block_size, self.kv_dtype, max_num_seqs,
                                   one_table)

    @property
    def has_state_layers(self) -> bool:
        """Whether some layers keep a fixed-size state per request (Gated DeltaNet) beside the KV cache."""
        return self.config.has_state_layers

    def state_bytes(self, max_num_seqs: int) -> int:
        """Bytes of the state pool for `max_num_seqs` requests (0 without state layers): taken from
        the KV budget before it is cut into blocks."""
        if not self.config.has_state_layers:
            return 0
        dims = state_dims(self.config.deltanet)
        return max_num_seqs * StatePool.bytes_per_slot(dims, sum(self.config.layer_deltanet), self.dtype)

    @property
    def state_kind(self) -> str:
        """Which kind of state layers keep the state (what a handed-off state must have been made by)."""
        return str(self.config.deltanet.get("layout") or "gated_deltanet")

    def state_layout(self) -> dict[str, tuple[list[int], torch.dtype]]:
        """One request's state tensors: name -> (shape, dtype) ({} without state layers)."""
        pool = self._runner.state_pool if self._runner is not None else None
        return pool.slot_layout() if pool is not None else {}

    def read_state(self, request_id: str) -> dict[str, torch.Tensor]:
        """A copy of the request's state (its slot), on the CPU."""
        return self.runner.read_state(request_id)

    def write_state(self, request_id: str, tensors: dict[str, torch.Tensor]) -> None:
        """Resume the request's state layers from `tensors` (of `state_layout`)."""
        self.runner.write_state(request_id, tensors)

    def has_state(self, request_id: str) -> bool:
        """Whether the request holds a state slot (it has started, or its state was written)."""
        return self.runner.has_state(request_id)

    def release_state(self, request_id: str) -> None:
        """Free a finished, aborted or preempted request's state slot (no-op without state layers)."""
        if self._runner is not None:
            self._runner.release_state(request_id)

    def keep_verified_state(self, request_id: str, accepted: int) -> None:
        """After a step that verified the request's proposals: its state layers continue from the
        state after its last token and its first `accepted` proposals (no-op without state layers)."""
        if self.config.has_state_layers:
            self.runner.keep_verified(request_id, accepted)

    @property
    def free_state_slots(self) -> int:
        """State slots no request holds now (a verify step borrows one per proposal)."""
        return self.runner.free_state_slots

    @property
    def runner(self) -> ModelRunner:
        assert self._runner is not None, "ModelRuntime.allocate must run before a step"
        return self._runner

    def execute(self, batch: StepBatch) -> StepResult:
        """One forward step over plain rows: see `ModelRunner.execute`."""
        return self.runner.execute(batch)

    def propose(self, rows: Sequence[DraftRow], catch_up: Sequence[StepRow], vocab: int) -> tuple[list[list[int]], int]:
        """As a draft model: k greedy proposals per row and the number of forwards (baton.model.draft)."""
        return propose_greedy(self.runner.execute, rows, catch_up, vocab)

    def borrow_vocab(self, target: ModelRuntime) -> None:
        """As a multi-token-prediction head (`RuntimeConfig.mtp`): embed and score with the target's tables."""
        assert isinstance(self.model, MtpHead)
        self.model.borrow_vocab(target.model)

    def propose_mtp(self, rows: Sequence[MtpRow], vocab: int) -> tuple[list[list[int]], int]:
        """As a multi-token-prediction head: each row's proposals and the number of forwards (baton.model.mtp)."""
        return propose_mtp(self.runner.execute, rows, vocab, self.dtype)

    def clear_block(self, block: int) -> None:
        """Zero one block of the cache (a draft's, whose positions there were written by another
        engine: the head reads zeros there rather than another request's KV)."""
        self.runner.clear_block(block)

    @property
    def block_shape(self) -> list[int]:
        return self.runner.block_shape

    def read_block(self, block: int | tuple[int, ...]) -> torch.Tensor:
        return self.runner.read_block(block)

    def write_block(self, block: int | tuple[int, ...], data: torch.Tensor) -> None:
        self.runner.write_block(block, data)

    def set_thread_gate(self, gate: ThreadGate | None) -> None:
        """Let the decode layers give lent threads back mid-step (baton/model/thread_gate.py)."""
        self.model.thread_gate = gate

    def plan_report(self) -> str:
        """What runs, per op, on this machine (`baton plan`)."""
        from baton.model.plan_report import report

        return report(self.model, self.quantization)


def load_runtime(config: RuntimeConfig) -> ModelRuntime:
    """Load `config.model_dir` as `config` says, deciding each forward-path choice once."""
    model_dir = Path(config.model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a model directory (no config.json); "
                                "resolve a model name with baton.common.model_files.resolve_model first")
    device = torch.device(config.device) if config.device else default_device()
    source = gguf_source(model_dir)
    dtype, quantization = resolve_weights(config.dtype, config.quantization, source, device,
                                          native_kernels=config.native_kernels)
    # the projections a GGUF's blocks will serve are not read now (only one at a time, to check each
    # repack): loading never holds the dequantized model beside its packs
    defer = None
    if source is not None and serves_gguf_blocks(quantization, source, device, config.native_kernels):
        defer = functools.partial(gguf_block_targets, gguf_path=source)
    # gpt-oss's MXFP4 experts: repacked without loss as Q8_0 ops at load, unless dense ones are asked for
    mxfp4_q8, expert_kernels = mxfp4_experts_plan(model_dir, config.quantization, config.dtype, device,
                                                  config.native_kernels)
    model, model_config, unread = load_model_deferring(model_dir, dtype, device, prepare=False, defer=defer,
                                                       mxfp4_as_q8_0=mxfp4_q8, kernels=expert_kernels, mtp=config.mtp)
    drop_all_touched_pages()  # the file's pages the load read: the page cache keeps them, the worker need not
    # projections about to be quantized get no bf16 pack first (it would be made and dropped)
    quantizing = asks_for_quantized(quantization, source) and device.type == "cpu"
    release = config.release_load_copies
    prepare = functools.partial(model.prepare, native_kernels=config.native_kernels, gemv_amx=config.gemv_amx,
                                triton=config.triton, batch_invariant=config.batch_invariant)
    # the all-layers plan is built once, at the end, over the ops as they are then
    prepare(pack_projections=not quantizing, release_originals=release, build_plan=False)
    scheme = quantize_model(model, quantization, gguf_source=source, native_kernels=config.native_kernels,
                            build_plan=False, unread=unread)
    del unread
    unread_left = [name for name, p in model.named_parameters() if p.is_meta]
    assert not unread_left, f"parameters never read: {unread_left[:4]}"
    if quantizing and scheme == "none":  # no quantized kernel here: serve the dtype, packed
        prepare(release_originals=release, build_plan=False)
    if scheme != "none":
        # KV computed with other weights is another model's: prefix hashes (and the block store's
        # keys) must not match across quantizations
        model_config = dataclasses.replace(model_config, model_id=f"{model_config.model_id}+{scheme}")
    experts = experts_description(model)
    if experts is not None and scheme == "none":  # the experts' numbers are the native kernel's, not dense
        model_config = dataclasses.replace(model_config, model_id=f"{model_config.model_id}+experts_q8_0")
    release_readers()  # the file's tensors are all read (or mapped as packs): its header is not needed
    weights_dtype = next(model.parameters()).dtype
    description = describe_weights(scheme, weights_dtype, config.dtype, config.quantization, source)
    fp8 = describe_fp8(model_dir)  # the dense weights above were FP8 blocks in the checkpoint
    if fp8 is not None:
        description = f"{description}; {fp8}"
    if experts is not None:
        description = f"{description}; {experts}"
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, weights_dtype)
    if is_quantized(kv_dtype):
        model.use_kv_dtype(kv_dtype)
        # a quantized cache's blocks are other numbers than the model's own: prefix hashes (and the
        # store's keys) must not match across cache formats
        model_config = dataclasses.replace(
            model_config, model_id=f"{model_config.model_id}+kv_{str(kv_dtype).removeprefix('torch.')}")
    if release:
        freed = model.release_load_copies(build_plan=False)
        logger.info("one copy of each weight: %.0f MB of load-time copies freed", freed / 1e6)
    if device.type == "cpu":  # native packs, dense weights and embeddings: one copy per machine
        share_weights(model, model_dir, source)
    model.build_layers_plan()
    return_freed_memory()
    return ModelRuntime(model, model_config, device, scheme, kv_dtype, description)
