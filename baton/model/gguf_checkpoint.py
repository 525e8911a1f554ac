"""A GGUF file read as a checkpoint: its tensors under Hugging Face names, dequantized one at a time.

A model directory made from a GGUF (`baton.common.model_files.convert_gguf`) holds the config, the
tokenizer and a record of the file, and no weights: the loader reads the file itself, through the
`gguf` package's memory-mapped reader. Each tensor is dequantized (to fp32, with transformers' own
per-architecture processing: llama.cpp's q/k row permutation undone, Gemma's norm offsets) when the
loader asks for it and converted to the model's dtype at once, so loading peaks at the model in its
dtype plus one fp32 tensor, and nothing dequantized is written to disk (the default model's 94 MB
Q4_1 file once became a 538 MB directory; an 8B Q4_K_M file would have taken ~32 GB).

The names are transformers' (`get_gguf_hf_weights_map`'s rule over the model built on the meta device), the
numbers `gguf.quants.dequantize`'s followed by the architecture's `TensorProcessor`: what
`from_pretrained(..., gguf_file=...)` gives, tensor for tensor. A Qwen2/Qwen3-MoE's expert stacks,
which transformers' processor joins (gate and up into one `gate_up_proj`), are joined here, one layer
when asked for (and not at all where the file's blocks serve them: baton.model.gguf_experts). A gpt-oss
file is read as OpenAI's checkpoint (baton.model.gguf_gpt_oss: its MXFP4 blocks kept). Other
architectures whose processor merges tensors (MiniMax-M2) are read whole by transformers.
"""

from __future__ import annotations

import json
import logging
import mmap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from baton.common.gguf_names import hf_to_gguf_names, read_names
from baton.common.gguf_llama_like import tensor_processor_arch
from baton.model.gguf_gpt_oss import GptOssGGUFTensors
from baton.model.gguf_mapped import MappedGGUFTensors, uses_conversion_mapping

logger = logging.getLogger("baton.model.gguf_checkpoint")


_READERS: dict[tuple[str, int, int], Any] = {}

# the embedding and the head: the largest tensors, which no architecture's processor reorders across
# rows (llama.cpp's q/k permutation is the one that does), so they can be dequantized a slice at a time
ROW_LOCAL = frozenset({"token_embd.weight", "output.weight"})
ROWS_PER_SLICE = 4096


def open_reader(path: Path) -> Any:
    """The file's `gguf.GGUFReader`, one per file content in a process: parsing the header (the
    tokenizer's arrays) takes seconds, and the loader and the quantized projections both read it."""
    from baton.common.gguf_reader import FastGGUFReader

    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _READERS:
        _READERS.clear()  # one model per process: never hold two files' maps
        _READERS[key] = FastGGUFReader(str(path))
    return _READERS[key]


def drop_touched_pages(reader: Any) -> None:
    """Unmap the pages of the file this process has read through `reader` (madvise DONTNEED on its
    read-only shared map): they stay in the page cache, but no longer count in the worker's resident
    memory, so that reading a file tensor by tensor never holds the whole file besides what was made
    of it. A later read faults them back in from the page cache."""
    mapping = getattr(reader.data, "_mmap", None)  # numpy.memmap's own mmap.mmap (None for a view)
    if mapping is not None and hasattr(mapping, "madvise"):
        mapping.madvise(mmap.MADV_DONTNEED)


def drop_all_touched_pages() -> None:
    """`drop_touched_pages` for every reader this process holds (after the loader read the weights)."""
    for reader in _READERS.values():
        drop_touched_pages(reader)


def release_readers() -> None:
    """Drop the cached readers once the weights are loaded: a reader holds the parsed header (the
    tokenizer's arrays: ~140 MB for a 49k vocabulary) and its map of the whole file, per worker."""
    _READERS.clear()


