"""A checkpoint's multi-token-prediction (MTP) layer run as a draft: `{"method": "mtp"}`.

DeepSeek V3 and GLM-4.5 store it after their last layer (`num_nextn_predict_layers`; layer L =
num_hidden_layers), as vLLM's DeepSeekMTP / Glm4MoeMTP read it:
  enorm, hnorm             RMSNorms of a token's embedding and of the target's hidden state
  eh_proj                  [hidden, 2 * hidden]: the two concatenated, embedding first, into one row
  self_attn, mlp, norms    one decoder layer of the family (its attention, its MoE block), with a KV of its own
  shared_head.norm / head  its final norm and LM head
  embed_tokens             its embedding
At position p it reads the target's final hidden state h_p (after the target's final norm) and the
token t_{p+1}, writes its KV at p, and its logits there score t_{p+2}. Chained for k proposals, its
own output at the position before (before its final norm) stands in for h: vLLM's order, in which
these layers were trained and are served.

Qwen3.5 and Qwen3-Next store theirs as `mtp.*` (vLLM's Qwen3NextMTP): `fc` for eh_proj,
`pre_fc_norm_embedding` / `pre_fc_norm_hidden` for enorm / hnorm ((1 + w) norms), `layers.0` one
gated-attention layer of the family, `norm`, and the target's embedding and head; chained, it
reads its own output after its norm.

`MtpLM` (`MtpHybridLM` for the hybrids: a one-layer `HybridModel` without state layers) is that
layer as a one-layer model of the family (its own layer class, MLA included), so the load,
quantization, packing and the paged attention are the target's; `MtpTensors` renames the MTP
layer's tensors to its names and leaves the target's to the target.

The engine keeps which positions already hold the head's KV and the target's hidden states it has
not read yet (baton/engine/mtp_drafter.py); `propose_mtp` runs its rows: a first forward over every
row's unread positions (its proposal comes from the last), then one forward per further proposal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from baton.model.config import ModelConfig
from baton.model.families import family_spec
from baton.model.hybrid import HybridModel
from baton.model.model import Attention, CausalLM, RMSNorm, set_op
from baton.model.model_runner import StepResult
from baton.model.step_batch import RowKind, StepBatch, StepRow

# the MTP layer's own tensors (under `layers.{L}.`) -> MtpLM's names; the rest of `layers.{L}.` is
# its decoder layer (-> `layers.0.`) but for its copies of the target's embedding and head, which
# are not read: the head embeds and scores with the target's own (`MtpHead.borrow_vocab`), as vLLM
# shares them
OWN_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
             "shared_head.norm.weight": "norm.weight"}
VOCAB_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
VOCAB_PARAMETERS = ("embed_tokens.weight", "lm_head.weight")  # MtpLM's, left empty: the target's are used
# Qwen3.5's and Qwen3-Next's head (`mtp.*`, vLLM's Qwen3NextMTP): its tensors -> MtpLM's names (the
# rest, `layers.0.*`, its decoder layer); it has no embedding or head of its own
QWEN_NAMES = {"fc.weight": "eh_proj.weight", "pre_fc_norm_embedding.weight": "enorm.weight",
              "pre_fc_norm_hidden.weight": "hnorm.weight", "norm.weight": "norm.weight"}


def mtp_config(config: ModelConfig) -> ModelConfig:
    """The config of the target's first MTP layer as a one-layer model (ValueError where there is none,
    or where the family keeps per-layer kinds the head does not carry over)."""
    qwen = bool(family_spec(config.model_type).mtp_prefix)  # `mtp.*`: present or not, the tensors say
    if config.mtp_layers < 1 and not qwen:
        raise ValueError(f"{config.model_id} has no multi-token-prediction layers (num_nextn_predict_layers "
                         "is 0 or absent): speculative_config method \"mtp\" needs a checkpoint that carries them")
    per_layer = {"sliding windows": config.layer_sliding, "no-rope layers": config.layer_rope,
                 "per-layer shapes": config.layer_head_dim}
    kinds = [what for what, values in per_layer.items() if values]
    if kinds or (config.has_state_layers and not qwen):
        raise ValueError(f"speculative_config method \"mtp\" is not served for {config.model_type} "
                         f"({', '.join(kinds or ['state layers'])})")
    # the MTP layer is of the kind of the layers before it (a MoE block where the last layer has one);
    # a hybrid's head is one of its (gated) attention layers
    return dataclasses.replace(config, num_layers=1, mtp_layers=0,
                               layer_moe=config.layer_moe[-1:] if config.layer_moe else [],
                               layer_deltanet=[False] if config.layer_deltanet else [])


def mtp_prefix(config: ModelConfig) -> str:
    """Where the checkpoint keeps its MTP layer (names without `model.`): `mtp.` (the Qwens) or the
    layer after the last."""
    return "mtp." if family_spec(config.model_type).mtp_prefix else f"layers.{config.num_layers}."


class MtpTensors(Mapping[str, torch.Tensor]):
    """The checkpoint's tensors as `MtpLM` names them: its MTP layer's (under `prefix`, `mtp_prefix`
    of the target's config) but for its copies of the target's embedding and head; the target's own
    are not listed."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], prefix: str, model_id: str) -> None:
        self.tensors = tensors
        qwen = prefix == "mtp."
        own_names = QWEN_NAMES if qwen else OWN_NAMES
        names: dict[str, str] = {}
        for name in tensors:
            if not name.startswith(prefix):
                continue
            rest = name.removeprefix(prefix)
            if rest not in VOCAB_COPIES:
                names[own_names.get(rest, rest if qwen else f"layers.0.{rest}")] = name
        if not names:
            raise ValueError(f"{model_id}: the checkpoint carries no multi-token-prediction layer (no {prefix}* "
                             "tensors): speculative_config method \"mtp\" needs one")
        self.names = names

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[self.names[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class MtpHead:
    """What an MTP layer adds to a one-layer model of its family: enorm, hnorm and eh_proj in front,
    reading the target's hidden states beside the tokens (`input_hidden`). It runs on the torch path
    (its input is no embedding)."""

    def _add_head(self, config: ModelConfig) -> None:
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps, config.norm_kind)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps, config.norm_kind)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        set_op(self, "eh", self.eh_proj)
        self.native_unsupported = [*self.native_unsupported, "multi-token prediction"]

    def projection_slots(self) -> list[tuple[nn.Module, str, nn.Linear]]:
        # the head is the target's op (`borrow_vocab`): not packed or quantized again here
        own = [slot for slot in super().projection_slots() if slot[1] != "head"]  # type: ignore[misc]
        return [*own, (self, "eh", self.eh_proj)]

    def borrow_vocab(self, target: CausalLM) -> None:
        """Embed tokens and score them with the target's embedding and head (their ops as the target
        serves them: one copy of the vocabulary's tables, not two)."""
        object.__setattr__(self, "vocab_model", target)  # not a submodule: the target owns it

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.vocab_model.embed(input_ids)

    def _head_rows(self, normed: torch.Tensor) -> torch.Tensor:
        return self.vocab_model._head_rows(normed)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *rest: Any,
                input_hidden: torch.Tensor | None = None, **options: Any) -> Any:
        """`forward` with `input_hidden` [T, hidden] beside `input_ids` [T] (token t_{p+1} and the
        target's h_p at position p; chained, the head's own output)."""
        assert input_hidden is not None, "an MTP step reads a hidden state beside every token"
        x = self.eh(torch.cat([self.enorm(self.embed(input_ids)), self.hnorm(input_hidden.to(self.enorm.weight.dtype))],
                              dim=-1))  # [T, hidden]
        return self.forward_embedded(x, positions, *rest, **options)


