"""Turns a step's scheduled rows into tensors, runs the model over the paged KV cache, returns logits.

It reads a row through `ScheduledRow`, the part of the engine's request a forward pass needs, so the
model layer never imports the engine's `Sequence` (the engine passes its own requests; the drafter
passes its views of them)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from baton.model.config import ModelConfig
from baton.model.attention import AttentionMetadata, DecodeGroup, PrefillSpan, group_by_context
from baton.model.kv_quant import as_bytes, convert_rows, row_width
from baton.model.gated_deltanet import StateMeta, StatePool
from baton.model.short_conv import state_dims
from baton.model.model import LlamaModel


class RowPooling(Protocol):
    """A pooling request's state as the runner reads it: which positions of a chunk are pooled."""

    def positions(self, start: int, end: int) -> range: ...


class RowParams(Protocol):
    prompt_logprobs: int | None


class ScheduledRow(Protocol):
    """What `ModelRunner.execute` reads of a scheduled request (the engine's `Sequence` is one)."""

    token_ids: Seq[int]
    num_computed_tokens: int
    block_table: Seq[int]

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def spec_token_ids(self) -> Seq[int]: ...

    @property
    def pool(self) -> RowPooling | None: ...

    @property
    def sampling_params(self) -> Any: ...



@dataclass
class PromptRows:
    """Logits rows of positions [start, start + count) of a request's prompt (for prompt logprobs)."""

    seq: ScheduledRow
    start: int
    count: int


@dataclass
class PoolRows:
    """How many hidden-state rows of a pooling request this step returns (its chunk's pooled ones)."""

    seq: ScheduledRow
    count: int


@dataclass
class _QueryRow:
    """One decode-kernel query of a step: a request's token at `position` (sampled: a plain decode
    row, whose logits are sampled; else a verified position of a speculating request)."""

    seq: ScheduledRow
    position: int
    token: int
    sampled: bool


