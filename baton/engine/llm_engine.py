"""The engine: scheduler + model runner + sampler in one process, stepped in a loop.

It is the offline API's core, the baseline the disaggregated pipeline is measured against, and the
workers' only way into the scheduler, the block pool and the model runner. It speaks request ids:
`add_request(request_id, prompt_token_ids, params, ...)`, `abort(ids)`, `step(loaded=...)` returning
frozen `EngineOutput`s, `take_kv_loads()` for the KV connector's worker side, and `stats()`, a frozen
snapshot. No caller sees a `Sequence`; nothing else touches a block. No I/O: the model directory is
resolved (downloaded, converted) by the caller.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence as Seq
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from baton.common.context_length import model_context_length
from baton.common.finish_reason import FinishReason
from baton.engine.block_manager import BlockManager
from baton.engine.logprobs import token_logprobs
from baton.model.runtime import PromptRows, kv_groups, RowKind, RuntimeConfig, ThreadGate, load_runtime, return_freed_memory
from baton.engine.block_pool import BlockPool
from baton.engine.sampling import sample, suppress_early_stops
from baton.engine.kv_connector import KVConnectorScheduler
from baton.engine.kv_types import KVLoad, LoadedKV, RemoteKV
from baton.engine.outputs import EngineOutput, EngineStats, KVHandoff
from baton.engine.pooling import Pooling, PoolState
from baton.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, StepOutput
from baton.engine.speculative_config import SpeculativeConfig, parse_speculative_config
from baton.engine.speculator import DraftJob, proposals_of, verify_rows
from baton.engine.drafter import Drafter, check_same_tokenizer
from baton.engine.mtp_drafter import MtpDrafter
from baton.engine.state_cache import StateCache
from baton.engine.step_input import build_step_batch
from baton.engine.window_blocks import freeable_window
from baton.engine.structured import StructuredOutput
from baton.engine.sequence import Sequence
from baton.common.sampling_params import SamplingParams

logger = logging.getLogger("baton.engine.llm_engine")


@dataclass
class EngineConfig:
    model: str | Path = ""  # a model directory (resolve a name with baton.common.model_files.resolve_model)
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
    quantization: str = "auto"  # auto, none, int8, int4: the projections' weights (baton.model.quant)
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), int8, fp8: the KV cache (baton.model.kv_quant)
    # speculative decoding (baton.engine.speculator): a SpeculativeConfig, its dict or JSON; None: off
    speculative_config: SpeculativeConfig | dict | str | None = None
    # free each projection's loaded weight as soon as its op holds the copy it reads, so that loading
    # peaks near one copy of the weights (the workers); LLM keeps them (`prepare()` may run again)
    release_load_copies: bool = False


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_dir = Path(config.model)
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{self.model_dir} is not a model directory (no config.json); "
                                    "resolve a model name with baton.common.model_files.resolve_model first")
        self.runtime = load_runtime(RuntimeConfig(
            self.model_dir, config.dtype, config.device, config.quantization, config.kv_cache_dtype,
            config.release_load_copies))
        device = self.runtime.device
        self.model_config = self.runtime.config
        self.quantization, self.dtype, self.kv_dtype = self.runtime.quantization, self.runtime.dtype, self.runtime.kv_dtype
        logger.info("%s", self.runtime.description)
        speculative = parse_speculative_config(config.speculative_config)
        self.drafter: Drafter | MtpDrafter | None = None
        if speculative is not None and speculative.method == "draft_model":
            self.drafter = self._load_drafter(Path(speculative.model), device)
        elif speculative is not None and speculative.method == "mtp":
            self.drafter = self._load_mtp(device, speculative.num_speculative_tokens)
        # the draft's cache holds one block per target block (indexed by the target's ids), so both
        # come out of the one budget: a container sized by --kv-cache-memory holds both
        block_bytes = self.runtime.block_bytes(config.block_size)
        draft_block_bytes = self.drafter.block_bytes if self.drafter is not None else 0
        # a hybrid's state slots (one per running request) come out of the same budget first, then
        # its prefix cache's state snapshots (a quarter of what is left; baton.engine.state_cache)
        config = self.config = self._fit_state_slots(config)
        state_bytes = self.runtime.state_bytes(config.max_num_seqs)
        num_snapshots = self._num_state_snapshots(config, state_bytes)
        snapshot_bytes = num_snapshots * self.runtime.state_bytes(1)
        num_blocks = config.num_kv_blocks or max(
            2, (config.kv_cache_memory - state_bytes - snapshot_bytes) // (block_bytes + draft_block_bytes))
        self.kv_cache_bytes = num_blocks * (block_bytes + draft_block_bytes) + state_bytes + snapshot_bytes
        if self.drafter is not None:
            self.drafter.allocate(num_blocks)
        # the model's context as the gateway reads it (RoPE scaling included: baton.common.context_length)
        max_model_len = (config.max_model_len or model_context_length(self.model_dir)
                         or self.model_config.max_position_embeddings)
        self.pool = BlockPool(num_blocks, config.block_size)
        # an all-window model (Mistral) frees the blocks behind its window (baton.engine.window_blocks);
        # one mixing window and global layers frees its window tables' (baton.model.kv_groups)
        prefix_caching = config.enable_prefix_caching
        self.state_cache = (StateCache(num_snapshots, config.block_size, self.model_config.model_id,
                                       self.runtime.read_state, self.runtime.write_state, self.runtime.has_state)
                            if num_snapshots else None)
        self.block_manager = BlockManager(self.pool, self.model_config.model_id, prefix_caching,
                                          window=freeable_window(self.model_config), state_cache=self.state_cache,
                                          window_tables=kv_groups(self.model_config).num_window_tables)
        self.connector = (KVConnectorScheduler(config.block_size, self.model_config.model_id,
                                               self.runtime.state_kind if self.runtime.has_state_layers else None)
                          if config.kv_connector else None)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.scheduler_policy,
                            max_model_len),
            self.block_manager, self.model_config.eos_token_ids, self.connector, speculative,
        )
        self.runtime.allocate(num_blocks, config.block_size, config.max_num_seqs)
        if self.scheduler.speculator is not None and self.runtime.has_state_layers:
            # a verify row's state layers keep the state after each of its tokens but the last in a
            # free state slot until its accepted count is known: proposals no more than are free
            self.scheduler.speculator.spare_states = self._spare_state_slots
        self.structured = StructuredOutput(self.model_dir, self.model_config.vocab_size, self.eos_token_ids)
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.last_num_batched_tokens = 0
        self.last_num_decode_tokens = 0
        self.num_tokens_computed = 0  # every step's, since start: heartbeats show progress by it
        self._kv_loads: list[KVLoad] = []
        self._requests: dict[str, Sequence] = {}  # unfinished, by id
        logger.info("engine ready: %s (%s%s, %s), %d KV blocks of %d tokens%s (%.0f MiB%s), policy %s",
                    self.model_dir.name, self.dtype,
                    "" if self.quantization == "none" else f", {self.quantization} weights",
                    device, num_blocks, config.block_size,
                    f" ({config.kv_cache_dtype})" if self.kv_dtype != self.dtype else "",
                    self.kv_cache_bytes / 2**20, " with the draft's" if self.drafter is not None else "",
                    config.scheduler_policy)
        groups = kv_groups(self.model_config)
        if groups.grouped:
            logger.info("KV blocks hold %d layers each: the global layers' table and %d tables of window layers, "
                        "whose blocks behind the window (%d tokens) are freed as a request runs",
                        groups.group_size, groups.num_window_tables, self.model_config.sliding_window)

    def _load_drafter(self, draft_dir: Path, device: torch.device) -> Drafter:
        """The draft model of a draft_model config (a directory: callers resolve names), in the
        target's dtype; its KV cache, indexed by the target's block ids (baton.engine.draft_cursor),
        is allocated once the block count is known."""
        if not (draft_dir / "config.json").is_file():
            raise FileNotFoundError(f"speculative_config.model {draft_dir} is not a model directory (no config.json)")
        check_same_tokenizer(self.model_dir, draft_dir)
        drafter = Drafter(draft_dir, str(self.dtype).removeprefix("torch."), str(device), self.config.block_size,
                          self.model_config.vocab_size)
        return_freed_memory()
        logger.info("draft model %s: %d layers, hidden %d, proposing %s tokens a step", draft_dir.name,
                    drafter.config.num_layers, drafter.config.hidden_size,
                    parse_speculative_config(self.config.speculative_config).num_speculative_tokens)
        return drafter

    def _spare_state_slots(self, scheduled: list[Sequence]) -> int:
        """State slots free once this step's new requests took theirs."""
        return self.runtime.free_state_slots - sum(1 for seq in scheduled if not self.runtime.has_state(seq.seq_id))

    def _load_mtp(self, device: torch.device, k: int) -> MtpDrafter:
        """The checkpoint's multi-token-prediction layer as the draft (baton/engine/mtp_drafter.py),
        in the target's dtype and quantization; its cache is allocated as a draft model's."""
        drafter = MtpDrafter(self.runtime, self.model_dir, str(self.dtype).removeprefix("torch."), str(device),
                             self.config.block_size, self.config.quantization)
        return_freed_memory()
        logger.info("multi-token prediction: the checkpoint's MTP layer (%s) drafts %d token%s a step",
                    drafter.runtime.description, k, "" if k == 1 else "s")
        return drafter

    def set_thread_gate(self, gate: ThreadGate | None) -> None:
        """Let the decode layers give lent threads back mid-step (baton/model/thread_gate.py): the
        worker arms `gate` for the steps that borrow. None: steps are never interrupted."""
        self.runtime.set_thread_gate(gate)

    @property
    def eos_token_ids(self) -> list[int]:
        return self.model_config.eos_token_ids

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def model_id(self) -> str:
        return self.model_config.model_id

    @property
    def block_shape(self) -> list[int]:
        """One KV block's shape: [layers, 2, block_size, kv_heads, head_dim]."""
        return list(self.runtime.block_shape)

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, *,
                    output_token_ids: Seq[int] = (), arrival_time: float | None = None,
                    first_token_time: float | None = None, remote_kv: RemoteKV | None = None,
                    remote_decode: bool = False, block_hashes: Seq[str] | None = None,
                    pooling: Pooling | None = None) -> None:
        """Queue a request. `output_token_ids`: tokens already generated (a handoff, a resume);
        `remote_kv`: what the block store holds of its leading tokens (the connector loads it);
        `remote_decode`: finish after the first token by handoff, leaving its prompt's blocks in the
        output to save; `block_hashes`: its full blocks' ids if the caller computed them already;
        `pooling`: an embedding request (baton.engine.pooling): its prompt is run and pooled, nothing
        sampled, and it finishes with STOP and the vector in its output's `embedding`.
        Raises ValueError for a request it cannot take (nothing is queued then)."""
        if pooling is not None and (remote_decode or output_token_ids or
                                    (remote_kv is not None and pooling.needs_every_token)):
            raise ValueError(f"request {request_id}: a pooling request is a prompt alone, computed here "
                             "(no handoff, no output tokens, no stored KV for mean or cls)")
        seq = Sequence(request_id, list(prompt_token_ids), params, arrival_time=arrival_time,
                       output_token_ids=list(output_token_ids), remote_kv=remote_kv,
                       remote_decode=remote_decode, block_hashes=None if block_hashes is None else list(block_hashes),
                       pooling=PoolState(pooling, len(prompt_token_ids)) if pooling is not None else None)
        seq.first_token_time = first_token_time
        self._add(seq)

    def _add(self, seq: Sequence) -> None:
        remote = seq.remote_kv
        if remote is not None and len(remote.block_hashes) * self.block_size > seq.num_prompt_tokens:
            raise ValueError(f"request {seq.seq_id} claims more stored blocks than its prompt has")
        if seq.seq_id in self._requests:
            raise ValueError(f"request {seq.seq_id} is already in this engine")
        self.structured.start(seq)  # a constrained request's grammar matcher (ValueError if bad)
        self.scheduler.add(seq)
        self._requests[seq.seq_id] = seq

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop these requests and free their blocks (unknown or finished ids are ignored)."""
        for request_id in request_ids:
            if self._requests.pop(request_id, None) is not None:
                self.scheduler.abort(request_id)
                self._release_state(request_id, keep=False)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def has_runnable(self) -> bool:
        """Whether a step would compute something now (not only wait for KV loads)."""
        return bool(self.scheduler.running or self.scheduler.waiting)

    def step(self, loaded: Iterable[LoadedKV] = ()) -> list[EngineOutput]:
        """Take the KV loads that arrived (`loaded`), schedule, run the model once, sample, apply the
        results; returns what changed, one record per request.

        KV loads the schedule asked for are kept for `take_kv_loads`; a handed-off request's blocks
        are encoded here (into its output's `handoff.save`) and then freed.
        """
        self._finish_kv_loads(loaded)
        plan = self.scheduler.schedule()
        for seq in plan.preempted:  # recomputed when it runs again (from its last state snapshot, if any)
            self._release_state(seq.seq_id, keep=True)
        self._kv_loads.extend(plan.kv_loads)
        outputs = [StepOutput(seq, finished=True) for seq in plan.failed]
        self.last_num_batched_tokens = plan.num_batched_tokens
        self.num_tokens_computed += plan.num_batched_tokens
        self.last_num_decode_tokens = 0
        if plan.draft is not None:
            self._run_draft(plan.draft)
        if plan.scheduled:
            outputs += self._run(plan)
        return [self._output(out) for out in outputs]

    def _run_draft(self, job: DraftJob) -> None:
        """The draft model proposes into the slots the schedule reserved (after the schedule, as
        vLLM orders it: the scheduler and its speculation policy run no model)."""
        assert self.drafter is not None and self.scheduler.speculator is not None
        started = time.perf_counter()
        self.drafter.run(job)
        self.scheduler.speculator.add_draft_seconds(time.perf_counter() - started)

    def _run(self, plan: SchedulerOutput) -> list[StepOutput]:
        speculator = self.scheduler.speculator
        if speculator is not None:
            speculator.start_step()
        by_id = {seq.seq_id: seq for seq, _ in plan.scheduled}
        if self.state_cache is not None:  # a prefix hit resumes from the state snapshot at its end
            self.state_cache.resume(plan.scheduled)
        batch = build_step_batch(plan.scheduled)
        mtp_rows = []
        if isinstance(self.drafter, MtpDrafter) and speculator is not None:
            # the MTP layer reads the target's final hidden state of every position it computes
            mtp_rows = speculator.mtp_cursors([seq for seq, _ in plan.scheduled])
            batch = replace(batch, hidden_states=bool(mtp_rows))
        self.last_num_decode_tokens = sum(len(row.tokens) for row in batch.rows if row.kind is not RowKind.CHUNK)
        result = self.runtime.execute(batch)
        sample_seqs = [by_id[request_id] for request_id in result.sampled]
        verify_seqs = [by_id[request_id] for request_id in result.verified]
        all_logits, prompt_rows = result.logits, result.prompt_rows
        if result.hidden is not None:
            offset = 0
            for pooled in result.pool_rows:  # each pooling request folds in its chunk's rows
                pooling = by_id[pooled.request_id].pooling
                assert pooling is not None
                pooling.add(result.hidden[offset:offset + pooled.count])
                offset += pooled.count
        # one row per sampled request, then one per verified position of each speculating request
        rows = [(s, 0) for s in sample_seqs] + verify_rows(verify_seqs)
        logits = all_logits[:len(rows)]
        self.num_steps += 1
        tokens: list[int] = []
        logprobs: list[float] = []
        top_logprobs: list[list] | None = None
        if rows:
            seqs = [s for s, _ in rows]
            params = [s.sampling_params for s in seqs]
            # position j of a speculating row is output number n + j, after its first j proposals
            draws = [s.num_output_tokens + j for s, j in rows]
            allowed = suppress_early_stops(logits, params, draws, self.eos_token_ids)
            tokens, logprobs = sample(
                # grammar masks (a no-op when unconstrained); a verified position's after its proposals
                self.structured.apply(seqs, allowed, [proposals_of(s)[:j] for s, j in rows]),
                params,
                [s.token_ids + proposals_of(s)[:j] if s.sampling_params.edits_logits else [] for s, j in rows],
                draws,
                [s.num_prompt_tokens for s in seqs],
            )
            top_logprobs = self._requested_logprobs(seqs, logits, tokens, logprobs)
        if prompt_rows:
            self._record_prompt_logprobs(prompt_rows, all_logits[len(rows):], by_id)
        num_sampled = len(sample_seqs)
        tops = top_logprobs if top_logprobs is not None else [[] for _ in rows]
        verified, offset = [], num_sampled
        for seq in verify_seqs:
            end = offset + 1 + len(proposals_of(seq))
            verified.append((seq, tokens[offset:end], logprobs[offset:end], tops[offset:end]))
            offset = end
        step_outputs = self.scheduler.update_from_output(
            plan, sample_seqs, tokens[:num_sampled], logprobs[:num_sampled],
            None if top_logprobs is None else tops[:num_sampled], verified)
        if self.runtime.has_state_layers:
            rows_by_id = {row.request_id: row for row in batch.rows}
            for seq in verify_seqs:  # each verify row's state after the tokens it accepted
                row = rows_by_id[seq.seq_id]
                accepted = seq.num_computed_tokens - row.start - 1  # rolled back to them (a finished row: any)
                self.runtime.keep_verified_state(seq.seq_id, max(0, min(accepted, len(row.tokens) - 1)))
        self.num_generated_tokens += sum(len(out.new_token_ids) for out in step_outputs)
        if mtp_rows:
            assert isinstance(self.drafter, MtpDrafter)
            self.drafter.record(batch, result, [(seq, cursor) for seq, cursor in mtp_rows if not seq.is_finished])
        self._end_broken_grammars(step_outputs)
        if self.state_cache is not None:  # the states this step left at block boundaries
            self.state_cache.after_step(plan.scheduled)
        if speculator is not None:
            speculator.end_step()
        return step_outputs

    def _output(self, out: StepOutput) -> EngineOutput:
        """The frozen record of a step's change to one request (a handed-off request's blocks are
        encoded now, then freed)."""
        seq = out.seq
        reason = seq.finish_reason if out.finished else None
        handoff = None
        if reason is FinishReason.HANDOFF:
            assert self.connector is not None, "remote_decode needs a KV connector"
            # a hybrid's state slot is read here, before `release_state` below frees it
            save = self.connector.build_save(seq, seq.num_prompt_tokens, self.runtime.read_block,
                                             self.runtime.read_state if self.runtime.has_state_layers else None)
            self.scheduler.free_finished(seq)
            handoff = KVHandoff(tuple(seq.output_token_ids), seq.first_token_time or time.time(), save)
        if reason is not None:
            self._requests.pop(seq.seq_id, None)
            self._release_state(seq.seq_id, keep=reason in (FinishReason.STOP, FinishReason.LENGTH))
        first = seq.num_output_tokens == len(out.new_token_ids) and bool(out.new_token_ids)
        embedding = tuple(seq.pooling.result()) if seq.pooling is not None and reason is FinishReason.STOP else None
        return EngineOutput(
            seq.seq_id, tuple(out.new_token_ids), tuple(out.new_logprobs), tuple(out.new_top_logprobs),
            reason, seq.error if reason is FinishReason.ERROR else None, seq.num_prompt_tokens,
            seq.num_output_tokens, seq.num_cached_tokens,
            tuple(seq.prompt_logprobs) if first and seq.prompt_logprobs is not None else None, handoff, embedding)

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
    def _record_prompt_logprobs(prompt_rows: list[PromptRows], logits: torch.Tensor, by_id: dict[str, Sequence]) -> None:
        """Store each prompt token's logprob (and top k) on its request. logits: [P, V], the rows of
        `prompt_rows` in order; the row of position p scores the token at p + 1."""
        offset = 0
        for rows in prompt_rows:
            seq = by_id[rows.request_id]
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

    def _release_state(self, request_id: str, keep: bool) -> None:
        """Free the request's state slot; `keep`: its last decode snapshot joins the prefix cache
        (it finished, or was preempted and may resume from it)."""
        if self.state_cache is not None:
            if keep:
                self.state_cache.publish(request_id)
            else:
                self.state_cache.drop(request_id)
        self.runtime.release_state(request_id)

    def _fit_state_slots(self, config: EngineConfig) -> EngineConfig:
        """A hybrid's state slot is a fixed size per running request, and large (Qwen3.5-0.8B's 18 Gated
        DeltaNet layers keep 19 MiB, the KV of ~1500 tokens): max_num_seqs slots could take the whole
        budget and leave the KV one block (a 1 GiB pool with 64 slots did). The slots get at most half
        of the budget: max_num_seqs is lowered to what fits there, said in the log, and the KV keeps
        the rest. A fixed block count (--num-kv-blocks) leaves the slots as asked."""
        if not self.runtime.has_state_layers or config.num_kv_blocks:
            return config
        per_slot = self.runtime.state_bytes(1)
        fit = max(1, config.kv_cache_memory // 2 // per_slot)
        if fit >= config.max_num_seqs:
            return config
        logger.warning("%s keeps %.1f MiB of state per running request: %d fit in half of the %.0f MiB KV budget, "
                       "so at most %d requests run at once (--max-num-seqs %d lowered; a larger --kv-cache-memory "
                       "raises it)", self.model_dir.name, per_slot / 2**20, fit, config.kv_cache_memory / 2**20,
                       fit, config.max_num_seqs)
        return replace(config, max_num_seqs=fit)

    def _num_state_snapshots(self, config: EngineConfig, state_bytes: int) -> int:
        """How many state snapshots the prefix cache keeps (0: no state layers or no prefix caching):
        with a memory budget, a quarter of what the state slots leave; with a block count, two per
        running request."""
        if not (self.runtime.has_state_layers and config.enable_prefix_caching):
            return 0
        if config.num_kv_blocks:
            return 2 * config.max_num_seqs
        per_snapshot = self.runtime.state_bytes(1)
        return max(2, min(4 * config.max_num_seqs, (config.kv_cache_memory - state_bytes) // 4 // per_snapshot))

    def take_kv_loads(self) -> list[KVLoad]:
        """The KV loads scheduled since the last call (the connector's worker side runs them; their
        results go into the next `step(loaded=...)`)."""
        loads, self._kv_loads = self._kv_loads, []
        return loads

    def _finish_kv_loads(self, results: Iterable[LoadedKV]) -> None:
        """Write the blocks that arrived and let their requests run (cancelled ones are skipped:
        their blocks may already belong to another request)."""
        for result in results:
            seq = self.scheduler.loading.get(result.request_id)
            if seq is None:
                continue
            if self.runtime.has_state_layers and result.state is None:
                # blocks without the state at their end resume nothing: the prompt is recomputed
                self.scheduler.finish_kv_load(result.request_id, 0)
                continue
            first = seq.num_computed_tokens // self.block_size
            for offset, kv in enumerate(result.kv):
                self.runtime.write_block(seq.block_ids(first + offset), kv)
                if isinstance(self.drafter, MtpDrafter):  # its positions' head KV was never computed here
                    self.drafter.clear_block(seq.block_table[first + offset])
            if result.state is not None:
                self.runtime.write_state(result.request_id, result.state)
            self.scheduler.finish_kv_load(result.request_id, result.num_tokens)

    def stats(self) -> EngineStats:
        """A snapshot of the counts (take it between steps; it may be read during one)."""
        scheduler, pool = self.scheduler, self.pool
        tables = 1 + self.block_manager.num_window_tables
        return EngineStats(
            num_requests_running=len(scheduler.running), num_requests_waiting=len(scheduler.waiting),
            num_requests_loading_kv=len(scheduler.loading), num_preemptions=scheduler.num_preemptions,
            # in blocks of every layer (a model with window tables spends one block per table on a
            # position: the gateway's tokens = blocks x block_size stay tokens of a full request)
            num_kv_blocks_total=pool.num_usable_blocks // tables, num_kv_blocks_used=-(-pool.num_used_blocks // tables),
            kv_cache_usage=pool.usage(), block_size=pool.block_size, max_num_seqs=scheduler.config.max_num_seqs,
            policy=scheduler.config.policy,
            num_free_seqs=scheduler.config.max_num_seqs - scheduler.num_admitted - len(scheduler.waiting),
            num_batched_tokens=self.last_num_batched_tokens, num_decode_tokens=self.last_num_decode_tokens,
            kv_cache_bytes=self.kv_cache_bytes, num_tokens_computed=self.num_tokens_computed,
            **self._spec_stats())

    def _spec_stats(self) -> dict:
        speculator = self.scheduler.speculator
        if speculator is None:
            return {}
        spec = speculator.stats
        return {"spec_num_drafts": spec.num_drafts, "spec_num_draft_tokens": spec.num_draft_tokens,
                "spec_num_accepted_tokens": spec.num_accepted_tokens,
                "spec_accepted_per_pos": tuple(spec.accepted_per_pos)}
