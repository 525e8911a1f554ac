"""Hybrid decoders: Gated DeltaNet state layers beside gated full-attention layers (Qwen3-Next,
Qwen3.5 text), as transformers' modeling_qwen3_next.py / modeling_qwen3_5.py compute them.

`HybridModel` is the one decoder (`CausalLM`) with other layers: per layer either a Gated DeltaNet
(`baton.model.gated_deltanet`, its memory a state slot per request in the runner's `StatePool`) or
a gated attention (q_proj doubled: each head's query and an output gate, sigmoid-gated before
o_proj; per-head q/k norm; the family's partial rotary) over the paged KV cache, which holds the
attention layers only (`ModelConfig.attention_layers`: a 3-in-4 state model's blocks are a quarter
of a dense one's). Gemma-style norms ((1 + w) weights), as the reference's. Qwen3-Next's MoE is
`baton.model.moe.SparseMoE` with its shared expert behind a sigmoid gate (`GatedSharedExpert`), as
is Qwen3.5-MoE's. LFM2 is the same decoder with other state layers: gated short convolutions
(`baton.model.short_conv`, a conv state per request in the same pool) beside plain GQA attention
with per-head q/k norm, its checkpoint's names mapped by `hybrid_recipes`. Granite 4.0-H is the
same decoder with Mamba-2 state layers (`baton.model.mamba2`) beside plain attention (rotary or
none), Granite's embedding / residual / logits multipliers, and a dense shared MLP on every layer
(plus top-k routed experts where `num_local_experts` > 0).

The native bf16 layer kernels do not run these layers (the torch path, every dtype), but for the
Gated DeltaNet decode step (conv, silu, the delta rule: kernels/gated_delta.cpp) on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn

from baton.model.attention import AttentionMetadata
from baton.model.config import ModelConfig
from baton.model.gated_deltanet import DeltaNetDims, GatedDeltaNet, StateMeta, StatePool
from baton.model.mamba2 import Mamba2Dims, Mamba2Mixer
from baton.model.model import MLP, Attention, CausalLM, RMSNorm, apply_rope, set_op
from baton.model.moe import SparseMoE
from baton.model.short_conv import ShortConv, ShortConvDims, state_dims


def torch_flush_denormals(on: bool) -> bool:
    """torch's switch (the calling thread only), where the native kernels are not built: reports
    the mode as off before, so that it is cleared after."""
    torch.set_flush_denormal(on)
    return False


def flushing(flush: Callable[[bool], bool]) -> Callable[[], AbstractContextManager[None]]:
    """A context in which `flush` (the kernels' flush_denormals, or torch's) holds denormals at zero
    on the step's threads, and after which the mode is as it was."""
    @contextmanager
    def flushed() -> Iterator[None]:
        before = flush(True)
        try:
            yield
        finally:
            if not before:
                flush(False)

    return flushed


class GatedAttention(Attention):
    """Qwen3-Next's attention: the query projection gives each head's query and an output gate."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        # q|gate per head (2 * q_size rows, the checkpoint's q_proj as is), then k and v
        self.qkv_proj = nn.Linear(config.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        set_op(self, "qkv", self.qkv_proj)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, q_scale: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        t, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        query_gate, k, v = self.qkv(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = query_gate.view(t, heads, 2 * d).chunk(2, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k.view(t, kv_heads, d))
        v = v.view(t, kv_heads, d)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attend(q, k, v, kv_cache, meta)  # [T, heads, head_dim]
        return self.o(out.reshape(t, self.q_size) * torch.sigmoid(gate.reshape(t, self.q_size)))


class GatedSharedExpert(nn.Module):
    """Qwen3-Next's shared expert: sigmoid(shared_expert_gate(x)) * shared_expert(x)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.mlp = MLP(config, config.shared_expert_intermediate_size)
        self.gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * self.mlp(x)


