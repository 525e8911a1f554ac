"""A GGUF's token tables served as the file's own rows, as llama.cpp's `get_rows` reads them.

An embedding lookup reads one row per token, so a table needs no copy of its own: the rows are
read from the file's read-only map (the page cache's pages, one copy per machine whatever the
number of workers, and only the rows of tokens seen ever resident) and dequantized per lookup, in
the model's dtype. Before, each table was dequantized at load into the model's dtype and shared as
that copy (`baton.model.shared_weights`): Gemma 4 E2B's per-layer table (262,144 x 8,960) is 2.5 GB
in the Q8_0 file and was 4.7 GB in bf16, 9.4 GB in float32 (`--dtype auto` on a CPU without bf16
instructions, AMD Zen 3), and a Llama 3 8B Q4_K_M file's untied 0.3 GB input table 2.1 GB.

Which tables: every token table the loader would fill (the input embedding where the head is not
tied to it: a tied head's quantized blocks serve its lookups already, `CausalLM._embed_from_head`;
Gemma 4's per-layer embeddings), whatever the tensor's type; the loader leaves them unread
(`gguf_embedding_targets`). The values are the loader's exactly: the same dequantization (fp32)
rounded to the model's dtype, where transformers' conversion keeps the rows in order and unchanged
(else the table is read as before).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import nn

logger = logging.getLogger("baton.model.gguf_embeddings")

# a Baton table -> the Hugging Face module name the file's tensor map knows it by
TABLES = {"embed_tokens": "model.embed_tokens", "embed_tokens_per_layer": "model.embed_tokens_per_layer"}
Q8_0_BLOCK = 34  # bytes: an fp16 scale and 32 int8


class GGUFRowsEmbedding(nn.Module):
    """nn.Embedding's lookup over a GGUF tensor's rows ([num_embeddings, row bytes] of the file's map).
    `weight` is an empty parameter of the model's dtype and device (what the model reads of a table's
    dtype); the rows are the only data."""

    def __init__(self, rows: np.ndarray, tensor_type: Any, num_embeddings: int, embedding_dim: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        assert rows.shape[0] == num_embeddings, (rows.shape, num_embeddings)
        self.rows, self.tensor_type = rows, tensor_type
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.type_name: str = tensor_type.name
        self.weight = nn.Parameter(torch.empty(0, embedding_dim, dtype=dtype), requires_grad=False)

    @property
    def file_bytes(self) -> int:
        return int(self.rows.nbytes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, embedding_dim] in the model's dtype
        ids = input_ids.cpu().numpy()
        if ids.size == 0:
            return torch.empty(0, self.embedding_dim, dtype=self.weight.dtype)
        if ids.min() < 0 or ids.max() >= self.num_embeddings:
            raise IndexError(f"token id out of range for a {self.num_embeddings}-row table")
        return self.dequantized(np.asarray(self.rows[ids])).to(self.weight.dtype)

    def dequantized(self, raw: np.ndarray) -> torch.Tensor:
        """Rows of the tensor as stored ([T, row bytes], or [T, dim] for a dense type) -> fp32 [T, dim],
        the values `gguf.quants.dequantize` gives (the loader's)."""
        t = raw.shape[0]
        if self.type_name == "Q8_0":  # the common case, in torch (multithreaded): d * q per block of 32
            blocks = torch.from_numpy(raw).reshape(t, self.embedding_dim // 32, Q8_0_BLOCK)
            scale = blocks[..., :2].contiguous().view(torch.float16).float()
            q = blocks[..., 2:].contiguous().view(torch.int8).float()
            return (scale * q).reshape(t, self.embedding_dim)
        from gguf.quants import dequantize

        return torch.from_numpy(np.ascontiguousarray(dequantize(raw, self.tensor_type), dtype=np.float32)
                                ).reshape(t, self.embedding_dim)


def _tables(model: nn.Module) -> list[tuple[str, nn.Embedding]]:
    """The model's token tables the file's rows can serve: not a tied head's (its op serves those)."""
    head = getattr(model, "lm_head", None)
    out = []
    for name in TABLES:
        module = getattr(model, name, None)
        if isinstance(module, nn.Embedding) and (head is None or head.weight is not module.weight):
            out.append((name, module))
    return out


def _stored_rows(source: Any, hf_name: str, shape: tuple[int, int]) -> np.ndarray | None:
    """The file's rows of the tensor `hf_name` maps to, where transformers' conversion reads them in
    order and unchanged as a [num_embeddings, embedding_dim] table; None otherwise."""
    tensor = source.find(hf_name)
    if tensor is None or source.shape(tensor) != shape or not source.servable(tensor):
        return None
    if source.input_order(tensor) is not None:
        return None
    order = source.row_order(tensor)
    if not np.array_equal(order, np.arange(shape[0])):
        return None
    return np.asarray(tensor.data).reshape(shape[0], -1)


def gguf_embedding_targets(model: nn.Module, source: Any) -> set[str]:
    """The parameters of the tables the file's rows will serve, which the loader leaves unread."""
    return {f"{name}.weight" for name, module in _tables(model)
            if _stored_rows(source, TABLES[name], (module.num_embeddings, module.embedding_dim)) is not None}


def load_gguf_embeddings(model: nn.Module, source: Any, dtype: torch.dtype) -> int:
    """Replace each table `gguf_embedding_targets` named by a `GGUFRowsEmbedding` over the file's rows.
    Returns the bytes of the file's rows they serve."""
    served = 0
    for name, module in _tables(model):
        if not module.weight.is_meta:  # read by the loader (not a target): kept
            continue
        tensor = source.find(TABLES[name])
        rows = _stored_rows(source, TABLES[name], (module.num_embeddings, module.embedding_dim))
        assert tensor is not None and rows is not None, f"{name} was left unread but the file cannot serve it"
        table = GGUFRowsEmbedding(rows, tensor.tensor_type, module.num_embeddings, module.embedding_dim, dtype)
        setattr(model, name, table)
        served += table.file_bytes
        logger.info("GGUF %s: %s served as the file's %s rows (%.0f MB, mapped: not copied per worker)",
                    source.path.name, name, table.type_name, table.file_bytes / 1e6)
    return served
