"""Speculative decoding with the checkpoint's own multi-token-prediction layer (`{"method": "mtp"}`).

GLM-4.5 and DeepSeek V3 (MLA) checkpoints carry one MTP layer after their last layer; transformers
does not run it, so the tiny models here get one built from transformers' own decoder layer of the
family (seeded, scaled as the family's tiny model), with its enorm / hnorm / eh_proj / shared head.
What a user would notice, and what is checked:
- the output is the target's: greedy tokens equal transformers' with the head drafting (batched,
  chunked prefill, preempted and resumed), and the acceptance is counted in the engine's stats;
- the head computes what vLLM's DeepSeekMTP computes: every proposal equals a reference written here
  from transformers' decoder layer over the target's final hidden states (chained on the head's
  own output), so a trained checkpoint's acceptance is what its authors measured;
- a checkpoint without the layer, a hybrid model and a GGUF are refused with errors that say so.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams
from tests.test_engine_tiny import assert_pool_all_free
from tests.test_families import family_dir, greedy, hf_greedy, hf_model, prompts, tokens_of  # noqa: F401 (fixtures)
from tests.test_hybrid import hybrid_dir  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MTP_FAMILIES = ["glm4_moe", "deepseek_v3"]
_WITH_MTP: dict[str, Path] = {}


def _mtp_parts(model_dir: Path) -> dict[str, torch.Tensor]:
    """An MTP layer for the checkpoint: transformers' decoder layer at index L (the family's kind
    there: a MoE block), scaled as build_family scales weights, and the MTP's own tensors."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    layers = config.num_hidden_layers
    bigger = transformers.AutoConfig.from_pretrained(model_dir, num_hidden_layers=layers + 1)
    torch.manual_seed(1234)
    layer = transformers.AutoModelForCausalLM.from_config(bigger).model.layers[layers]
    hidden = config.hidden_size
    parts: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                tensor = torch.randn_like(tensor) * 0.3
            elif tensor.dim() >= 2:
                tensor = tensor * 5.0
            elif name.endswith("norm.weight"):
                tensor = tensor + 0.2 * torch.randn_like(tensor)
            elif name.endswith("bias"):
                tensor = torch.randn_like(tensor) * 0.1
            parts[name] = tensor.detach().clone()
        target = hf_model(model_dir)
        parts["enorm.weight"] = 1.0 + 0.2 * torch.randn(hidden)
        parts["hnorm.weight"] = 1.0 + 0.2 * torch.randn(hidden)
        parts["eh_proj.weight"] = torch.randn(hidden, 2 * hidden) * (5.0 / (2 * hidden) ** 0.5)
        # as released: the MTP layer's head and embedding are copies of the target's, its norm its own
        parts["shared_head.norm.weight"] = target.model.norm.weight.detach().clone() * (1.0 + 0.1 * torch.randn(hidden))
        parts["shared_head.head.weight"] = target.lm_head.weight.detach().clone()
        parts["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
    return {f"model.layers.{layers}.{name}": t.contiguous() for name, t in parts.items()}


@pytest.fixture(scope="module")
def mtp_dir(family_dir, tmp_path_factory):
    """family -> its tiny model with an MTP layer added (built once)."""
    import shutil

    from safetensors.torch import load_file, save_file

    def get(family: str) -> Path:
        if family not in _WITH_MTP:
            src = family_dir(family)
            out = tmp_path_factory.mktemp(f"mtp-{family}")
            shutil.copytree(src, out, dirs_exist_ok=True)
            tensors = load_file(out / "model.safetensors")
            tensors.update(_mtp_parts(src))
            save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
            _WITH_MTP[family] = out
        return _WITH_MTP[family]

    return get


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@torch.no_grad()
def reference_proposals(model_dir: Path, tokens: list[int], k: int) -> list[int]:
    """vLLM's DeepSeekMTP over transformers' modules, without a cache: the target's final hidden
    states h_0..h_{N-2}, the head at position p reading (t_{p+1}, h_p), chained k times on the
    head's own output before its final norm; the proposals are its argmaxes."""
    full, own, eps = _reference_modules(model_dir)
    layer = full.model.layers[-1]
    target_layers = full.model.layers[:-1]
    ids = torch.tensor([tokens])
    every = full.model.layers
    full.model.layers = target_layers
    try:
        h = full.model(ids, use_cache=False).last_hidden_state[0]  # [N, H]: after the target's final norm
    finally:
        full.model.layers = every

    def head_input(token: int, state: torch.Tensor) -> torch.Tensor:
        embedded = _rms(own["embed_tokens.weight"][token], own["enorm.weight"], eps)
        return torch.cat([embedded, _rms(state, own["hnorm.weight"], eps)]) @ own["eh_proj.weight"].T

    inputs = [head_input(tokens[p + 1], h[p]) for p in range(len(tokens) - 1)]
    proposals: list[int] = []
    for _ in range(k):
        x = torch.stack(inputs).unsqueeze(0)  # [1, P, H], positions 0..P-1
        positions = torch.arange(x.shape[1]).unsqueeze(0)
        mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_ids=positions,
                    position_embeddings=full.model.rotary_emb(x, positions))
        out = (out[0] if isinstance(out, tuple) else out)[0]
        logits = _rms(out[-1], own["shared_head.norm.weight"], eps) @ own["shared_head.head.weight"].T
        proposals.append(int(logits.argmax()))
        inputs.append(head_input(proposals[-1], out[-1]))
    return proposals