class HybridLayer(nn.Module):
    """Pre-norm: x += mixer(input_ln(x)); x += mlp(post_attention_ln(x)); the mixer a Gated DeltaNet
    (`linear_attn`) or a gated attention (`self_attn`) over its slice of the KV cache (`kv_index`)."""

    def __init__(self, config: ModelConfig, layer_index: int, dims: DeltaNetDims | ShortConvDims | Mamba2Dims
                 ) -> None:
        super().__init__()
        self.residual_multiplier = config.residual_multiplier  # Granite scales each branch
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_kind)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_kind)
        self.self_attn: Attention | None = None
        self.linear_attn: GatedDeltaNet | ShortConv | Mamba2Mixer | None = None
        if config.layer_deltanet[layer_index]:
            state_index = sum(config.layer_deltanet[:layer_index])
            if isinstance(dims, ShortConvDims):
                self.linear_attn = ShortConv(dims, state_index)
            elif isinstance(dims, Mamba2Dims):
                self.linear_attn = Mamba2Mixer(dims, state_index)
            else:
                self.linear_attn = GatedDeltaNet(dims, config.hidden_size, config.rms_norm_eps, state_index)
            self.kv_index = -1
        else:
            # LFM2's and Granite's attention is the plain one (GQA); the Qwens' is gated
            self.self_attn = (GatedAttention(config, layer_index) if isinstance(dims, DeltaNetDims) else
                              Attention(config, layer_index))
            self.kv_index = config.attention_layers.index(layer_index)
        if isinstance(dims, Mamba2Dims) and config.is_moe(layer_index):
            # Granite: the routed experts plus the dense shared MLP, ungated
            self.mlp = SparseMoE(config, MLP(config))
        elif config.is_moe(layer_index):
            shared = GatedSharedExpert(config) if config.shared_expert_intermediate_size else None
            self.mlp: nn.Module = SparseMoE(config, shared)
        else:
            self.mlp = MLP(config)
        # around the state layer: flush-to-zero on, then off (HybridModel.forward's choice); none: nothing
        self.denormals_flushed: Callable[[], AbstractContextManager[None]] = nullcontext

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, pool: StatePool | None, state: StateMeta | None) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            assert pool is not None and state is not None
            with self.denormals_flushed():  # (HybridModel.forward says when: per step, or per state layer)
                branch = self.linear_attn(h, pool, state)
        else:
            assert self.self_attn is not None
            branch = self.self_attn(h, cos, sin, kv_cache[self.kv_index], meta)
        post = self.post_attention_layernorm
        if post.native is not None and self.residual_multiplier == 1.0 and x.dtype == torch.bfloat16:
            h = post.native(x, branch, post.weight, post.eps)  # x += branch and the norm, one native call
        else:
            self._add(x, branch)
            h = post(x)
        self._add(x, self.mlp(h))
        return x

    def _add(self, x: torch.Tensor, branch: torch.Tensor) -> None:
        x += branch * self.residual_multiplier if self.residual_multiplier != 1.0 else branch


