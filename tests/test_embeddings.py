"""Embeddings (POST /v1/embeddings, TEI's POST /embed): the engine's pooling against transformers'
hidden states, the checkpoint's pooling config, and the real cluster through the openai SDK."""

from __future__ import annotations

import pytest
import torch

from baton.common.sampling_params import SamplingParams
from baton.engine.pooling import Pooling

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings", "a b c d e f g h i j k l m n o p q r s t u v w"]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_model_dir))


def reference(hf_model, text: str, pooling: str) -> torch.Tensor:
    """transformers' last_hidden_state pooled and L2-normalized (sentence-transformers' way)."""
    model, tokenizer = hf_model
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        states = model(ids).last_hidden_state[0]
    pooled = {"last": states[-1], "mean": states.mean(dim=0), "cls": states[0]}[pooling]
    return torch.nn.functional.normalize(pooled, dim=0)


def make_llm(tiny_model_dir, **kwargs):
    from baton.llm import LLM

    return LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_model_dir, one_torch_thread):
    return make_llm(tiny_model_dir)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embed_matches_transformers(llm, hf_model, pooling):
    outputs = llm.embed(TEXTS, pooling=pooling)
    assert len(outputs) == len(TEXTS)
    for text, out in zip(TEXTS, outputs):
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == (64,)
        assert torch.allclose(got, reference(hf_model, text, pooling), atol=1e-4), (pooling, text)
        assert abs(float(got.norm()) - 1.0) < 1e-5


def test_embed_unnormalized_is_the_raw_pooled_state(llm, hf_model):
    model, tokenizer = hf_model
    raw = llm.embed(TEXTS[0], pooling="mean", normalize=False)[0].outputs.embedding
    with torch.no_grad():
        states = model(torch.tensor([tokenizer.encode(TEXTS[0])])).last_hidden_state[0]
    assert torch.allclose(torch.tensor(raw), states.mean(dim=0), atol=1e-4)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embed_chunked_and_batched_with_generation(tiny_model_dir, hf_model, one_torch_thread, pooling):
    """Small step budget: every prompt is split over several steps, in the same steps as two
    generations, whose output must be the same as when they run alone."""
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=5)
    engine = llm.engine
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate([TEXTS[0], TEXTS[2]], greedy)]
    gen_prompts = [llm.tokenizer.encode(t, add_special_tokens=False) for t in (TEXTS[0], TEXTS[2])]
    for i, ids in enumerate(gen_prompts):
        engine.add_request(f"g{i}", ids, greedy)
    for i, text in enumerate(TEXTS):
        engine.add_request(f"e{i}", llm.tokenizer.encode(text), SamplingParams(max_tokens=1), pooling=Pooling(pooling))
    tokens: dict[str, list[int]] = {"g0": [], "g1": []}
    vectors: dict[str, list[float]] = {}
    mixed_steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        kinds = {o.request_id[0] for o in outs}
        mixed_steps += kinds == {"g", "e"}
        for out in outs:
            assert out.finish_reason is None or out.finish_reason.ended_normally, out.error
            if out.request_id.startswith("g"):
                tokens[out.request_id] += out.new_token_ids
            elif out.finished:
                assert out.embedding is not None and out.new_token_ids == ()
                vectors[out.request_id] = list(out.embedding)
    assert mixed_steps >= 1
    assert [tokens["g0"], tokens["g1"]] == alone
    for i, text in enumerate(TEXTS):
        got = torch.nn.functional.normalize(torch.tensor(vectors[f"e{i}"]), dim=0)
        assert torch.allclose(got, reference(hf_model, text, pooling), atol=1e-4), (pooling, text)
    assert engine.stats().num_kv_blocks_used == 0  # the pooling requests' blocks went back at once


def test_embed_twice_with_prefix_cache(llm, hf_model):
    """The second time a prompt comes, its blocks are in the prefix cache: mean still pools every
    token (it reads no cache), last may skip them."""
    text = TEXTS[2] * 3
    for pooling in ("mean", "last", "mean", "last"):
        got = torch.tensor(llm.embed(text, pooling=pooling)[0].outputs.embedding)
        assert torch.allclose(got, reference(hf_model, text, pooling), atol=1e-4), pooling