_REFERENCE: dict[Path, tuple] = {}


def _reference_modules(model_dir: Path) -> tuple:
    """transformers' model of the checkpoint with its MTP layer as one more decoder layer (loaded by
    from_pretrained from a config that counts it), the MTP layer's own tensors, and the norms' eps."""
    if model_dir not in _REFERENCE:
        import shutil
        import tempfile

        import transformers
        from safetensors.torch import load_file

        config = json.loads((model_dir / "config.json").read_text())
        layers = config["num_hidden_layers"]
        with tempfile.TemporaryDirectory() as tmp:
            for f in model_dir.iterdir():
                if f.is_file():
                    shutil.copy(f, Path(tmp) / f.name)
            (Path(tmp) / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers + 1}))
            full = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        prefix = f"model.layers.{layers}."
        own = {n.removeprefix(prefix): t.float() for n, t in load_file(model_dir / "model.safetensors").items()
               if n.startswith(prefix)}
        # the decoder layer loaded: its weights are the checkpoint's
        assert torch.equal(full.model.layers[layers].input_layernorm.weight, own["input_layernorm.weight"])
        _REFERENCE[model_dir] = (full, own, config["rms_norm_eps"])
    return _REFERENCE[model_dir]


def mtp_llm(model_dir: Path, k: int = 2, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 128)
    llm = LLM(model=str(model_dir), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": k},
              **kwargs)
    llm.engine.scheduler.speculator.costs.force = True  # verify every step (the cost model is tested elsewhere)
    return llm


