"""Turns a step's scheduled rows into tensors, runs the model over the paged KV cache, returns logits.

A step arrives as plain rows (`baton.model.step_batch`): the model layer never sees the engine's
requests."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from baton.model.config import ModelConfig
from baton.model.attention import AttentionMetadata, DecodeGroup, PrefillSpan, group_by_context
from baton.model import layer_cache
from baton.model.kv_groups import kv_groups, one_table as one_table_of
from baton.model.kv_quant import as_bytes, convert_rows, row_width
from baton.model.gated_deltanet import DecodeStep, StateMeta, StatePool
from baton.model.short_conv import state_dims
from baton.model.model import CausalLM
from baton.model.step_batch import RowKind, StepBatch, StepRow

NULL_BLOCK = 0  # the pool's reserved block (baton.engine.window_blocks): never read out or written


@dataclass
class PromptRows:
    """Logits rows of positions [start, start + count) of a request's prompt (for prompt logprobs)."""

    request_id: str
    start: int
    count: int


@dataclass
class PoolRows:
    """How many hidden-state rows of a pooling request this step returns (its chunk's pooled ones)."""

    request_id: str
    count: int


@dataclass
class _QueryRow:
    """One decode-kernel query of a step: a request's token at `position` (sampled: a DECODE row,
    whose logits are sampled; else a position of a VERIFY row)."""

    row: StepRow
    position: int
    token: int
    sampled: bool


@dataclass
class StepResult:
    """What one step of the model gave: see `ModelRunner.execute`."""

    sampled: list[str]  # request ids whose next token is sampled: the first S logits rows, in order
    logits: torch.Tensor  # [S + V + P, vocab]
    prompt_rows: list[PromptRows]
    pool_rows: list[PoolRows]
    hidden: torch.Tensor | None  # [sum of pool_rows counts, hidden] fp32, None without pooling rows
    # VERIFY rows' request ids, each with len(tokens) logits rows after the S sampled ones (V rows
    # in all), one per verified position
    verified: list[str] = field(default_factory=list)
    # with `StepBatch.hidden_states`: each row's final hidden states [len(tokens), hidden], its tokens'
    # positions in order (the final norm's output; an MTP head's own as its next chained step reads
    # them: baton.model.mtp)
    row_hidden: dict[str, torch.Tensor] = field(default_factory=dict)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, one_table: bool = False) -> int:
    """Bytes of one block of the KV cache in `dtype` (a quantized format: codes and scales);
    `one_table`: every cached layer in one table, whatever `kv_groups` says (a draft model's cache)."""
    # only attention layers keep KV per token (a hybrid's state layers keep a slot per request: `StatePool`)
    if config.layer_head_dim:  # per-layer shapes (Gemma 4), packed without padding
        return layer_cache.bytes_per_block(config, block_size, dtype)
    row_bytes = row_width(config.head_dim, dtype) * dtype.itemsize
    # a block holds one group of layers (all cached layers but where window layers have tables of
    # their own: baton.model.kv_groups)
    layers = len(config.attention_layers) if one_table else kv_groups(config).group_size
    return layers * 2 * block_size * config.num_kv_heads * row_bytes


