"""A GGUF whose architecture transformers reads through its own weight-conversion mapping (Qwen3.5).

transformers has two GGUF readers. The older one (`modeling_gguf_pytorch_utils`: a name table from the
`gguf` package, then a `TensorProcessor` per architecture) is what `baton.model.gguf_checkpoint` follows
for Llama, Qwen2/3, Gemma, Phi and the rest. The newer one (`transformers.integrations.gguf`) describes
an architecture as a list of `WeightRenaming`s and `WeightConverter`s, the same objects that load
safetensors checkpoints, and is the only one that knows Qwen3.5 (`qwen35`, `qwen35moe`): llama.cpp's
converter stores that family's norms as `w + 1`, `A_log` as `-exp(A_log)`, the conv kernel squeezed,
`dt_bias` under another name, and the linear-attention value heads tiled instead of grouped (its
`_LinearAttentionVReorderBase`), each undone by one of those converters.

Here that mapping is applied one parameter at a time, as the loader asks for it: the GGUF tensor is
dequantized to fp32 (`gguf.dequantize`), then the converter's operations run on it (the renamings give
the name). The result is what `from_pretrained(..., gguf_file=...)` gives, tensor for tensor, without
reading the whole file at once. The multi-token-prediction block is named `mtp.*`, as in a safetensors
checkpoint, where the loader's named rule skips it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch


def uses_conversion_mapping(arch: str) -> bool:
    """Whether transformers reads `arch` (a GGUF `general.architecture`) only through its conversion
    mapping: the architectures its older reader does not know (LFM2 it knows both ways: the older)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.integrations.gguf import GGUF_ARCHS

    return arch in GGUF_ARCHS and arch not in GGUF_CONFIG_MAPPING


class SourcedTensors(Mapping[str, torch.Tensor]):
    """A checkpoint view whose names are the keys of `_sources` (how each tensor is made on access)."""

    _sources: dict[str, Any]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def __contains__(self, name: object) -> bool:
        return name in self._sources