class GGUFCheckpoint(Mapping[str, torch.Tensor]):
    """name (as `loader._read_tensors` gives it: no `model.` prefix) -> fp32 tensor, read on access."""

    def __init__(self, gguf_path: Path, model_dir: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, Gemma2TensorProcessor,
                                                              LlamaTensorProcessor, Lfm2TensorProcessor,
                                                              NemotronTensorProcessor, Qwen2MoeTensorProcessor,
                                                              TensorProcessor, load_gguf_checkpoint)

        # processors that change a tensor's numbers or shape but keep its name: read lazily
        one_to_one = (TensorProcessor, LlamaTensorProcessor, Gemma2TensorProcessor, NemotronTensorProcessor,
                      Lfm2TensorProcessor)

        self.path = gguf_path
        self.reader = open_reader(gguf_path)
        arch = bytes(self.reader.fields["general.architecture"].parts[-1]).decode()
        self._mapped: MappedGGUFTensors | GptOssGGUFTensors | None = None
        self._eager: dict[str, torch.Tensor] | None = None
        self._tensors: dict[str, Any] = {}
        # a MoE's expert stacks (Qwen2/Qwen3-MoE): name -> the GGUF tensors joined along their rows
        self._experts: dict[str, list[Any]] = {}
        if uses_conversion_mapping(arch):  # Qwen3.5: transformers' conversion mapping (gguf_mapped)
            self._mapped = MappedGGUFTensors(self.reader, arch, AutoConfig.from_pretrained(model_dir))
            return
        if arch == "gpt-oss":  # read as OpenAI's checkpoint, MXFP4 blocks and all (gguf_gpt_oss)
            self._mapped = GptOssGGUFTensors(self.reader)
            return
        raw_config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        processor_class = TENSOR_PROCESSORS.get(tensor_processor_arch(arch), TensorProcessor)
        self._processor = processor_class(config=raw_config)
        names = None
        if processor_class is Qwen2MoeTensorProcessor:  # experts joined per layer: read lazily here
            names = read_names(model_dir) or hf_to_gguf_names(self.reader, AutoConfig.from_pretrained(model_dir))
            self._experts = _expert_stacks(self.reader, int(raw_config["num_hidden_layers"]))
            names = {hf: g for hf, g in names.items() if ".mlp.experts." not in hf}
        elif processor_class not in one_to_one:  # experts merged by the processor: transformers reads it whole
            logger.info("%s: its %s tensors are merged on load: reading the file whole", gguf_path.name, arch)
            with torch.device("meta"):
                hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
            tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=hf_model)["tensors"]
            self._eager = {name.removeprefix("model."): t for name, t in tensors.items()}
            return
        if names is None:
            names = read_names(model_dir) or hf_to_gguf_names(self.reader, AutoConfig.from_pretrained(model_dir))
        by_gguf_name = {t.name: t for t in self.reader.tensors}
        self._tensors = {hf.removeprefix("model."): by_gguf_name[g] for hf, g in names.items() if g in by_gguf_name}
        layers = int(raw_config["num_hidden_layers"])
        blocks = {int(n.split(".")[1]) for n in by_gguf_name if n.startswith("blk.")}
        beyond = [str(b) for b in sorted(blocks) if b >= layers]
        if beyond:  # GLM-4.5's multi-token-prediction layer (`nextn_predict_layers`): not served from a GGUF yet
            logger.info("%s: block(s) %s after the model's %d layers (multi-token prediction) not read",
                        gguf_path.name, ", ".join(beyond), layers)

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._mapped is not None:
            return self._mapped[name]
        if self._eager is not None:
            return self._eager[name]
        from gguf import dequantize

        if name in self._experts:  # [E, rows, in] each, joined along the rows (gate, then up)
            # (float32 stacks are the file's read-only map: copied, as cat copies the others)
            return torch.cat([torch.from_numpy(np.require(dequantize(t.data, t.tensor_type), np.float32, "W"))
                              for t in self._experts[name]], dim=1)

        tensor = self._tensors[name]
        if tensor.name in ROW_LOCAL and tensor.data.ndim == 2:
            return self._dequantized_by_rows(tensor)
        return self._processed(dequantize(tensor.data, tensor.tensor_type), tensor.name)

    def _processed(self, weights: np.ndarray, gguf_name: str) -> torch.Tensor:
        """Dequantized `weights` as transformers' tensor processor for the architecture leaves them
        (e.g. Llama's q/k rows un-permuted), as an fp32 tensor of their own."""
        result = self._processor.process(weights=weights, name=gguf_name)
        return torch.from_numpy(np.array(result.weights, dtype=np.float32, copy=True))

    def expert_slice(self, name: str, expert: int) -> torch.Tensor | None:
        """One expert of the stack `name` ([rows, in]), exactly `self[name][expert]`, dequantizing that
        expert's blocks only (a load check samples a few experts: the whole stack of a 30B layer is
        ~1.6 GB in fp32); None where the stack is not read from per-expert slices."""
        from gguf import dequantize

        if self._mapped is not None:
            return self._mapped.expert_slice(name, expert)
        stack = self._tensors.get(name)
        if stack is not None and stack.data.ndim == 3:  # a stack the file holds whole (Gemma 4's experts)
            return self._processed(dequantize(stack.data[expert], stack.tensor_type), stack.name)
        if name not in self._experts:
            return None
        return torch.cat([torch.from_numpy(np.asarray(dequantize(t.data[expert], t.tensor_type), dtype=np.float32))
                          for t in self._experts[name]], dim=0)

    def _dequantized_by_rows(self, tensor: Any) -> torch.Tensor:
        """A large 2-D tensor dequantized a slice of rows at a time into one fp32 result: `gguf`'s
        dequantize makes several temporaries the size of its input (measured: the default model's
        113 MB fp32 embedding peaked 336 MB above the load), one slice's here."""
        from gguf import dequantize

        rows = tensor.data.shape[0]
        out: np.ndarray | None = None
        for start in range(0, rows, ROWS_PER_SLICE):
            part = dequantize(tensor.data[start:start + ROWS_PER_SLICE], tensor.tensor_type)
            part = np.asarray(self._processor.process(weights=part, name=tensor.name).weights, dtype=np.float32)
            if out is None:
                out = np.empty((rows, *part.shape[1:]), dtype=np.float32)
            out[start:start + part.shape[0]] = part
        assert out is not None
        return torch.from_numpy(out)

    def _names(self) -> Mapping[str, Any]:
        if self._mapped is not None:
            return self._mapped
        return self._eager if self._eager is not None else {**self._tensors, **self._experts}

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()


def _expert_stacks(reader: Any, layers: int) -> dict[str, list[Any]]:
    """{`layers.N.mlp.experts.gate_up_proj` / `down_proj`: its GGUF tensors} (transformers' names for
    a Qwen3-MoE's stacks: [E, 2I, H], gate rows then up rows, and [E, H, I]) of the model's `layers`
    (not of a multi-token-prediction layer after them: GLM-4.5's, which is not read)."""
    by_name = {t.name: t for t in reader.tensors}
    stacks: dict[str, list[Any]] = {}
    for name in by_name:
        if name.startswith("blk.") and name.endswith(".ffn_down_exps.weight"):
            block = name.split(".")[1]
            if int(block) >= layers:
                continue
            parts = [by_name.get(f"blk.{block}.ffn_{leaf}_exps.weight") for leaf in ("gate", "up")]
            stacks[f"layers.{block}.mlp.experts.down_proj"] = [by_name[name]]
            if all(p is not None for p in parts):
                stacks[f"layers.{block}.mlp.experts.gate_up_proj"] = parts
    return stacks