class MtpLM(MtpHead, CausalLM):
    """DeepSeek V3's and GLM-4.5's MTP layer (`mtp_config`): its returned hidden states are its layer's
    output before the final norm (what its next chained step reads)."""

    def __init__(self, config: ModelConfig, attention: type[nn.Module] = Attention) -> None:
        CausalLM.__init__(self, config, attention)
        self._add_head(config)

    def final_hidden(self, rows: torch.Tensor) -> torch.Tensor:
        return rows  # the layer's output before the final norm: what the next chained step reads


class MtpHybridLM(MtpHead, HybridModel):
    """Qwen3.5's and Qwen3-Next's MTP layer: one gated-attention layer of the hybrid family (no state
    layer); its returned hidden states are after its final norm, as vLLM's Qwen3NextMTP chains them."""

    def __init__(self, config: ModelConfig) -> None:
        HybridModel.__init__(self, config)
        self._add_head(config)


@dataclass(frozen=True, slots=True)
class MtpRow:
    """What the head computes for one request this step: positions start.. with their tokens
    (t_{p+1} at p) and the target's hidden states, then `num_proposals` chained proposals (0: it
    only catches its KV up)."""

    request_id: str
    start: int
    tokens: Sequence[int]
    hidden: torch.Tensor  # [len(tokens), hidden]
    block_table: Sequence[int]  # the target's: slots up to start + len(tokens) - 1 + num_proposals - 1
    num_proposals: int


@torch.inference_mode()
def propose_mtp(execute: Callable[[StepBatch], StepResult], rows: Sequence[MtpRow], vocab: int,
                dtype: torch.dtype) -> tuple[list[list[int]], int]:
    """Each row's proposals (the head's argmax over the first `vocab` ids, chained) and how many
    forwards ran. The first forward runs every row's positions; the logits of a proposing row's
    last one give its first proposal; each further forward is one position per proposing row."""
    proposals: list[list[int]] = [[] for _ in rows]
    forwards = 0
    step_rows = [_row(r.request_id, r.start, r.tokens, r.hidden, r.block_table, r.num_proposals > 0) for r in rows]
    last = {r.request_id: r.start + len(r.tokens) - 1 for r in rows}  # each row's last position computed
    for step in range(max((r.num_proposals for r in rows), default=0) + 1):
        if not step_rows:
            break
        result = execute(StepBatch(tuple(step_rows), hidden_states=True))
        forwards += 1
        picks = dict(zip(result.sampled, result.logits[:len(result.sampled), :vocab].argmax(dim=-1).tolist()))
        step_rows = []
        for i, r in enumerate(rows):
            if r.num_proposals <= step:
                continue
            token = picks[r.request_id]
            proposals[i].append(token)
            if len(proposals[i]) < r.num_proposals:  # the next position reads this one's output
                state = result.row_hidden[r.request_id][-1:].to(dtype)
                last[r.request_id] += 1
                step_rows.append(_row(r.request_id, last[r.request_id], (token,), state, r.block_table, True))
    return proposals, forwards


def _row(request_id: str, start: int, tokens: Sequence[int], hidden: torch.Tensor, block_table: Sequence[int],
         sample: bool) -> StepRow:
    if len(tokens) == 1 and sample:  # one position through the decode kernels
        return StepRow(request_id, RowKind.DECODE, start, tuple(tokens), block_table, hidden=hidden)
    return StepRow(request_id, RowKind.CHUNK, start, tuple(tokens), block_table, sample=sample, hidden=hidden)
