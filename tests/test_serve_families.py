"""`baton serve` on Gemma 3 (its window layers in block tables of their own, freed behind the
window), Qwen3-MoE, DeepSeek V3 (MLA: latent KV blocks handed off as any family's), Gemma 4 (the
E-style text model: per-layer inputs, wider global layers with K = V, layers sharing another's KV)
and gpt-oss (attention sinks, biased MoE, window tables): the whole system (gateway, a prefill and a
decode worker, the KV handed off through Redis) gives transformers' greedy tokens.

Each family's tiny random-init model is tests/test_families.py's (its transformers config class,
seeded, a 24-token sliding window for Gemma 3), served in float32 as a user would start it; the
prompts are longer than the window and are sent at once, so the decode worker batches them after
their handoff. A streamed chat in Japanese must end with its tokens, and the deployment must end
idle (no budget, no KV blocks held).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.serve_process import ServeProcess
from tests.test_families import N, PROMPT_LENS, VOCAB, build_family, hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SERVED = ("gemma3_text", "qwen3_moe", "deepseek_v3", "gemma4_text", "gpt_oss")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    import random

    rng = random.Random(8765)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]


async def _completions(base_url: str, prompts: list[list[int]]) -> list[str]:
    """Each prompt's greedy completion text, all sent at once."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        async def one(prompt: list[int]) -> str:
            r = await client.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == N
            return r.json()["choices"][0]["text"]

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def _streamed_chat(base_url: str) -> tuple[str, dict]:
    body = {"messages": [{"role": "user", "content": "東京の天気はどうですか？短く答えてください。"}],
            "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}
    text, usage, done = "", {}, False
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
            usage = chunk.get("usage") or usage
    assert done, "the stream did not end with [DONE]"
    return text, usage


@pytest.mark.parametrize("family", SERVED)
def test_baton_serve_gives_transformers_greedy_tokens(family, tmp_path, default_model_dir, prompts):
    model_dir = build_family(family, tmp_path / family, default_model_dir)
    assert_served_as_transformers(model_dir, prompts)


def assert_served_as_transformers(model_dir, prompts, min_blocks_fetched: int = 0) -> None:
    """`baton serve` of `model_dir` (float32) gives transformers' greedy tokens for `prompts` and a
    streamed chat of 12 tokens, and ends idle: no budget and no decode blocks held, and at least
    `min_blocks_fetched` full blocks loaded from the store by the decode workers (not recomputed)."""
    expected = [hf_greedy(model_dir, p) for p in prompts]
    with ServeProcess(["--model", str(model_dir), "--dtype", "float32"]) as serve:
        texts = asyncio.run(_completions(serve.base_url, prompts))
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        # the text of transformers' tokens (8 random-looking tokens: one wrong id changes it), but
        # for half a character at the end, which the gateway holds back (it never sends U+FFFD)
        assert texts == [tok.decode(e, skip_special_tokens=True).rstrip("\ufffd") for e in expected]
        _, usage = _streamed_chat(serve.base_url)
        assert usage["completion_tokens"] == 12
        # idle at the end: the budget at once, the decode worker's blocks by its next heartbeat
        # (/stats reads the workers' heartbeats, a second or so behind their last step)
        deadline = time.monotonic() + 15
        while True:
            stats = httpx.get(serve.base_url + "/stats", timeout=10).json()
            assert stats["token_budget"]["in_use"] == 0
            used = [w["num_kv_blocks_used"] for w in stats["workers"]["decode"]]
            fetched = sum(w.get("num_blocks_fetched", 0) for w in stats["workers"]["decode"])
            if used and not any(used) and fetched >= min_blocks_fetched:
                break
            assert time.monotonic() < deadline, (f"decode workers still hold KV blocks ({used}) or fetched "
                                                 f"{fetched} < {min_blocks_fetched}")
            time.sleep(0.2)