@dataclass
class StepResult:
    """What one step of the model gave: see `ModelRunner.execute`."""

    sample_seqs: list[ScheduledRow]
    logits: torch.Tensor  # [S + V + P, vocab]
    prompt_rows: list[PromptRows]
    pool_rows: list[PoolRows]
    hidden: torch.Tensor | None  # [sum of pool_rows counts, hidden] fp32, None without pooling rows
    # speculating rows (baton.engine.spec_decode), each with 1 + len(spec_token_ids) logits rows
    # after the S sampled ones (V rows in all), one per verified position
    verify_seqs: list[ScheduledRow] = field(default_factory=list)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of the KV cache in `dtype` (a quantized format: codes and scales)."""
    # only attention layers keep KV per token (a hybrid's state layers keep a slot per request: `StatePool`)
    row_bytes = row_width(config.head_dim, dtype) * dtype.itemsize
    return len(config.attention_layers) * 2 * block_size * config.num_kv_heads * row_bytes


def _request_id(seq: ScheduledRow) -> str:
    # the engine's Sequence carries its request id; a row without one (a view) is itself
    return str(getattr(seq, "seq_id", id(seq)))


class ModelRunner:
    def __init__(self, model: LlamaModel, config: ModelConfig, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype | None = None, max_num_seqs: int = 0) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.kv_dtype = kv_dtype or self.dtype  # int8 / fp8: quantized rows (baton.model.kv_quant)
        # [layers, k/v, kv_heads, slots, head_dim (+ 4 scale bytes when quantized)]; slot = block *
        # block_size + offset (head-major: see baton.model.attention)
        self.kv_cache = torch.zeros(
            len(config.attention_layers), 2, config.num_kv_heads, num_blocks * block_size,
            row_width(config.head_dim, self.kv_dtype), dtype=torch.uint8 if self.kv_dtype.itemsize == 1 else self.kv_dtype,
            device=self.device,
        ).view(self.kv_dtype)
        # a hybrid's state layers: one slot per running request (the scheduler runs at most
        # max_num_seqs), assigned on first sight, released by the engine (`release_state`)
        self.state_pool: StatePool | None = None
        if config.has_state_layers:
            self.state_pool = StatePool(state_dims(config.deltanet), sum(config.layer_deltanet),
                                        max(1, max_num_seqs), self.dtype, self.device)

    def read_state(self, request_id: str) -> dict[str, torch.Tensor]:
        assert self.state_pool is not None
        return self.state_pool.read(request_id)

    def write_state(self, request_id: str, tensors: dict[str, torch.Tensor]) -> None:
        assert self.state_pool is not None
        self.state_pool.write(request_id, tensors)

    def release_state(self, request_id: str) -> None:
        """A request finished, was aborted or preempted: its state slot is free (recompute rebuilds it)."""
        if self.state_pool is not None:
            self.state_pool.release(request_id)

    def _state_meta(self, rows: list[ScheduledRow], chunks: list[tuple[ScheduledRow, int, int]]) -> StateMeta:
        # rows: the step's decode rows (first in the flattened batch); chunks: (row, first token, tokens)
        pool = self.state_pool
        assert pool is not None
        decode = [pool.slot(_request_id(seq), starting=seq.num_computed_tokens == 0) for seq in rows]
        spans = [(offset, length, pool.slot(_request_id(seq), starting=seq.num_computed_tokens == 0))
                 for seq, offset, length in chunks]
        return StateMeta(torch.tensor(decode, dtype=torch.long, device=self.device), spans)

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        # slots of positions [start, end) of a request
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    @property
    def pads_decode(self) -> bool:
        """Whether decode attention pads to the longest context (the torch path): then group."""
        # a hybrid's first layer may be a state layer: ask the first attention layer
        attn = next((layer.self_attn for layer in self.model.layers if getattr(layer, "self_attn", None) is not None),
                    None)
        return attn.backend.pads_decode if attn is not None else True

    def _decode_groups(self, context_lens: list[int]) -> list[tuple[int, int]]:
        if self.pads_decode:
            return group_by_context(context_lens, self.block_size)
        # the native kernel reads only each request's own blocks: one group, no padding cost
        return [(0, len(context_lens))] if context_lens else []

    def execute(self, scheduled: list[tuple[ScheduledRow, int]]) -> StepResult:
        """Run one step. Returns the requests that get a new token, the logits [S + P, vocab] (S rows
        for them, then P rows of prompt positions whose logprobs were asked for), which request
        and positions those P rows are (in order), and for pooling requests the final-norm hidden
        states of their chunks' pooled rows (they are never sampled).

        Decode queries come first, reordered by context length so that queries of similar length
        form one padded attention group: one per decode request (one new token each), and one per
        verified position of a speculating request (its last token and each proposal, whose logits
        are the V rows between the sampled and the prompt ones: a verify step is a decode step of
        more rows, through the same kernels, so its logits are the ones plain decode steps give
        wherever the kernels are row-invariant). Prefill chunks follow (a pooling request's last
        chunk of one token too: it is no decode step).
        """
        bs, device = self.block_size, self.device
        # one query row per decode request, and per verified position of a speculating request
        # (its last token, then each proposal: position p attends 0..p, exactly as a plain decode
        # step at p would, through the same kernels: the verify logits are the decode logits)
        rows = [_QueryRow(seq, seq.num_computed_tokens, seq.token_ids[seq.num_computed_tokens], sampled=True)
                for seq, n in scheduled if n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens
                and seq.pool is None]
        verify = [(seq, n) for seq, n in scheduled if seq.spec_token_ids]
        verify_seqs = [seq for seq, _ in verify]
        if verify_seqs and self.state_pool is not None:
            raise ValueError("speculative decoding is not supported for models with state layers")
        for seq, n in verify:
            start = seq.num_computed_tokens
            assert n == 1 + len(seq.spec_token_ids) and start + 1 == seq.num_tokens
            rows += [_QueryRow(seq, start + j, token, sampled=False)
                     for j, token in enumerate([seq.token_ids[start], *seq.spec_token_ids])]
        rows.sort(key=lambda r: r.position)
        row_ids = {id(r.seq) for r in rows}
        chunks = [(seq, n) for seq, n in scheduled if id(seq) not in row_ids]
        input_ids = [r.token for r in rows]
        positions = [r.position for r in rows]
        slots = [r.seq.block_table[r.position // bs] * bs + r.position % bs for r in rows]
        logits_indices = [i for i, r in enumerate(rows) if r.sampled]
        sample_seqs = [r.seq for r in rows if r.sampled]
        at = {(id(r.seq), r.position): i for i, r in enumerate(rows)}
        verify_indices = [at[(id(seq), seq.num_computed_tokens + j)]
                          for seq in verify_seqs for j in range(1 + len(seq.spec_token_ids))]
        prompt_rows: list[PromptRows] = []
        prompt_indices: list[int] = []
        pool_rows: list[PoolRows] = []
        hidden_indices: list[int] = []
        groups = []
        context_lens = [r.position + 1 for r in rows]
        for start, count in self._decode_groups(context_lens):
            members = rows[start:start + count]
            num_blocks = -(-(members[-1].position + 1) // bs)
            block_ids = []
            for row in members:
                table = row.seq.block_table[:num_blocks]
                block_ids.extend(table)
                block_ids.extend([0] * (num_blocks - len(table)))  # padding -> reserved block 0
            lengths = torch.tensor(context_lens[start:start + count], dtype=torch.long)
            bias = mask = None
            if self.pads_decode:
                mask = torch.arange(num_blocks * bs).unsqueeze(0) < lengths.unsqueeze(1)  # [count, L]
                bias = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
                bias, mask = bias.view(1, count, 1, -1).to(device), mask.view(count, 1, 1, -1).to(device)
            block_ids_t = torch.tensor(block_ids, dtype=torch.long, device=device)
            groups.append(DecodeGroup(start, count, num_blocks, block_ids_t, lengths.to(device), bias, mask))
        prefills: list[PrefillSpan] = []
        state_chunks: list[tuple[ScheduledRow, int, int]] = []
        for seq, num_new in chunks:
            start = seq.num_computed_tokens
            end = start + num_new
            offset = len(input_ids)
            state_chunks.append((seq, offset, num_new))
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slots(seq.block_table, start, end))
            if start == 0:
                gather, mask = None, None  # plain causal attention over the chunk itself
            else:
                gather = torch.tensor(self._slots(seq.block_table, 0, end), dtype=torch.long, device=device)
                # query i sits at position start + i and sees keys 0 .. start + i
                mask = (torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1))
                mask = mask.view(1, 1, num_new, end).to(device)
            table = torch.tensor(seq.block_table[:-(-end // bs)], dtype=torch.long, device=device)
            prefills.append(PrefillSpan(offset, num_new, end, gather, mask, block_ids=table, block_size=bs))
            if seq.sampling_params.prompt_logprobs is not None:
                # the logits at position p score the prompt token at p + 1
                count = min(end, seq.num_prompt_tokens - 1) - start
                if count > 0:
                    prompt_rows.append(PromptRows(seq, start, count))
                    prompt_indices.extend(range(offset, offset + count))
            if seq.pool is not None:
                pooled = seq.pool.positions(start, end)
                pool_rows.append(PoolRows(seq, len(pooled)))
                hidden_indices.extend(offset + p - start for p in pooled)
            elif end == seq.num_tokens:  # computed: its next token is due
                logits_indices.append(offset + num_new - 1)
                sample_seqs.append(seq)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            decode_groups=groups,
            prefills=prefills,
            block_size=bs,
        )
        # a hybrid's rows continue from their state slots (decode rows come first in the batch)
        state = ({"state": (self.state_pool, self._state_meta([r.seq for r in rows], state_chunks))}
                 if self.state_pool is not None else {})
        out = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            self.kv_cache,
            meta,
            torch.tensor(logits_indices + verify_indices + prompt_indices, dtype=torch.long, device=device),
            max(positions),
            torch.tensor(hidden_indices, dtype=torch.long, device=device) if pool_rows else None,
            **state,
        )
        logits, hidden = out if pool_rows else (out, None)
        return StepResult(sample_seqs, logits, prompt_rows, pool_rows, hidden, verify_seqs)

    # --- moving blocks in and out (the disaggregated workers hand KV through the store) ---

    @property
    def block_shape(self) -> list[int]:
        """One block's logical shape in the store's format, as `read_block` gives and `write_block`
        takes it (a quantized cache's rows carry 4 scale bytes more: `kvstore.codec.logical_shape`)."""
        return [len(self.config.attention_layers), 2, self.block_size, self.config.num_kv_heads, self.config.head_dim]

    def read_block(self, block: int) -> torch.Tensor:
        """A block's KV in the store's format: [layers, 2, block_size, kv_heads, head_dim (+ 4 when
        quantized)] in the cache's dtype (a copy, on the CPU; the cache itself is head-major)."""
        s = block * self.block_size
        rows = as_bytes(self.kv_cache)[:, :, :, s:s + self.block_size].transpose(2, 3)
        return rows.to("cpu", copy=True).contiguous().view(self.kv_dtype)

    def write_block(self, block: int, data: torch.Tensor) -> None:
        # data: [layers, 2, block_size, kv_heads, head_dim (+ 4)] in any cache format (converted)
        s = block * self.block_size
        rows = convert_rows(data.to(self.device), self.kv_dtype)
        as_bytes(self.kv_cache)[:, :, :, s:s + self.block_size] = as_bytes(rows).transpose(2, 3)