class HybridModel(CausalLM):
    """The decoder of a hybrid family (see the module docstring). `forward` takes the step's state
    pool and which slot each row continues from (`state`); the KV cache holds the attention layers."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)  # embeddings, final norm, head and the bookkeeping every model has
        self.dims = state_dims(config.deltanet)
        self.flushed: Callable[[], AbstractContextManager[None]] = flushing(torch_flush_denormals)  # (prepare: native)
        self.flush_per_layer = False
        self.num_state_layers = sum(config.layer_deltanet)
        self.layers = nn.ModuleList(HybridLayer(config, i, self.dims) for i in range(config.num_layers))
        self.attention_layers = [layer.self_attn for layer in self.layers if layer.self_attn is not None]
        self.has_window = self.has_local_rope = False

    def _kv_dtype(self) -> torch.dtype | None:
        """The quantized KV cache's dtype (int8 / fp8), None where the cache is the model's dtype."""
        return self.attention_layers[0].backend.kv_dtype if self.attention_layers else None

    def describe(self) -> str:
        kv = self._kv_dtype()
        cache = f"; {str(kv).removeprefix('torch.')} KV cache" if kv is not None else ""
        native = any(getattr(layer.linear_attn, "kernel", None) is not None for layer in self.layers)
        step = "; the Gated DeltaNet decode step native (kernels/gated_delta.cpp)" if native else ""
        return (f"{self.config.model_type}: torch path ({', '.join(self.native_unsupported)}){step}; "
                f"{self.num_state_layers} state layers, {len(self.attention_layers)} attention layers{cache}")

    def use_kv_dtype(self, dtype: torch.dtype) -> None:
        for attn in self.attention_layers:
            attn.backend.use_kv_dtype(dtype)
        self._place_flush()

    def _place_flush(self) -> None:
        """Where denormals are flushed: around the whole step (two switches of the threads' mode a
        step), or, with an fp8 KV cache, around each state layer only (fp8 codes convert through
        denormal floats, which the mode reads and makes as zero; ~0.2 ms a switch)."""
        kv = self._kv_dtype()
        self.flush_per_layer = kv is not None and kv.is_floating_point and kv.itemsize == 1
        for layer in self.layers:
            layer.denormals_flushed = self.flushed if self.flush_per_layer else nullcontext

    def projection_slots(self) -> list[tuple[nn.Module, str, nn.Linear]]:
        """CausalLM's slots (attention and MLP projections, the head last) with each state layer's
        input and output projections before the head: they are most of a hybrid's weights (three of
        Qwen3.5's four layers), so they take the native packs and the quantized kernels as any
        projection does."""
        slots = super().projection_slots()
        head = slots.pop()
        for layer in self.layers:
            if layer.linear_attn is not None:
                slots += layer.linear_attn.projection_slots()
        return slots + [head]

    def dense_mlp(self, mlp: nn.Module) -> nn.Module:
        # Qwen3-Next's shared expert is a dense MLP behind a sigmoid gate
        mlp = super().dense_mlp(mlp)
        return mlp.mlp if isinstance(mlp, GatedSharedExpert) else mlp

    def prepare(self, fast_linears: bool = True, native_kernels: bool = True,
                batch_invariant: bool | str | None = None, pack_projections: bool = True,
                release_originals: bool = False, gemv_amx: bool = True, triton: bool = False,
                build_plan: bool = True) -> None:
        # CausalLM.prepare's matmul plan over every projection slot (the state layers' included:
        # `projection_slots`); the native layer kernels never install (`native_unsupported`)
        super().prepare(fast_linears, native_kernels, batch_invariant, pack_projections, release_originals,
                        gemv_amx, triton, build_plan=False)
        self.layers_plan = None
        self.fused_norm = None
        # the Gated DeltaNet decode step runs natively on the CPU in bf16 and fp32 (what its conv
        # state and the rule take); else, and without a compiler, the torch ops
        param = self.norm.weight  # (the embedding may be unread yet: gguf_embeddings)
        kernel = None
        if native_kernels and param.device.type == "cpu" and param.dtype in (torch.bfloat16, torch.float32):
            from baton.model import kernels

            loaded = kernels.load()
            kernel = loaded if loaded is not None and hasattr(loaded, "gated_delta_decode") else None
        # denormal floats flushed on every thread of the step (the state layers' decays make them, and
        # x86 computes on them 5x slower: kernels' flush_denormals; without the kernels, torch's
        # switch, the calling thread only), then the mode restored: see `_place_flush`
        self.flushed = flushing(kernel.flush_denormals if kernel is not None else torch_flush_denormals)
        self._place_flush()
        for layer in self.layers:
            deltanet = layer.linear_attn
            if isinstance(deltanet, GatedDeltaNet):  # (the kernel takes one dtype for all its tensors)
                deltanet.join_gates()
                same_dtype = deltanet.conv1d.weight.dtype == deltanet.norm.weight.dtype == param.dtype
                deltanet.kernel = kernel if same_dtype else None

    @torch.inference_mode()
    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [attention layers, 2, kv_heads, num_slots, head_dim]
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S]
        max_position: int,
        hidden_indices: torch.Tensor | None = None,
        state: tuple[StatePool, StateMeta] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(input_ids)
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier  # Granite's (a float, as the reference)
        return self.forward_embedded(x, positions, kv_cache, meta, logits_indices, max_position, hidden_indices, state)

    def forward_embedded(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,  # type: ignore[override]
                         meta: AttentionMetadata, logits_indices: torch.Tensor, max_position: int,
                         hidden_indices: torch.Tensor | None = None, state: tuple[StatePool, StateMeta] | None = None,
                         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`forward` from its input rows x [T, hidden] on (as `CausalLM.forward_embedded`)."""
        # a model without state layers (an MTP head's one attention layer) runs without a pool
        assert state is not None or not self.num_state_layers, "a hybrid's step needs its rows' state slots"
        pool, state_meta = state if state is not None else (None, None)
        cos, sin = self.rope(positions, max_position)
        # lent threads (baton/model/thread_gate.py) are given back between layers when their owner
        # asks, so a step on borrowed cores keeps a reclaiming prefill worker waiting one layer at most
        gate = self.thread_gate
        if gate is not None:
            gate.enter()
        try:
            with nullcontext() if self.flush_per_layer else self.flushed():
                for layer in self.layers:
                    x = layer(x, cos, sin, kv_cache, meta, pool, state_meta)
                    if gate is not None:
                        gate.poll()
        finally:
            if gate is not None:
                gate.leave()
        return self._with_hidden(self.norm(x), logits_indices, hidden_indices)

    def _with_hidden(self, normed: torch.Tensor, logits_indices: torch.Tensor,
                     hidden_indices: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out = super()._with_hidden(normed, logits_indices, hidden_indices)
        if self.config.logits_scaling == 1.0:
            return out
        # Granite divides the logits by `logits_scaling`
        if isinstance(out, tuple):
            return out[0] / self.config.logits_scaling, out[1]
        return out / self.config.logits_scaling


def hybrid_recipes(model: HybridModel, config: ModelConfig, expert_names: tuple[str, str, str]
                   ) -> dict[str, list[list[list[str]]]]:
    """The loader's recipes (see `baton.model.loader._Recipe`: alternatives of parts of names) for
    a hybrid: q|gate, k, v fused; gate|up fused; experts stacked (transformers 5's 3D tensors or
    per expert); the shared expert and its gate under Qwen3-Next's names; every other parameter
    under its own name."""
    out = {name: [[[name]]] for name, _ in model.named_parameters(remove_duplicate=False)}
    gate_name, up_name, down_name = expert_names

    def dense(own: str, ckpt: str) -> None:
        out[f"{own}gate_up_proj.weight"] = [[[f"{ckpt}gate_up_proj.weight"]], [[f"{ckpt}gate_proj.weight",
                                                                              f"{ckpt}up_proj.weight"]]]
        out[f"{own}down_proj.weight"] = [[[f"{ckpt}down_proj.weight"]]]

    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        if layer.self_attn is not None:
            attn = p + "self_attn."
            for kind in ("weight", "bias") if config.attention_bias else ("weight",):
                out[f"{attn}qkv_proj.{kind}"] = [[[f"{attn}{n}_proj.{kind}" for n in "qkv"]]]
        if isinstance(model.dims, ShortConvDims):
            _lfm2_layer_names(out, p, layer)
            continue
        if isinstance(model.dims, Mamba2Dims):
            _granite_layer_names(out, p, layer)
            continue
        mlp = p + "mlp."
        if isinstance(layer.mlp, MLP):
            dense(mlp, mlp)
            continue
        experts = range(config.num_experts)
        out[f"{mlp}experts_gate_up"] = [
            [[f"{mlp}experts.gate_up_proj"]],
            [[f"{mlp}experts.{e}.{gate_name}.weight", f"{mlp}experts.{e}.{up_name}.weight"] for e in experts]]
        out[f"{mlp}experts_down"] = [[[f"{mlp}experts.down_proj"]],
                                     [[f"{mlp}experts.{e}.{down_name}.weight"] for e in experts]]
        if isinstance(layer.mlp.shared_experts, GatedSharedExpert):
            dense(f"{mlp}shared_experts.mlp.", f"{mlp}shared_expert.")
            out[f"{mlp}shared_experts.gate.weight"] = [[[f"{mlp}shared_expert_gate.weight"]]]
    if isinstance(model.dims, ShortConvDims):
        out["norm.weight"] = [[["embedding_norm.weight"]]]  # LFM2's final norm, named so (applied last)
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _granite_layer_names(out: dict[str, list[list[list[str]]]], p: str, layer: HybridLayer) -> None:
    # Granite 4.0-H's checkpoint names: the Mamba-2 mixer under `mamba.`, the dense MLP as
    # shared_mlp.input_linear (gate|up, fused as Baton's) / output_linear, the experts under
    # block_sparse_moe
    if layer.linear_attn is not None:
        for name, _ in layer.linear_attn.named_parameters():
            out[f"{p}linear_attn.{name}"] = [[[f"{p}mamba.{name}"]]]
    own = f"{p}mlp.shared_experts." if isinstance(layer.mlp, SparseMoE) else f"{p}mlp."
    out[f"{own}gate_up_proj.weight"] = [[[f"{p}shared_mlp.input_linear.weight"]]]
    out[f"{own}down_proj.weight"] = [[[f"{p}shared_mlp.output_linear.weight"]]]
    if isinstance(layer.mlp, SparseMoE):
        # as released (and as transformers 5 saves): router.layer, input_linear [E, 2I, H] (gate|up),
        # output_linear [E, H, I]; or transformers 5's in-memory names
        moe = p + "block_sparse_moe."
        out[f"{p}mlp.gate.weight"] = [[[f"{moe}router.layer.weight"]], [[f"{moe}router.weight"]]]
        out[f"{p}mlp.experts_gate_up"] = [[[f"{moe}input_linear.weight"]], [[f"{moe}experts.gate_up_proj"]]]
        out[f"{p}mlp.experts_down"] = [[[f"{moe}output_linear.weight"]], [[f"{moe}experts.down_proj"]]]


def _lfm2_layer_names(out: dict[str, list[list[list[str]]]], p: str, layer: HybridLayer) -> None:
    # LFM2's checkpoint names: operator_norm / ffn_norm, the short conv under `conv.`, the MLP as
    # feed_forward.w1 (gate) / w3 (up) / w2 (down), the attention's out_proj and q/k_layernorm
    out[f"{p}input_layernorm.weight"] = [[[f"{p}operator_norm.weight"]]]
    out[f"{p}post_attention_layernorm.weight"] = [[[f"{p}ffn_norm.weight"]]]
    ff = p + "feed_forward."
    out[f"{p}mlp.gate_up_proj.weight"] = [[[f"{ff}w1.weight", f"{ff}w3.weight"]]]
    out[f"{p}mlp.down_proj.weight"] = [[[f"{ff}w2.weight"]]]
    if layer.linear_attn is not None:
        for name, _ in layer.linear_attn.named_parameters():
            out[f"{p}linear_attn.{name}"] = [[[f"{p}conv.{name}"]]]
    else:
        attn = p + "self_attn."
        out[f"{attn}o_proj.weight"] = [[[f"{attn}out_proj.weight"]]]
        out[f"{attn}q_norm.weight"] = [[[f"{attn}q_layernorm.weight"]]]
        out[f"{attn}k_norm.weight"] = [[[f"{attn}k_layernorm.weight"]]]