class ModelRunner:
    def __init__(self, model: CausalLM, config: ModelConfig, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype | None = None, max_num_seqs: int = 0, one_table: bool = False) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.kv_dtype = kv_dtype or self.dtype  # int8 / fp8: quantized rows (baton.model.kv_quant)
        # [layers, k/v, kv_heads, slots, head_dim (+ 4 scale bytes when quantized)]; slot = block *
        # block_size + offset (head-major: see baton.model.attention). With window tables
        # (kv_groups) `layers` is the group size: each table's layer at position j reads tensor j.
        # one_table: a draft model's cache, indexed by the target's global table whatever its layers
        self.groups = one_table_of(len(config.attention_layers)) if one_table else kv_groups(config)
        self.kv_cache = torch.zeros(
            self.groups.group_size, 2, config.num_kv_heads, num_blocks * block_size,
            row_width(config.head_dim, self.kv_dtype), dtype=torch.uint8 if self.kv_dtype.itemsize == 1 else self.kv_dtype,
            device=self.device,
        ).view(self.kv_dtype) if not config.layer_head_dim else (
            # per-layer shapes (Gemma 4): one flat tensor, each cached layer packed (baton.model.layer_cache)
            layer_cache.allocate(config, num_blocks * block_size, self.kv_dtype, self.device))
        # what the model's forward zips with its layers: each layer's tensor of the cache
        self.layer_caches: torch.Tensor | list[torch.Tensor] = (
            [self.kv_cache[j] for j in self.groups.position_of] if self.groups.grouped else self.kv_cache)
        # a hybrid's state layers: one slot per running request (the scheduler runs at most
        # max_num_seqs), assigned on first sight, released by the engine (`release_state`)
        self.state_pool: StatePool | None = None
        if config.has_state_layers:
            self.state_pool = StatePool(state_dims(config.deltanet), sum(config.layer_deltanet),
                                        max(1, max_num_seqs), self.dtype, self.device)
        # a verify step's scratch state slots per request, until `keep_verified` (speculative decoding)
        self._scratch: dict[str, list[int]] = {}

    def read_state(self, request_id: str) -> dict[str, torch.Tensor]:
        assert self.state_pool is not None
        return self.state_pool.read(request_id)

    def write_state(self, request_id: str, tensors: dict[str, torch.Tensor]) -> None:
        assert self.state_pool is not None
        self.state_pool.write(request_id, tensors)

    def has_state(self, request_id: str) -> bool:
        return self.state_pool is not None and request_id in self.state_pool.owner

    def release_state(self, request_id: str) -> None:
        """A request finished, was aborted or preempted: its state slot is free (recompute rebuilds it)."""
        if self.state_pool is not None:
            self.state_pool.release(request_id, self._scratch.pop(request_id, ()))

    @property
    def free_state_slots(self) -> int:
        return self.state_pool.num_free if self.state_pool is not None else 0

    def _state_meta(self, queries: list[_QueryRow], chunks: list[tuple[StepRow, int]]) -> StateMeta:
        # queries: the step's one-token rows (first in the flattened batch); chunks: (row, its first token's index)
        pool = self.state_pool
        assert pool is not None
        decode = [pool.slot(q.row.request_id, starting=q.row.start == 0) for q in queries]
        spans = [(offset, len(row.tokens), pool.slot(row.request_id, starting=row.start == 0))
                 for row, offset in chunks]
        as_tensor = functools.partial(torch.tensor, dtype=torch.long, device=self.device)
        if all(q.sampled for q in queries):
            # consecutive decode slots (the common case: slots are handed out in order) are advanced in
            # place as one slice of each layer's pool: found once here, not per layer (slot_rows)
            first = decode[0] if decode and decode == list(range(decode[0], decode[0] + len(decode))) else None
            return StateMeta(as_tensor(decode), spans, first)
        # verify rows: step j runs every row's j-th token; after step j < k a verify row's state is
        # copied into its scratch slot j (`keep_verified` keeps the one its accepted tokens reach)
        by_step: dict[int, list[int]] = {}
        for i, q in enumerate(queries):
            by_step.setdefault(q.position - q.row.start, []).append(i)
        for q in queries:
            if not q.sampled and q.position == q.row.start:
                self._scratch[q.row.request_id] = pool.take_scratch(len(q.row.tokens) - 1)
        steps = []
        for j in sorted(by_step):
            rows = by_step[j]
            saved = [(decode[i], self._scratch[queries[i].row.request_id][j]) for i in rows
                     if not queries[i].sampled and j < len(queries[i].row.tokens) - 1]
            copies = (as_tensor([own for own, _ in saved]), as_tensor([to for _, to in saved])) if saved else None
            steps.append(DecodeStep(as_tensor(rows), as_tensor([decode[i] for i in rows]), None, copies))
        return StateMeta(as_tensor(decode), spans, None, steps)

    def keep_verified(self, request_id: str, accepted: int) -> None:
        """After a verify step: the request's state layers continue from the state after its last token
        and its first `accepted` proposals (the scratch slots of the others are free again)."""
        assert self.state_pool is not None
        self.state_pool.keep(request_id, self._scratch.pop(request_id), accepted)

    def _slots(self, block_table: Sequence[int], start: int, end: int) -> list[int]:
        # slots of positions [start, end) of a request
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    @property
    def pads_decode(self) -> bool:
        """Whether decode attention pads to the longest context (the torch path): then group."""
        # any attention layer on the torch path needs the padded groups' masks (a hybrid's state
        # layers have none; Gemma 3's window layers pad where its global layers attend natively)
        backends = [layer.self_attn.backend for layer in self.model.layers
                    if getattr(layer, "self_attn", None) is not None]
        return not backends or any(backend.pads_decode for backend in backends)

    def _decode_groups(self, context_lens: list[int]) -> list[tuple[int, int]]:
        if self.pads_decode:
            return group_by_context(context_lens, self.block_size)
        # the native kernel reads only each request's own blocks: one group, no padding cost
        return [(0, len(context_lens))] if context_lens else []

    def _decode_attention(self, rows: list[_QueryRow]) -> list[DecodeGroup]:
        """The decode queries' attention groups (rows sorted by position): each group's block tables,
        padded to its longest with the reserved block 0, and on the torch path its masks."""
        bs, device = self.block_size, self.device
        groups = []
        context_lens = [r.position + 1 for r in rows]
        for start, count in self._decode_groups(context_lens):
            members = rows[start:start + count]
            num_blocks = -(-(members[-1].position + 1) // bs)
            block_ids = []
            for query in members:
                table = query.row.block_table[:num_blocks]
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
        return groups

    def _prefill_span(self, row: StepRow, offset: int) -> PrefillSpan:
        """A CHUNK row's attention: its tokens at `offset` of the flattened batch see the request's
        positions 0 .. their own."""
        bs, device = self.block_size, self.device
        start, end, num_new = row.start, row.end, len(row.tokens)
        if start == 0:
            gather, mask = None, None  # plain causal attention over the chunk itself
        else:
            gather = torch.tensor(self._slots(row.block_table, 0, end), dtype=torch.long, device=device)
            # query i sits at position start + i and sees keys 0 .. start + i
            mask = (torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1))
            mask = mask.view(1, 1, num_new, end).to(device)
        table = torch.tensor(row.block_table[:-(-end // bs)], dtype=torch.long, device=device)
        return PrefillSpan(offset, num_new, end, gather, mask, block_ids=table, block_size=bs)

    def execute(self, batch: StepBatch) -> StepResult:
        """Run one step. Returns the requests that get a new token, the logits [S + V + P, vocab] (S rows
        for them, V for the verified positions, then P rows of prompt positions whose logprobs were
        asked for), which request and positions those P rows are (in order), and for pooling
        requests the final-norm hidden states of their chunks' pooled rows (they are never sampled).

        Decode queries come first, reordered by context length so that queries of similar length
        form one padded attention group: one per DECODE row, and one per position of a VERIFY row
        (its last token and each proposal, whose logits are the V rows between the sampled and the
        prompt ones: a verify step is a decode step of more rows, through the same kernels, so its
        logits are the ones plain decode steps give wherever the kernels are row-invariant). CHUNK
        rows follow (a pooling request's last chunk of one token too: it is no decode step).
        """
        bs, device = self.block_size, self.device
        # position p of a VERIFY row attends 0..p, exactly as a plain decode step at p would
        rows = [_QueryRow(row, row.start, row.tokens[0], sampled=True) for row in batch.rows if row.kind is RowKind.DECODE]
        verify = [row for row in batch.rows if row.kind is RowKind.VERIFY]
        for row in verify:
            rows += [_QueryRow(row, row.start + j, token, sampled=False) for j, token in enumerate(row.tokens)]
        rows.sort(key=lambda r: r.position)
        chunks = [row for row in batch.rows if row.kind is RowKind.CHUNK]
        input_ids = [r.token for r in rows]
        positions = [r.position for r in rows]
        slots = [r.row.block_table[r.position // bs] * bs + r.position % bs for r in rows]
        logits_indices = [i for i, r in enumerate(rows) if r.sampled]
        sampled = [r.row.request_id for r in rows if r.sampled]
        at = {(r.row.request_id, r.position): i for i, r in enumerate(rows)}
        verify_indices = [at[(row.request_id, p)] for row in verify for p in range(row.start, row.end)]
        prompt_rows: list[PromptRows] = []
        prompt_indices: list[int] = []
        pool_rows: list[PoolRows] = []
        hidden_indices: list[int] = []
        groups = self._decode_attention(rows)
        prefills: list[PrefillSpan] = []
        state_chunks: list[tuple[StepRow, int]] = []
        chunk_offsets: dict[str, int] = {}
        for row in chunks:
            start, end, num_new = row.start, row.end, len(row.tokens)
            offset = len(input_ids)
            chunk_offsets[row.request_id] = offset
            state_chunks.append((row, offset))
            input_ids.extend(row.tokens)
            positions.extend(range(start, end))
            slots.extend(self._slots(row.block_table, start, end))
            prefills.append(self._prefill_span(row, offset))
            if row.prompt_logprob_rows:
                prompt_rows.append(PromptRows(row.request_id, start, row.prompt_logprob_rows))
                prompt_indices.extend(range(offset, offset + row.prompt_logprob_rows))
            if row.pooled is not None:
                pool_rows.append(PoolRows(row.request_id, len(row.pooled)))
                hidden_indices.extend(offset + p - start for p in row.pooled)
            elif row.sample:  # computed: its next token is due
                logits_indices.append(offset + num_new - 1)
                sampled.append(row.request_id)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            decode_groups=groups,
            prefills=prefills,
            block_size=bs,
        )
        # a hybrid's rows continue from their state slots (decode rows come first in the batch)
        state: dict[str, Any] = ({"state": (self.state_pool, self._state_meta(rows, state_chunks))}
                                 if self.state_pool is not None else {})
        if batch.rows and batch.rows[0].hidden is not None:  # a multi-token-prediction head's input
            state["input_hidden"] = torch.cat([r.row.hidden[r.position - r.row.start:r.position - r.row.start + 1]
                                               for r in rows] + [row.hidden for row in chunks])
        # every row's tokens, in position order, as rows of the step (StepBatch.hidden_states)
        row_spans = ([(row.request_id, [at[(row.request_id, p)] for p in range(row.start, row.end)]
                       if row.kind is not RowKind.CHUNK else list(range(chunk_offsets[row.request_id],
                                                                        chunk_offsets[row.request_id] + len(row.tokens))))
                      for row in batch.rows] if batch.hidden_states else [])
        for _, indices in row_spans:
            hidden_indices.extend(indices)
        if self.groups.grouped:  # the window tables' own slots and blocks, the same masks
            state["window_metas"] = [self._retarget(meta, rows, chunks, t)
                                     for t in range(self.groups.num_window_tables)]
        out = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            self.layer_caches,
            meta,
            torch.tensor(logits_indices + verify_indices + prompt_indices, dtype=torch.long, device=device),
            max(positions),
            torch.tensor(hidden_indices, dtype=torch.long, device=device) if hidden_indices else None,
            **state,
        )
        logits, hidden = out if hidden_indices else (out, None)
        row_hidden: dict[str, torch.Tensor] = {}
        if row_spans:
            assert hidden is not None
            at_row = len(hidden_indices) - sum(len(indices) for _, indices in row_spans)  # after the pooled rows
            for request_id, indices in row_spans:
                row_hidden[request_id] = hidden[at_row:at_row + len(indices)]
                at_row += len(indices)
            hidden = hidden[:len(hidden_indices) - sum(len(indices) for _, indices in row_spans)] if pool_rows else None
        return StepResult(sampled, logits, prompt_rows, pool_rows, hidden, [row.request_id for row in verify],
                          row_hidden)

    def _retarget(self, meta: AttentionMetadata, rows: list[_QueryRow], chunks: list[StepRow],
                  table: int) -> AttentionMetadata:
        """`meta` for window table `table` (0-based) of every row: its slots and blocks, the same
        groups, spans and masks (the tables index positions alike)."""
        bs, device = self.block_size, self.device
        slots = [r.row.window_tables[table][r.position // bs] * bs + r.position % bs for r in rows]
        for row in chunks:
            slots.extend(self._slots(row.window_tables[table], row.start, row.end))
        groups = []
        for group in meta.decode_groups:
            block_ids = []
            for query in rows[group.start:group.start + group.count]:
                ids = query.row.window_tables[table][:group.num_blocks]
                block_ids.extend(ids)
                block_ids.extend([0] * (group.num_blocks - len(ids)))
            groups.append(replace(group, block_ids=torch.tensor(block_ids, dtype=torch.long, device=device)))
        spans = []
        for span, row in zip(meta.prefills, chunks):
            ids = row.window_tables[table]
            gather = (None if span.gather_slots is None else
                      torch.tensor(self._slots(ids, 0, row.end), dtype=torch.long, device=device))
            spans.append(replace(span, gather_slots=gather,
                                 block_ids=torch.tensor(ids[:-(-row.end // bs)], dtype=torch.long, device=device)))
        return replace(meta, slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
                       decode_groups=groups, prefills=spans)

    # --- moving blocks in and out (the disaggregated workers hand KV through the store) ---

    @property
    def block_shape(self) -> list[int]:
        """One block's logical shape in the store's format, as `read_block` gives and `write_block`
        takes it (a quantized cache's rows carry 4 scale bytes more: `kvstore.codec.logical_shape`)."""
        return [len(self.config.attention_layers), 2, self.block_size, self.config.num_kv_heads, self.config.head_dim]

    def read_block(self, block: int | tuple[int, ...]) -> torch.Tensor:
        """A block's KV in the store's format: [layers, 2, block_size, kv_heads, head_dim (+ 4 when
        quantized)] in the cache's dtype (a copy, on the CPU; the cache itself is head-major).
        `block`: its id, or with window tables (kv_groups) each table's id of the position block."""
        if self.groups.grouped:
            rows = self._grouped_rows(block)
            return torch.stack([as_bytes(r) for r in rows]).transpose(2, 3).to("cpu", copy=True).contiguous(
                ).view(self.kv_dtype)
        block = self._table_ids(block)[0]
        s = block * self.block_size
        if self.config.layer_head_dim:  # per-layer shapes (Gemma 4), packed: the uniform form out
            return layer_cache.read_block(self.kv_cache, self.config, s, self.block_size)
        rows = as_bytes(self.kv_cache)[:, :, :, s:s + self.block_size].transpose(2, 3)
        return rows.to("cpu", copy=True).contiguous().view(self.kv_dtype)

    def write_block(self, block: int | tuple[int, ...], data: torch.Tensor) -> None:
        # data: [layers, 2, block_size, kv_heads, head_dim (+ 4)] in any cache format (converted)
        if self.groups.grouped:
            targets = self._grouped_rows(block)
            rows = as_bytes(convert_rows(data.to(self.device), self.kv_dtype)).transpose(2, 3)
            for layer, target in enumerate(targets):
                as_bytes(target)[...] = rows[layer]
            return
        block = self._table_ids(block)[0]
        s = block * self.block_size
        if self.config.layer_head_dim:  # per-layer shapes (Gemma 4), packed
            layer_cache.write_block(self.kv_cache, self.config, s, self.block_size, data)
            return
        rows = convert_rows(data.to(self.device), self.kv_dtype)
        as_bytes(self.kv_cache)[:, :, :, s:s + self.block_size] = as_bytes(rows).transpose(2, 3)

    def clear_block(self, block: int) -> None:
        """Zero every layer's K and V of one block (one table, the plain layout: a draft's cache)."""
        assert not self.groups.grouped and not self.config.layer_head_dim
        s = block * self.block_size
        as_bytes(self.kv_cache)[:, :, :, s:s + self.block_size] = 0

    def _grouped_rows(self, block: int | tuple[int, ...]) -> list[torch.Tensor]:
        # each cached layer's [2, kv_heads, block_size, row] slots of the position block whose
        # table ids are `block` (a view into the cache)
        ids, bs = self._table_ids(block), self.block_size
        assert NULL_BLOCK not in ids, f"a released entry holds no KV: {ids}"
        return [view[:, :, ids[t] * bs:(ids[t] + 1) * bs] for view, t in zip(self.layer_caches, self.groups.table_of)]

    def _table_ids(self, block: int | tuple[int, ...]) -> tuple[int, ...]:
        ids = (block,) if isinstance(block, int) else tuple(block)
        assert len(ids) == self.groups.num_tables, f"a position block has {self.groups.num_tables} table ids, got {ids}"
        return ids