def test_embed_abort_frees_blocks(llm):
    engine = llm.engine
    used = engine.stats().num_kv_blocks_used
    engine.add_request("gone", list(range(10, 60)), SamplingParams(max_tokens=1), pooling=Pooling.MEAN)
    engine.abort(["gone"])
    assert not engine.has_unfinished()
    assert engine.stats().num_kv_blocks_used == used


def test_pooling_request_refuses_handoff(llm):
    with pytest.raises(ValueError, match="pooling"):
        llm.engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=1), pooling=Pooling.LAST,
                               remote_decode=True)


# ---- the checkpoint's pooling config (sentence-transformers' files) ----

def write_st_checkpoint(path, modes: dict, normalize: bool, config: bool = True) -> None:
    import json

    if config:
        (path / "config.json").write_text(json.dumps({"hidden_size": 32}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **modes}))


@pytest.mark.parametrize("mode, pooling", [("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                                           ("pooling_mode_cls_token", "cls")])
def test_checkpoint_pooling_config_is_read(tmp_path, mode, pooling):
    from gateway.embeddings.pooling_config import resolve

    write_st_checkpoint(tmp_path, {"pooling_mode_mean_tokens": False, mode: True}, normalize=pooling != "cls")
    config = resolve(tmp_path)
    assert (config.pooling, config.normalize, config.hidden_size, config.source) == (
        pooling, pooling != "cls", 32, "checkpoint")
    # a flag wins over the checkpoint
    flagged = resolve(tmp_path, "cls" if pooling != "cls" else "mean", True)
    assert flagged.source == "flag" and flagged.normalize and flagged.pooling != pooling


def test_pooling_defaults_and_refusals(tmp_path):
    import json

    from gateway.embeddings.pooling_config import resolve

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 48}))
    assert resolve(tmp_path) == resolve(tmp_path, None, None)
    assert (resolve(tmp_path).pooling, resolve(tmp_path).normalize, resolve(tmp_path).source) == ("last", True, "default")
    odd = tmp_path / "odd"
    odd.mkdir()
    write_st_checkpoint(odd, {"pooling_mode_max_tokens": True}, normalize=True)
    with pytest.raises(ValueError, match="pooling_mode_max_tokens.*--pooling"):
        resolve(odd)
    assert resolve(odd, "mean").pooling == "mean"  # a flag lets it serve anyway


async def test_a_pooling_baton_does_not_run_is_a_501_and_chat_still_answers(tmp_path, default_model_dir,
                                                                            gw_tokenizer, caplog):
    """A checkpoint that pools with max: the gateway says so at start-up, each embedding request
    gets a 501 naming --pooling, and the model still chats."""
    import httpx

    from baton.common.finish_reason import FinishReason
    from baton.common.protocol import TokenEvent
    from gateway.app import create_app, in_memory_runtime
    from gateway.backend import InMemoryBackend
    from gateway.config import Settings

    model = tmp_path / "max-pooled"
    model.mkdir()
    for f in default_model_dir.iterdir():  # links, never writes through to the shared model
        (model / f.name).symlink_to(f)
    write_st_checkpoint(model, {"pooling_mode_max_tokens": True}, normalize=True, config=False)
    reply = gw_tokenizer.encode_text("Hi.", add_special_tokens=False)
    backend = InMemoryBackend(lambda req: [TokenEvent(req.request_id, 0, reply, [-0.5] * len(reply), FinishReason.STOP,
                                                      num_prompt_tokens=len(req.prompt_token_ids))])
    settings = Settings(model_dir=model, max_batch_total_tokens=100_000, event_timeout=10.0)
    with caplog.at_level("WARNING", logger="gateway.app"):
        app = create_app(settings, tokenizer=gw_tokenizer, runtime=in_memory_runtime(backend))
    assert any("embeddings are off" in r.getMessage() and "pooling_mode_max_tokens" in r.getMessage()
               for r in caplog.records)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            r = await client.post("/v1/embeddings", json={"input": "hello"})
            assert r.status_code == 501 and "--pooling" in r.json()["error"]["message"], r.text
            r = await client.post("/embed", json={"inputs": "hello"})
            assert r.status_code == 501 and "--pooling" in r.json()["error"], r.text
            r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hey"}]})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hi.", r.text


