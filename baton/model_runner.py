"""Turns a `SchedulerOutput` into tensors, runs the model over the paged KV cache, returns logits."""

from __future__ import annotations

import torch

from baton.config import ModelConfig
from baton.model import AttentionMetadata, LlamaModel, PrefillSpan
from baton.sequence import Sequence


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(self, model: LlamaModel, config: ModelConfig, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        # [layers, k/v, slots, kv_heads, head_dim]; slot = block * block_size + offset
        self.kv_cache = torch.zeros(
            config.num_layers, 2, num_blocks * block_size, config.num_kv_heads, config.head_dim,
            dtype=self.dtype, device=self.device,
        )

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        # slots of positions [start, end) of a request: [end - start]
        positions = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def execute(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor]:
        """Run one step. Returns the requests that get a new token and their logits [S, vocab]."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        logits_indices: list[int] = []
        sample_seqs: list[Sequence] = []
        decode_seqs: list[Sequence] = []
        prefills: list[PrefillSpan] = []
        for seq, num_new in scheduled:
            start = seq.num_computed_tokens
            end = start + num_new
            offset = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.append(torch.arange(start, end))
            slots.append(self._slots(seq.block_table, start, end))
            if num_new == 1:
                decode_seqs.append(seq)
            else:
                if start == 0:
                    gather, mask = None, None  # plain causal attention over the chunk itself
                else:
                    gather = self._slots(seq.block_table, 0, end)
                    # query i sits at position start + i and sees keys 0 .. start + i
                    mask = (torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1))
                    mask = mask.view(1, 1, num_new, end).to(self.device)
                    gather = gather.to(self.device)
                prefills.append(PrefillSpan(offset, num_new, end, gather, mask))
            if end == seq.num_tokens:  # the whole sequence is computed: its next token is due
                logits_indices.append(offset + num_new - 1)
                sample_seqs.append(seq)
        num_decode = len(decode_seqs)
        assert all(n == 1 for _, n in scheduled[:num_decode]), "decode tokens must come first"
        decode_gather = decode_mask = None
        if num_decode:
            context_lens = torch.tensor([s.num_computed_tokens + 1 for s in decode_seqs])
            max_len = int(context_lens.max())
            max_blocks = -(-max_len // bs)
            tables = torch.zeros(num_decode, max_blocks, dtype=torch.long)  # padding -> block 0
            for row, seq in enumerate(decode_seqs):
                table = seq.block_table[:max_blocks]
                tables[row, :len(table)] = torch.tensor(table, dtype=torch.long)
            pos = torch.arange(max_len)
            decode_gather = (tables[:, pos // bs] * bs + pos % bs).to(self.device)  # [Bd, L]
            decode_mask = (pos.unsqueeze(0) < context_lens.unsqueeze(1)).view(num_decode, 1, 1, max_len).to(self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(self.device),
            num_decode_tokens=num_decode,
            decode_gather=decode_gather,
            decode_mask=decode_mask,
            prefills=prefills,
        )
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.cat(positions).to(self.device),
            self.kv_cache,
            meta,
            torch.tensor(logits_indices, dtype=torch.long, device=self.device),
        )
        return sample_seqs, logits

    # --- moving blocks in and out (the disaggregated workers hand KV through the store) ---

    def read_block(self, block: int) -> torch.Tensor:
        """A block's KV: [layers, 2, block_size, kv_heads, head_dim] (a copy, on the CPU)."""
        s = block * self.block_size
        return self.kv_cache[:, :, s:s + self.block_size].to("cpu", copy=True)

    def write_block(self, block: int, data: torch.Tensor) -> None:
        s = block * self.block_size
        self.kv_cache[:, :, s:s + self.block_size] = data.to(self.device, self.dtype)
