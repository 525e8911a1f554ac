"""int8 weights (issue 23): GGUF Q8_0 blocks of 32, quantized at load, multiplied by the native
integer kernel. The kernel equals its integer reference to rounding and its dequantized reference
to the activations' quantization; a row's numbers do not depend on the batch; the quantized model's
perplexity on real text stays within 1% of bf16's, and each weight exists once."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from baton.engine import kernels
from baton.engine.linear import Q8Linear, dequantize_q8_0
from baton.engine.quant import quantize_q8_0

# A fixed text of ~500 tokens: perplexity over a few dozen tokens moves by percents with noise alone.
TEXT = """The history of the city begins with a small fishing village on the bank of a wide river. Over
the centuries it grew into a busy port, and its merchants traded wool, salt and timber with the towns
along the coast. In the winter the river froze, and the boats stayed in the harbour until spring.
The old market square was the heart of the town. Farmers brought vegetables, cheese and eggs from the
villages around, and on feast days musicians played under the lime trees while children ran between
the stalls. The church on the north side of the square was built of grey stone, and its bell could be
heard from the hills. Later, when the railway reached the valley, factories were built along the
water, and the population doubled within twenty years. Workers came from the countryside to find jobs
in the mills, and new streets of small brick houses spread up the slopes. The town council built
schools, a library and a hospital, and the first electric trams ran along the main street in the year
the bridge was finished. During the war many of the factories closed, and some were never opened again.
After the war the town slowly changed. The mills became offices and apartments, the harbour was
cleaned, and a park was laid out where the coal yards had been. Today the old harbour is a museum, and
visitors walk along the quays where ships once unloaded their cargo. In the summer there is a festival
of music and theatre, and the restaurants on the riverside are full until late at night. Students from
the university fill the cafes, and on Saturday mornings the market still opens on the square, with
bread, fruit and flowers, as it has for five hundred years. Those who grew up here say that the town
has kept its character: a place of work and trade, proud of its past, but never afraid of change."""


@pytest.fixture(scope="module")
def native():
    module = kernels.load()
    if module is None or not module.q8_available():
        pytest.skip("the native int8 kernel needs AVX512-VNNI and a compiler")
    return module


def integer_reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes: x quantized per row and block of 32 (s = amax / 127), each block's
    dot product exact, scaled by s * d, summed in fp64."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    s = blocks.abs().amax(-1) / 127
    p = torch.where(s.unsqueeze(-1) > 0, (blocks / s.unsqueeze(-1)).round(), torch.zeros_like(blocks))
    wq = q.double().reshape(q.shape[0], k // 32, 32)
    dots = torch.einsum("mbi,nbi->mnb", p.double(), wq)  # [M, N, blocks], exact integers
    out = (dots * s.double().unsqueeze(1) * d.double().unsqueeze(0)).sum(-1)
    return out + (bias.double() if bias is not None else 0)


def test_q8_0_quantization_is_within_half_a_step_of_the_weight():
    torch.manual_seed(0)
    w = torch.randn(70, 96) * torch.logspace(-3, 1, 96)  # blocks of very different scales
    q, d = quantize_q8_0(w)
    assert q.dtype == torch.int8 and d.shape == (70, 3) and int(q.abs().max()) <= 127
    error = (dequantize_q8_0(q, d) - w).abs().reshape(70, 3, 32)
    assert bool((error <= d.unsqueeze(-1) / 2 + 1e-7).all())
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.randn(4, 48))


@pytest.mark.parametrize("shape", [(1, 576, 1536), (5, 64, 33), (13, 128, 100), (40, 96, 64)])
def test_the_kernel_equals_its_integer_reference_and_the_dequantized_matmul(native, shape):
    m, k, n = shape
    torch.manual_seed(m * 1000 + n)
    q, d = quantize_q8_0(torch.randn(n, k))
    bias = torch.randn(n)
    x = torch.randn(m, k).bfloat16()
    op = Q8Linear(q, d, bias, native)
    out = native.q8_gemv(x, op.packed, op.bias, n, True)
    ref = integer_reference(x, q, d, bias)
    scale = ref.abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 1e-5 * scale  # fp32 accumulation only
    dequantized = F.linear(x.float(), dequantize_q8_0(q, d), bias)
    assert (out - dequantized).abs().max().item() <= 0.02 * scale  # the activations' quantization
    assert torch.equal(op(x), out.bfloat16())  # bf16 out: the fp32 result rounded to nearest even
    assert op(x.float()).dtype == torch.float32


def test_a_rows_result_does_not_depend_on_the_batch(native):
    torch.manual_seed(1)
    q, d = quantize_q8_0(torch.randn(96, 256))
    op = Q8Linear(q, d, None, native)
    x = torch.randn(11, 256).bfloat16()
    together = op(x)
    for i in (0, 5, 10):
        assert torch.equal(op(x[i:i + 1])[0], together[i])
    assert torch.equal(op(x[3:9]), together[3:9])


def test_without_the_kernel_the_weight_is_dequantized_per_call():
    torch.manual_seed(2)
    q, d = quantize_q8_0(torch.randn(40, 64))
    op = Q8Linear(q, d, None, kernels=None)
    x = torch.randn(3, 64)
    assert not op.native and torch.equal(op(x), F.linear(x, dequantize_q8_0(q, d)))


def _perplexity(llm, token_ids: list[int]) -> float:
    from baton import SamplingParams

    [out] = llm.generate([token_ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    logprobs = [entry[0] for entry in out.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


def test_int8_weights_keep_perplexity_within_1_percent_and_live_once(native, default_model_dir):
    from baton import LLM
    bf16 = LLM(model=str(default_model_dir), dtype="bfloat16", enable_prefix_caching=False, max_num_batched_tokens=1024)
    ids = bf16.tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 350
    reference = _perplexity(bf16, ids)
    int8 = LLM(model=str(default_model_dir), dtype="bfloat16", enable_prefix_caching=False, quantization="int8",
               max_num_batched_tokens=1024)
    quantized = _perplexity(int8, ids)
    assert abs(quantized / reference - 1) < 0.01, (reference, quantized)
    model = int8.engine.model
    ops = [getattr(owner, name) for owner, name, _ in model.projection_slots()]
    assert all(isinstance(op, Q8Linear) and op.native for op in ops)
    # one copy: every projection's own weight is gone (the tied embedding keeps its rows for lookups)
    tied = model.lm_head.weight is model.embed_tokens.weight
    assert all(linear.weight.numel() == 0 for _, _, linear in model.projection_slots() if not (tied and linear is model.lm_head))
    # and greedy text starts the same on a plain prompt
    from baton import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0)
    prompt = "The capital of France is"
    assert int8.generate(prompt, params)[0].outputs[0].token_ids[:3] == bf16.generate(prompt, params)[0].outputs[0].token_ids[:3]


def test_a_decode_step_runs_all_int8_layers_in_one_native_call_with_the_python_loops_numbers(native, default_model_dir):
    """The all-layers decode call (kernels/decode_layers.cpp) multiplies the int8 packs too: the
    decode worker's every step, at the Python loop's numbers bit for bit."""
    from baton import LLM, SamplingParams

    llm = LLM(model=str(default_model_dir), dtype="bfloat16", enable_prefix_caching=False, quantization="int8")
    model = llm.engine.model
    assert model.layers_plan is not None
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=0)
    prompts = ["The capital of France is", "Écris un poème sur la mer", "数学は"]
    planned = [o.outputs[0] for o in llm.generate(prompts, params)]
    plan, model.layers_plan = model.layers_plan, None
    try:
        looped = [o.outputs[0] for o in llm.generate(prompts, params)]
    finally:
        model.layers_plan = plan
    assert [o.token_ids for o in planned] == [o.token_ids for o in looped]
    assert [o.logprobs for o in planned] == [o.logprobs for o in looped]