def test_gateway_flags(tiny_model_dir, monkeypatch):
    from gateway.__main__ import parse_args

    model = tiny_model_dir
    settings = parse_args(["--model", str(model), "--pooling", "mean", "--no-normalize"])
    assert (settings.pooling, settings.normalize) == ("mean", False)
    monkeypatch.setenv("BATON_NORMALIZE", "1")
    assert parse_args(["--model", str(model)]).normalize is True
    monkeypatch.delenv("BATON_NORMALIZE")
    assert parse_args(["--model", str(model)]).normalize is None


# ---- through the real system: the openai SDK and TEI's /embed over HTTP ----

@pytest.fixture(scope="module")
def cluster(default_model_dir):
    from tests.cluster import Cluster

    # prompts up to 1024 tokens (not the model's 8191), so that the length checks below stay cheap
    with Cluster(default_model_dir, prefill=1, decode=1, gateway_args=("--max-input-tokens", "1024")) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    from openai import OpenAI

    return OpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def default_reference(default_model_dir):
    """transformers' last token state of the default model, normalized (what the gateway serves:
    no sentence-transformers files, so last + normalize)."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(default_model_dir), torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))

    def embed(text: str) -> torch.Tensor:
        with torch.no_grad():
            states = model(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0]
        return torch.nn.functional.normalize(states[-1], dim=0)

    return embed, tokenizer


def budget_in_use(cluster) -> int:
    """The token budget and the embeddings lane in use (embeddings are admitted in the lane)."""
    import httpx

    stats = httpx.get(cluster.base_url + "/stats", timeout=5).json()
    return stats["token_budget"]["in_use"] + stats["embeddings"]["tokens_in_use"]


def wait_budget_free(cluster, timeout: float = 20.0) -> bool:
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        if budget_in_use(cluster) == 0:
            return True
        time.sleep(0.1)
    return False


def test_openai_embeddings_string_list_and_token_ids(cluster, client, default_reference):
    embed, tokenizer = default_reference
    one = client.embeddings.create(model=cluster.model_dir.name, input=TEXTS[0],
                                   encoding_format="float")
    assert one.object == "list" and len(one.data) == 1 and one.data[0].index == 0
    vector = torch.tensor(one.data[0].embedding)
    assert vector.shape == (576,)
    assert torch.allclose(vector, embed(TEXTS[0]), atol=1e-3)
    ids = tokenizer.encode(TEXTS[0])
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids)
    batch = client.embeddings.create(model=cluster.model_dir.name, input=TEXTS, encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1, 2]
    for text, item in zip(TEXTS, batch.data):
        assert torch.allclose(torch.tensor(item.embedding), embed(text), atol=1e-3)
    assert batch.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    by_ids = client.embeddings.create(model=cluster.model_dir.name, input=ids, encoding_format="float")
    assert torch.allclose(torch.tensor(by_ids.data[0].embedding), vector, atol=1e-5)
    lists = client.embeddings.create(model=cluster.model_dir.name, input=[ids, ids[:3]], encoding_format="float")
    assert len(lists.data) == 2 and lists.usage.prompt_tokens == len(ids) + 3
    assert wait_budget_free(cluster)


def test_openai_embeddings_base64_and_dimensions(cluster, client):
    name = cluster.model_dir.name
    floats = client.embeddings.create(model=name, input=TEXTS[1], encoding_format="float").data[0].embedding
    # the SDK asks for base64 when no encoding_format is given, and decodes it (little-endian float32)
    decoded = client.embeddings.create(model=name, input=TEXTS[1]).data[0].embedding
    assert len(decoded) == 576 and torch.allclose(torch.tensor(decoded), torch.tensor(floats), atol=1e-6)
    # asked for explicitly, the SDK hands the string over: little-endian float32 bytes
    import base64

    import numpy as np

    explicit = client.embeddings.create(model=name, input=TEXTS[1], encoding_format="base64").data[0].embedding
    assert isinstance(explicit, str)
    raw = np.frombuffer(base64.b64decode(explicit), dtype="<f4")
    assert torch.allclose(torch.from_numpy(raw.copy()), torch.tensor(floats), atol=1e-6)
    short = client.embeddings.create(model=name, input=TEXTS[1], dimensions=64, encoding_format="float")
    cut = torch.nn.functional.normalize(torch.tensor(floats[:64]), dim=0)
    assert len(short.data[0].embedding) == 64
    assert torch.allclose(torch.tensor(short.data[0].embedding), cut, atol=1e-5)


def test_openai_embeddings_validation_names_the_field(cluster, client):
    import openai

    name = cluster.model_dir.name
    cases = [({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["a", ""]}, "input[1]"),
             ({"input": ["a"] * 2049}, "input"), ({"input": "a", "dimensions": 577}, "dimensions"),
             ({"input": [[1, 2], []]}, "input[1]"), ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
             ({"input": list(range(1025))}, "input")]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model=name, **body)
        assert info.value.body["param"] == param, body  # type: ignore[index]
        assert f"`{param}`" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="a")
    # too long, but truncate_prompt_tokens keeps the last tokens instead
    cut = client.embeddings.create(model=name, input=list(range(5, 1105)), encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 100})
    assert cut.usage.prompt_tokens == 100
    tail = client.embeddings.create(model=name, input=list(range(1005, 1105)), encoding_format="float")
    assert torch.allclose(torch.tensor(cut.data[0].embedding), torch.tensor(tail.data[0].embedding), atol=1e-5)
    assert wait_budget_free(cluster)


def test_tei_embed(cluster):
    import httpx

    url = cluster.base_url + "/embed"
    reply = httpx.post(url, json={"inputs": TEXTS[:2]}, timeout=60)
    assert reply.status_code == 200, reply.text
    vectors = torch.tensor(reply.json())
    assert vectors.shape == (2, 576)
    assert torch.allclose(vectors.norm(dim=1), torch.ones(2), atol=1e-5)
    single = httpx.post(url, json={"inputs": TEXTS[0], "normalize": False}, timeout=60).json()
    raw = torch.tensor(single[0])
    assert abs(float(raw.norm()) - 1.0) > 1e-2
    assert torch.allclose(torch.nn.functional.normalize(raw, dim=0), vectors[0], atol=1e-5)
    long_text = "word " * 1500
    refused = httpx.post(url, json={"inputs": long_text}, timeout=60)
    assert refused.status_code == 422 and refused.json()["error_type"] == "validation"
    assert "`inputs`" in refused.json()["error"]
    kept = httpx.post(url, json={"inputs": long_text, "truncate": True, "truncation_direction": "Left"}, timeout=60)
    assert kept.status_code == 200 and len(kept.json()[0]) == 576
    for body, field in [({"inputs": []}, "inputs"), ({"inputs": "a", "prompt_name": "query"}, "prompt_name"),
                        ({"inputs": "a", "normalize": "yes"}, "normalize")]:
        bad = httpx.post(url, json=body, timeout=60)
        assert bad.status_code == 422 and f"`{field}`" in bad.json()["error"], bad.text
    ignored = httpx.post(url, json={"inputs": "a", "colour": 1}, timeout=60)
    assert ignored.status_code == 200 and ignored.headers["x-baton-ignored-fields"] == "colour"
    assert wait_budget_free(cluster)


def test_client_leaving_releases_the_budget_and_generation_still_works(cluster, client):
    import httpx

    with pytest.raises(httpx.TimeoutException):
        httpx.post(cluster.base_url + "/v1/embeddings", json={"input": ["many words " * 300] * 32},
                   timeout=httpx.Timeout(0.3))
    assert wait_budget_free(cluster)
    chat = client.chat.completions.create(model=cluster.model_dir.name, max_tokens=4,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.content
    metrics = httpx.get(cluster.base_url + "/metrics", timeout=5).text
    count = [line for line in metrics.splitlines() if line.startswith("baton:embedding_inputs_total")]
    assert count and float(count[0].split()[-1]) >= 10
    assert wait_budget_free(cluster)


def prefill_entries_added(cluster) -> int:
    from baton.common.protocol import PREFILL_STREAM

    info = cluster.client.xinfo_stream(PREFILL_STREAM)
    return int(info.get("entries-added", info.get(b"entries-added")))


def test_300_inputs_are_one_stream_entry_with_the_vectors_of_300_requests(cluster, client, default_reference):
    """Issue 38: each input was its own prefill job (one XADD each); now a request is one job, and
    batching changes no vector."""
    _, tokenizer = default_reference
    name = cluster.model_dir.name
    texts = [f"{i} {('fox', 'river', 'lamp')[i % 3]}" for i in range(300)]  # 2-4 tokens each: a short test
    before = prefill_entries_added(cluster)
    batch = client.embeddings.create(model=name, input=texts, encoding_format="float")
    assert prefill_entries_added(cluster) == before + 1
    assert [d.index for d in batch.data] == list(range(300))
    assert batch.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)
    for i in (0, 1, 150, 299):
        one = client.embeddings.create(model=name, input=texts[i], encoding_format="float")
        assert torch.allclose(torch.tensor(one.data[0].embedding), torch.tensor(batch.data[i].embedding), atol=1e-4), i
    assert wait_budget_free(cluster)


async def test_a_chat_sent_during_a_big_batch_gets_its_first_token_before_the_batch_ends(cluster):
    """Issue 38: a chat queued behind 2048 prefill jobs waited for all of them. Now the worker reads
    past the batch and runs the chat's prompt between two short embeddings steps. The batch is then
    abandoned by its client: the worker drops it and its budget comes back."""
    import asyncio

    import httpx

    texts = [f"{i} the quick brown fox jumps over the lazy dog again and again" for i in range(2048)]
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as http:
        batch = asyncio.create_task(http.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"}))
        for _ in range(100):  # until the worker has it (the gateway admitted it; the worker reads at once)
            await asyncio.sleep(0.1)
            if (await http.get("/stats")).json()["embeddings"]["running"] == 1:
                break
        await asyncio.sleep(0.5)
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
        first_token_while_batch_ran = None
        async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if first_token_while_batch_ran is None and '"content":"' in line.replace(" ", ""):
                    first_token_while_batch_ran = not batch.done()
        assert first_token_while_batch_ran, "the chat's first token came only after the embeddings batch"
        batch.cancel()  # the client leaves: the gateway cancels the batch at the worker
        await asyncio.gather(batch, return_exceptions=True)  # (the socket closes as the task unwinds)
    # Polled off this loop: a blocking wait here would keep the loop from closing the socket, and the
    # budget would only come back once the batch had run to its end.
    assert await asyncio.to_thread(wait_budget_free, cluster)
    for _ in range(100):
        if cluster.client.xpending("{baton}:prefill", "prefill")["pending"] == 0:
            break
        await asyncio.sleep(0.1)
    assert cluster.client.xpending("{baton}:prefill", "prefill")["pending"] == 0


async def test_the_loop_answers_while_big_embed_requests_are_tokenized(cluster):
    """Issue 38: 8 /embed requests of 2048 inputs x ~470 characters held the gateway's loop 3.3 s
    (each input tokenized inline before any check). Now they are tokenized off the loop in one
    batch call each (and answered 422: far past max_embedding_tokens), while /health answers."""
    import asyncio
    import time

    import httpx

    texts = [(f"{i} " + "lorem ipsum dolor sit amet, consectetur adipiscing elit " * 9)[:470] for i in range(2048)]
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as http:
        latencies: list[float] = []

        async def probe() -> None:
            while True:
                started = time.perf_counter()
                assert (await http.get("/health")).status_code == 200
                latencies.append(time.perf_counter() - started)
                await asyncio.sleep(0.02)

        prober = asyncio.create_task(probe())
        replies = await asyncio.gather(*[http.post("/embed", json={"inputs": texts}) for _ in range(4)])
        prober.cancel()
    for reply in replies:
        assert reply.status_code == 422 and "max_embedding_tokens" in reply.json()["error"], reply.text
    # (inline, the loop answered one /health in the whole run; off the loop, ~0.1 s at most on 2 busy cores)
    assert len(latencies) >= 10 and max(latencies) < 1.0, (len(latencies), sorted(latencies)[-5:])


def test_openapi_documents_embeddings_and_every_field_is_accepted(cluster):
    import httpx

    spec = httpx.get(cluster.base_url + "/openapi.json", timeout=5).json()
    assert "post" in spec["paths"]["/v1/embeddings"] and "post" in spec["paths"]["/embed"]
    samples = {"openai": ("/v1/embeddings", "EmbeddingsRequest", {
        "input": "x", "model": cluster.model_dir.name, "encoding_format": "float", "dimensions": 8, "user": "u",
        "truncate_prompt_tokens": 4}),
        "tei": ("/embed", "EmbedRequest", {"inputs": "x", "normalize": True, "truncate": True,
                                           "truncation_direction": "right", "prompt_name": None})}
    for path, schema, body in samples.values():
        assert set(spec["components"]["schemas"][schema]["properties"]) == set(body), schema
        reply = httpx.post(cluster.base_url + path, json=body, timeout=60)
        assert reply.status_code == 200 and "x-baton-ignored-fields" not in reply.headers, reply.text


def test_baton_serve_passes_the_embedding_flags_to_the_gateway():
    import argparse
    from pathlib import Path

    from baton.cli.serve import ThreadPlan, add_serve_arguments, build_child_specs
    from gateway.__main__ import parse_args
    from tests.test_cli import child_config

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--pooling", "cls", "--no-normalize"])
    gateway = child_config(build_child_specs(args, Path("/m"), "redis://127.0.0.1:1/0", ThreadPlan([1], [1], cpus=2),
                                             python="py")[-1])
    assert gateway.pooling == "cls" and gateway.normalize is False
    with pytest.raises(SystemExit):  # the gateway refuses a pooling it does not run, at startup
        parse_args(["--model", "/m", "--pooling", "max"])
    # and so does baton serve, before any worker loads the model (the parsers' names too)
    for flag, typo in (("--pooling", "max"), ("--tool-call-parser", "hermès"), ("--reasoning-parser", "r1")):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, typo])
    assert parser.parse_args(["--tool-call-parser", "pythonic"]).tool_call_parser == "pythonic"


# ---- the prefill worker's core: one event with the vector, no handoff, acked; redelivery; cancel ----

def test_prefill_core_publishes_the_vector_and_hands_nothing_off(tiny_model_dir, hf_model, one_torch_thread):
    from baton.common import protocol
    from baton.worker.core import Opening
    from tests.test_worker_core import assert_pool_free, drive, events_of, fields_of, new_store, prefill_core

    model, tokenizer = hf_model
    ids = tokenizer.encode(TEXTS[2])
    with torch.no_grad():
        expected = model(torch.tensor([ids])).last_hidden_state[0].mean(dim=0)
    message = protocol.PrefillRequest("e1", "gw", ids, SamplingParams(max_tokens=1), 0.0, pooling="mean")
    for deliveries in (1, 2):  # 2: a dead worker's message, claimed by another worker, runs again
        core, store = prefill_core(tiny_model_dir), new_store()
        opened = core.open(fields_of(message), deliveries, set())
        assert opened.outcome is Opening.ADMIT and opened.message.pooling == "mean"
        assert not core.admit(b"1-0", opened.message, [])
        assert not core.feed()  # the batch's one input goes to the engine (its message stays unacked)
        effects, _ = drive(core, store)
        [event] = events_of(effects)
        assert event.finish_reason == "stop" and event.token_ids == [] and event.num_prompt_tokens == len(ids)
        assert torch.allclose(torch.tensor(protocol.unpack_embedding(event.embedding)), expected, atol=1e-4)
        assert not effects.handoffs and not effects.block_puts and effects.acks == [b"1-0"]
        assert_pool_free(core)
    cancelled = core.admit(b"2-0", protocol.PrefillRequest("e2", "gw", ids, SamplingParams(max_tokens=1), 0.0,
                                                           pooling="cls"), [])
    assert not cancelled and not core.feed() and core.cancel("e2").acks == [b"2-0"]
    assert_pool_free(core)


def test_the_wire_refuses_an_unknown_pooling_and_a_bad_vector():
    from baton.common import protocol

    good = protocol.PrefillRequest("r", "gw", [1, 2], SamplingParams(max_tokens=1), 0.0, pooling="last")
    assert protocol.decode(protocol.encode(good)).pooling == "last"
    with pytest.raises(protocol.MalformedMessage, match="pooling"):
        protocol.decode(protocol.encode(protocol.PrefillRequest("r", "gw", [1], SamplingParams(max_tokens=1), 0.0,
                                                                pooling="max")))
    event = protocol.TokenEvent("r", 0, [], [], embedding=protocol.pack_embedding([1.0, -2.5]))
    assert protocol.unpack_embedding(protocol.decode(protocol.encode(event)).embedding) == [1.0, -2.5]
    with pytest.raises(protocol.MalformedMessage, match="embedding"):
        protocol.decode(protocol.encode(protocol.TokenEvent("r", 0, [], [], embedding=b"abc")))