class MappedGGUFTensors(SourcedTensors):
    """name (no `model.` prefix, as the loader asks) -> fp32 tensor, converted on access."""

    def __init__(self, reader: Any, arch: str, config: Any) -> None:
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
        from transformers.integrations.gguf import get_gguf_conversion_mapping

        mapping = get_gguf_conversion_mapping(arch, config)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        # target name -> (its converter or None, [(source pattern, GGUF tensor)] in the file's order)
        self._sources: dict[str, tuple[Any, list[tuple[str | None, Any]]]] = {}
        self._converter_of: dict[str, Any] = {}  # GGUF tensor name -> its converter (None: renamed only)
        for tensor in reader.tensors:
            target, pattern = rename_source_key(tensor.name, renamings, converters)
            converter = by_pattern.get(pattern) if pattern is not None else None
            name = target.removeprefix("model.")
            self._sources.setdefault(name, (converter, []))[1].append((pattern, tensor))
            self._converter_of[tensor.name] = converter

    def row_order(self, gguf_name: str, rows: int) -> np.ndarray | None:
        """The order in which a 2-D tensor's stored rows make the converted weight's rows, where its
        conversion only reorders rows (llama.cpp's value-head tiling undone; blocks never span rows, so
        a row order applies to them as stored); None where it changes anything else (a norm's offset,
        out_proj's column order: such a tensor is served dequantized)."""
        from transformers.integrations.gguf.gguf_conversion_mapping import PermuteRows, Unsqueeze

        converter = self._converter_of.get(gguf_name)
        order = torch.arange(rows).reshape(rows, 1)
        if converter is None:
            return order.reshape(rows).numpy()
        if not all(isinstance(op, (PermuteRows, Unsqueeze)) for op in converter.operations):
            return None
        values = {"x": order}
        for op in converter.operations:
            if isinstance(op, PermuteRows):  # Unsqueeze of a 2-D weight: none here
                values = op.convert(values, source_patterns=["x"], target_patterns=["x"])
        return values["x"].reshape(rows).numpy()

    def input_order(self, gguf_name: str) -> np.ndarray | None:
        """Where a 2-D tensor's conversion only reorders its columns (out_proj: value heads tiled),
        the order in which the converted weight's input is read to multiply the stored blocks
        (`PermuteInputFeatures.input_permutation`); None otherwise."""
        from transformers.integrations.gguf.gguf_conversion_mapping import PermuteInputFeatures

        converter = self._converter_of.get(gguf_name)
        if converter is None or not converter.operations or not all(
                isinstance(op, PermuteInputFeatures) for op in converter.operations):
            return None
        columns = None  # the converted weight's columns as the stored ones: W[:, columns]
        for op in converter.operations:
            step = op.permutation.numpy()
            columns = step if columns is None else columns[step]
        return np.argsort(columns)

    def __getitem__(self, name: str) -> torch.Tensor:
        converter, sources = self._sources[name]
        if converter is None:
            [(_, tensor)] = sources
            return _dequantized(tensor)
        # several sources (experts' gate and up joined): in the converter's order of patterns
        return _converted(converter, {pattern: _dequantized(tensor) for pattern, tensor in sources}, name)

    def expert_slice(self, name: str, expert: int) -> torch.Tensor | None:
        """`self[name][expert]` for a 3-D expert stack whose conversion only joins its sources along
        the rows (gate and up): that expert's blocks dequantized, nothing else; None for any other."""
        from transformers.core_model_loading import Concatenate

        converter, sources = self._sources[name]
        if any(tensor.data.ndim != 3 for _, tensor in sources):
            return None
        if converter is not None and not all(isinstance(op, Concatenate) and getattr(op, "dim", None) == 1
                                              for op in converter.operations):
            return None
        # each source's slice kept 3-D ([1, rows, in]) so that the join runs as on the whole stack
        by_pattern = {pattern: _dequantized_slice(tensor, expert) for pattern, tensor in sources}
        if converter is None:
            [result] = by_pattern.values()
            return result[0].float().contiguous()
        return _converted(converter, by_pattern, name)[0]


def _converted(converter: Any, by_pattern: dict[str | None, torch.Tensor], name: str) -> torch.Tensor:
    """`converter`'s operations run on its sources (by source pattern), as transformers' load runs them."""
    patterns = [p for p in converter.source_patterns if p in by_pattern]
    values: dict[str, Any] = {p: by_pattern[p] for p in patterns}
    for op in converter.operations:
        values = op.convert(values, source_patterns=patterns, target_patterns=[name], full_layer_name=name)
        patterns = list(values)
    [result] = values.values()
    return result.float().contiguous()


ROWS_PER_SLICE = 4096


def _dequantized(tensor: Any) -> torch.Tensor:
    """fp32, a slice of rows at a time along the first axis (`gguf`'s dequantize makes temporaries of
    several times its input: a 248k-row embedding whole would peak at gigabytes above the load)."""
    from gguf import dequantize

    data = tensor.data
    if data.ndim < 2:  # a norm, a bias: small, and a quantized row must not be cut
        return torch.from_numpy(np.array(dequantize(data, tensor.tensor_type), dtype=np.float32, copy=True))
    out: np.ndarray | None = None
    for start in range(0, data.shape[0], ROWS_PER_SLICE):
        part = np.asarray(dequantize(data[start:start + ROWS_PER_SLICE], tensor.tensor_type), dtype=np.float32)
        if out is None:
            out = np.empty((data.shape[0], *part.shape[1:]), dtype=np.float32)
        out[start:start + part.shape[0]] = part
    assert out is not None
    return torch.from_numpy(out)


def _dequantized_slice(tensor: Any, expert: int) -> torch.Tensor:
    """fp32 [1, rows, in]: one expert of a 3-D stack of blocks."""
    from gguf import dequantize

    return torch.from_numpy(np.array(dequantize(tensor.data[expert], tensor.tensor_type), dtype=np.float32,
                                     copy=True)).unsqueeze(0)
