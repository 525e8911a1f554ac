"""gpt-oss's MXFP4 experts loaded as Q8_0 expert ops, from their blocks (never dense).

`take_expert_blocks` runs before the loader builds its state: the stacked-expert parameters
(`experts_gate_up` / `experts_down`) whose one checkpoint tensor is stored as MXFP4 blocks + scales
leave the recipes (their parameters are not read) and their tensors leave the view (so the strict
"every tensor used" check holds). `install_expert_blocks` then repacks each, one stack at a time,
without loss (`baton.model.mxfp4.repack_q8_0`) into one `QuantizedLinear` per expert, and hands them to
the MoE (`SparseMoE.use_quantized_experts`, which drops the dense stacks left on the meta device).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from baton.model.linear import QuantizedLinear
from baton.model.mxfp4 import BLOCKS, SCALES, repack_q8_0

EXPERT_PARAMETERS = (".experts_gate_up", ".experts_down")


class _Without(Mapping[str, torch.Tensor]):
    """`tensors` less the names in `dropped`, read on access (nothing is copied)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dropped: set[str]) -> None:
        self.tensors, self.dropped = tensors, dropped

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.dropped:
            raise KeyError(name)
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return (n for n in self.tensors if n not in self.dropped)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name: object) -> bool:
        return name not in self.dropped and name in self.tensors


def take_expert_blocks(recipes: dict[str, Any], tensors: Mapping[str, torch.Tensor]
                       ) -> tuple[dict[str, str], Mapping[str, torch.Tensor]]:
    """recipes: the loader's {parameter: _Recipe}, edited in place; tensors: the checkpoint's view, MXFP4
    pairs read as one name (`baton.model.mxfp4.DequantizedView`). Returns {parameter: checkpoint name}
    for the experts stored packed, and the view without them."""
    taken: dict[str, str] = {}
    for target in [t for t in recipes if t.endswith(EXPERT_PARAMETERS)]:
        recipe = recipes[target]
        names = recipe.names(0)
        if len(recipe.alternatives) == 1 and len(names) == 1 and getattr(tensors, "packed", ()) and \
                names[0] in tensors.packed:  # type: ignore[attr-defined]
            taken[target] = names[0]
            del recipes[target]
    return taken, _Without(tensors, set(taken.values())) if taken else tensors


def install_expert_blocks(model: nn.Module, taken: dict[str, str], raw: Mapping[str, torch.Tensor],
                          kernels: Any) -> None:
    """Each taken parameter as Q8_0 ops repacked from its blocks in `raw` (the checkpoint's own
    tensors): rows are the weight's outputs, blocks run along its inputs, so each expert's [N, K] is
    F.linear's layout as stored. gpt-oss's gate_up rows interleave gate and up: reordered to the gate
    rows, then the up rows, as the dense load de-interleaves them."""
    by_moe: dict[str, dict[str, list[Any]]] = {}
    for target, name in taken.items():
        owner, kind = target.rsplit(".", 1)
        blocks, scales = raw[name + BLOCKS], raw[name + SCALES]
        ops = []
        # one expert at a time: a stack's whole Q8_0 copy (twice its blocks) and the repack's
        # temporaries (int32 codes, 4x) never exist at once (measured on a gpt-oss-20b-shaped layer:
        # 3 GB above the load per stack when repacked whole)
        for expert in range(blocks.shape[0]):
            q, d = repack_q8_0(blocks[expert], scales[expert])  # [N, K] int8, [N, K/32] fp32
            if kind == "experts_gate_up":
                q, d = (torch.cat([t[::2], t[1::2]]) for t in (q, d))
            ops.append(QuantizedLinear.q8_0(q, d, None, kernels))  # (with the kernel, it packs its own copy)
        by_moe.setdefault(owner, {})[kind] = ops
        del blocks, scales
    for owner, ops in by_moe.items():
        moe = model.get_submodule(owner)
        if not getattr(moe, "clamped_swiglu", False):  # the de-interleave above is gpt-oss's layout
            raise ValueError(f"{owner}: MXFP4 experts are read in gpt-oss's layout only")
        if set(ops) != {"experts_gate_up", "experts_down"}:
            raise ValueError(f"{owner}: MXFP4 blocks for {sorted(ops)} only (gate_up and down both, or neither)")
        moe.use_quantized_experts(ops["experts_gate_up"], ops["experts_down"])