def record_proposals(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens, the head's proposals after them) for every proposal the engine makes."""
    drafter, seen = llm.engine.drafter, []
    run = drafter.run

    def recording(job):
        run(job)
        seen.extend((list(seq.token_ids), list(seq.speculation.proposals)) for seq, _ in job.proposing)

    drafter.run = recording
    return seen


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_mtp_drafts_exactly_what_the_reference_head_proposes_and_the_output_is_the_targets(family, mtp_dir,
                                                                                           prompts):
    model_dir = mtp_dir(family)
    expected = [hf_greedy(model_dir, p) for p in prompts]
    llm = mtp_llm(model_dir, k=2)
    seen = record_proposals(llm)
    assert tokens_of(llm.generate(prompts, greedy())) == expected
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens >= stats.spec_num_drafts
    assert len(seen) == stats.spec_num_drafts
    # every proposal is the reference head's, chained ones included
    for tokens, proposals in seen:
        assert proposals == reference_proposals(model_dir, tokens, len(proposals)), tokens
    assert_pool_all_free(llm)


def test_mtp_output_is_exact_through_chunked_prefill_and_preemption(mtp_dir, prompts):
    """Prompts read 8 tokens a step (the head reads each chunk's hidden states the step after), and
    32 tokens each through a pool too small for all four (a request preempted and recomputed: the
    head's KV and unread states of it start over): the tokens speculation off gives."""
    model_dir = mtp_dir("glm4_moe")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    off = tokens_of(LLM(model=str(model_dir), dtype="float32", num_kv_blocks=256).generate(prompts, params))
    assert [o[:len(e)] for o, e in zip(off, [hf_greedy(model_dir, p) for p in prompts])] == [
        hf_greedy(model_dir, p) for p in prompts]
    for kwargs in ({"max_num_batched_tokens": 8}, {"block_size": 4, "num_kv_blocks": 30}):
        llm = mtp_llm(model_dir, k=3, **kwargs)
        seen = record_proposals(llm)
        assert tokens_of(llm.generate(prompts, params)) == off, kwargs
        assert llm.engine.stats().spec_num_drafts > 0
        if "num_kv_blocks" in kwargs:
            assert llm.engine.scheduler.num_preemptions > 0
        else:  # read chunk by chunk, the head's KV is whole: its proposals are still the reference's
            for tokens, proposals in seen[:6]:
                assert proposals == reference_proposals(model_dir, tokens, len(proposals))
        assert_pool_all_free(llm)


def test_an_mtp_head_that_agrees_with_the_target_is_accepted(mtp_dir, prompts, tmp_path):
    """With the head's proposals forced to the target's own next tokens (its logits replaced by the
    target's argmax), nearly every proposal is accepted: the acceptance the stats report is real
    and each verify step emits several tokens."""
    model_dir = mtp_dir("glm4_moe")
    expected = [hf_greedy(model_dir, p) for p in prompts]
    llm = mtp_llm(model_dir, k=2)
    drafter = llm.engine.drafter
    run = drafter.run
    future = {tuple(p): e for p, e in zip(prompts, expected)}

    def oracle(job):
        run(job)
        for seq, _ in job.proposing:  # what the target will emit after the request's tokens
            whole = list(seq.prompt_token_ids) + future[tuple(seq.prompt_token_ids)]
            n = seq.num_tokens
            seq.speculation.proposals = (whole[n:n + len(seq.speculation.proposals)]
                                         + [0] * len(seq.speculation.proposals))[:len(seq.speculation.proposals)]

    drafter.run = oracle
    assert tokens_of(llm.generate(prompts, greedy())) == expected
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens > 0.9, stats
    assert llm.engine.num_steps < sum(len(e) for e in expected)


def test_mtp_is_refused_where_it_cannot_run(family_dir, tmp_path):
    with pytest.raises(ValueError, match="no multi-token-prediction layers"):
        LLM(model=str(family_dir("qwen3")), dtype="float32", num_kv_blocks=16,
            speculative_config={"method": "mtp"})
    # the layer declared but absent from the checkpoint
    with pytest.raises(ValueError, match=r"carries no multi-token-prediction layer \(no layers\.4\.\* tensors\)"):
        LLM(model=str(family_dir("glm4_moe")), dtype="float32", num_kv_blocks=16,
            speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="not for method \"mtp\""):
        LLM(model=str(family_dir("glm4_moe")), dtype="float32", num_kv_blocks=16,
            speculative_config={"method": "mtp", "model": "x"})
    raw = json.loads((family_dir("glm4_moe") / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == 1


def test_baton_serve_drafts_with_the_mtp_layer_and_reports_its_acceptance(mtp_dir, prompts):
    """`baton serve --speculative-config '{"method": "mtp"}'` on DeepSeek V3 (MLA): the prompt's
    latent blocks handed off through Redis, the decode worker's head drafting after them (its KV of
    the handed-off prompt is zeros: the prefill worker computed it), transformers' greedy tokens, and
    the drafts and their acceptance on the decode worker's /metrics."""
    import httpx
    from transformers import AutoTokenizer

    from tests.serve_process import ServeProcess, free_port_run
    from tests.test_kv_cache_dtype import _metrics
    from tests.test_serve_families import _completions

    model_dir = mtp_dir("deepseek_v3")
    expected = [hf_greedy(model_dir, p) for p in prompts]
    tok = AutoTokenizer.from_pretrained(model_dir)
    metrics_port = free_port_run(2)  # the prefill worker's; the decode worker's is the next
    with ServeProcess(["--model", str(model_dir), "--dtype", "float32", "--worker-metrics-port", str(metrics_port),
                       "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']) as serve:
        texts = asyncio.run(_completions(serve.base_url, prompts))
        assert texts == [tok.decode(e, skip_special_tokens=True).rstrip("\ufffd") for e in expected]
        # one request alone, long enough for the worker's cost model to have measured a plain step
        # of one row and then to try verifying (it speculates only where that pays: here it explores)
        r = httpx.post(serve.base_url + "/v1/completions", timeout=120, json={
            "prompt": prompts[-1], "max_tokens": 48, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 48, r.text
        decode = _metrics(metrics_port + 1)
        drafts = decode["baton:worker_spec_decode_num_drafts_total"]
        assert drafts > 0 and decode["baton:worker_spec_decode_num_draft_tokens_total"] >= drafts
        assert "baton:worker_spec_decode_num_accepted_tokens_total" in decode
        assert "multi-token prediction: the checkpoint's MTP layer" in "".join(serve.err)


# ------------------------------------------------------------------ Qwen3.5's head (`mtp.*`) on a hybrid

def _qwen_mtp_parts(model_dir: Path) -> dict[str, torch.Tensor]:
    """Qwen3.5's MTP module for the tiny hybrid (`mtp.*`, as the released checkpoints carry it, vLLM's
    Qwen3NextMTP): transformers' full-attention decoder layer of the family, scaled as build_hybrid
    scales weights, fc and the two pre-fc norms, and its final norm ((1 + w) norms, offsets stored)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    layers, hidden = config.num_hidden_layers, config.hidden_size
    torch.manual_seed(2468)
    layer = _qwen_mtp_layer(model_dir)
    parts: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in layer.named_parameters():
            tensor = tensor * 5.0 if tensor.dim() >= 2 else tensor + 0.2 * torch.randn_like(tensor)
            parts[f"layers.0.{name}"] = tensor.detach().clone()
        parts["fc.weight"] = torch.randn(hidden, 2 * hidden) * (5.0 / (2 * hidden) ** 0.5)
        parts["pre_fc_norm_embedding.weight"] = 0.2 * torch.randn(hidden)
        parts["pre_fc_norm_hidden.weight"] = 0.2 * torch.randn(hidden)
        parts["norm.weight"] = hf_model(model_dir).model.norm.weight.detach().clone() + 0.2 * torch.randn(hidden)
    assert layers == 4
    return {f"mtp.{name}": t.contiguous() for name, t in parts.items()}


def _qwen_mtp_layer(model_dir: Path):
    """transformers' full-attention decoder layer of the checkpoint's family, at index L (one past the last)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    layers = config.num_hidden_layers
    bigger = transformers.AutoConfig.from_pretrained(model_dir, num_hidden_layers=layers + 1,
                                                     layer_types=[*config.layer_types, "full_attention"])
    module = transformers.AutoModelForCausalLM.from_config(bigger).model.layers[layers]
    return module.float().eval()


@pytest.fixture(scope="module")
def qwen_mtp_dir(hybrid_dir, tmp_path_factory):
    import shutil

    from safetensors.torch import load_file, save_file

    src = hybrid_dir("qwen3_5_text")
    out = tmp_path_factory.mktemp("mtp-qwen3_5_text")
    shutil.copytree(src, out, dirs_exist_ok=True)
    tensors = load_file(out / "model.safetensors")
    tensors.update(_qwen_mtp_parts(src))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@torch.no_grad()
def qwen_reference_proposals(model_dir: Path, tokens: list[int], k: int) -> list[int]:
    """vLLM's Qwen3NextMTP over transformers' modules, without a cache: fc over [(1 + w) norm of the
    token's embedding, (1 + w) norm of the target's final hidden state], the full-attention layer,
    the head's final norm, the target's LM head; chained on the head's normed output."""
    from safetensors.torch import load_file

    target = hf_model(model_dir)
    own = {n.removeprefix("mtp."): t.float() for n, t in load_file(model_dir / "model.safetensors").items()
           if n.startswith("mtp.")}
    layer = _qwen_mtp_layer(model_dir)
    layer.load_state_dict({n.removeprefix("layers.0."): t for n, t in own.items() if n.startswith("layers.0.")})
    eps = target.config.rms_norm_eps

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)

    h = target.model(torch.tensor([tokens]), use_cache=False).last_hidden_state[0]
    embed = target.model.embed_tokens.weight

    def head_input(token: int, state: torch.Tensor) -> torch.Tensor:
        both = torch.cat([norm(embed[token], own["pre_fc_norm_embedding.weight"]),
                          norm(state, own["pre_fc_norm_hidden.weight"])])
        return both @ own["fc.weight"].T

    inputs = [head_input(tokens[p + 1], h[p]) for p in range(len(tokens) - 1)]
    proposals: list[int] = []
    for _ in range(k):
        x = torch.stack(inputs).unsqueeze(0)
        positions = torch.arange(x.shape[1]).unsqueeze(0)
        mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
        out = layer(x, position_embeddings=target.model.rotary_emb(x, positions), attention_mask=mask,
                    position_ids=positions)
        normed = norm((out[0] if isinstance(out, tuple) else out)[0, -1], own["norm.weight"])
        proposals.append(int((normed @ target.lm_head.weight.T).argmax()))
        inputs.append(head_input(proposals[-1], normed))
    return proposals


def test_qwen3_5s_mtp_head_drafts_on_the_hybrid_as_the_reference_does(qwen_mtp_dir, prompts):
    """Qwen3.5's head (`mtp.*`: one gated-attention layer, its KV in a cache of its own) drafts on the
    hybrid target, whose verify rows step its state layers token by token: every proposal equals
    the reference's, and the tokens are transformers'."""
    expected = [hf_greedy(qwen_mtp_dir, p) for p in prompts]
    llm = mtp_llm(qwen_mtp_dir, k=2)
    assert "multi-token prediction" in llm.engine.drafter.runtime.model.describe()
    seen = record_proposals(llm)
    assert tokens_of(llm.generate(prompts, greedy())) == expected
    assert llm.engine.stats().spec_num_drafts == len(seen) > 0
    for tokens, proposals in seen:
        assert proposals == qwen_reference_proposals(qwen_mtp_dir, tokens, len(proposals)), tokens
    assert_pool_all_free(llm)


def test_the_mtp_cursor_reads_each_hidden_state_once_and_skips_what_it_never_saw():
    """The head's cursor (pure logic): states of computed positions are kept until read; positions
    this engine never computed (a handoff's prompt, a prefix hit) are skipped, not waited for; a
    preemption drops the states of the positions it recomputes; a verify row keeps its accepted
    positions' states after the ones already unread."""
    from baton.engine.draft_cursor import MtpCursor

    def states(start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end, dtype=torch.float32)[:, None]

    table, bs = [1, 2, 3, 4], 4
    cursor = MtpCursor()
    assert cursor.valid(table, 10, 0, bs) == 10  # a handed-off prompt: nothing to read, skipped
    # and again, the head not having run in between (a step that did not verify): still skipped
    assert cursor.valid(table, 10, 0, bs) == 10 and cursor.blocks == [1, 2, 3]
    cursor.record(10, states(10, 11), 0)  # the first decode step computed position 10
    cursor.done = cursor.valid(table, 11, 0, bs)
    assert (cursor.done, cursor.hidden_start, cursor.hidden_end) == (10, 10, 11)
    cursor.advance(11, table, 0, bs)
    assert cursor.hidden is None and cursor.done == 11
    # a verify step kept positions 11..13 (two accepted), then a plain one kept 14
    cursor.record(11, states(11, 14), 0)
    cursor.record(14, states(14, 15), 0)
    assert cursor.valid(table, 15, 0, bs) == 11 and cursor.unread(11, 15)[:, 0].tolist() == [11, 12, 13, 14]
    # preempted: recomputed from a prefix hit at 8, its states arrive from there
    cursor.record(8, states(8, 12), 1)
    assert cursor.valid(table, 12, 1, bs) == 8 and cursor.unread(8, 12)[:, 0].tolist() == [8, 9, 10, 11]
    assert cursor.valid(table, 12, 2, bs) == 12 and cursor.hidden is None  # preempted again before reading
