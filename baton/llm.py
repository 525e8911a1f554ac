"""The offline API, in vLLM's shape: `LLM(...).generate(prompts, sampling_params)`, `.chat()` and
`.embed(prompts)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from baton.engine.llm_engine import EngineConfig, LLMEngine
from baton.common.finish_reason import FinishReason
from baton.engine.outputs import EngineOutput
from baton.engine.pooling import Pooling, normalize as normalize_vector
from baton.engine.speculative_config import SpeculativeConfig, parse_speculative_config, with_draft_dir
from baton.common.model_files import resolve_model
from baton.common.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] = field(default_factory=list)
    # with SamplingParams.logprobs=k: per token, [[token id, logprob], ...] of the k most likely
    top_logprobs: list[list] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = True
    # with SamplingParams.prompt_logprobs=k: per prompt token, None (the first) or [logprob, top k]
    prompt_logprobs: list | None = None


def load_tokenizer(model_dir: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


class LLM:
    def __init__(self, model: str | None = None, block_size: int = 16, num_kv_blocks: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 scheduler_policy: str = "max-utilization", dtype: str = "auto", device: str | None = None,
                 enable_prefix_caching: bool = True, kv_cache_memory: int = 1 << 30,
                 num_threads: int | None = None, quantization: str = "auto", kv_cache_dtype: str = "auto",
                 speculative_config: SpeculativeConfig | dict | str | None = None) -> None:
        # speculative_config: vLLM's shape, e.g. {"method": "ngram", "num_speculative_tokens": 4}
        self.engine = LLMEngine(EngineConfig(
            model=resolve_model(model), dtype=dtype, device=device, block_size=block_size, num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, scheduler_policy=scheduler_policy,
            enable_prefix_caching=enable_prefix_caching, num_threads=num_threads, quantization=quantization,
            kv_cache_dtype=kv_cache_dtype, speculative_config=with_draft_dir(parse_speculative_config(speculative_config), resolve_model),
        ))
        self.tokenizer = load_tokenizer(self.engine.model_dir)
        self._ids = itertools.count()

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        prompts = self._prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = list(sampling_params) if isinstance(sampling_params, Seq) else [sampling_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        requests: list[_Collected] = []
        for prompt, params in zip(prompts, params_list):
            if isinstance(prompt, str):
                token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
                text: str | None = prompt
            else:
                token_ids, text = list(prompt), None
            request = _Collected(str(next(self._ids)), text, token_ids)
            self.engine.add_request(request.request_id, token_ids, params)
            requests.append(request)
        by_id = {r.request_id: r for r in requests}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(requests), desc="generating")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                by_id[out.request_id].add(out)
                if out.finished and progress is not None:
                    progress.update(1)
        if progress is not None:
            progress.close()
        return [self._output(r) for r in requests]

    def embed(self, prompts: str | list[int] | Seq[str | list[int]], pooling: Pooling | str = Pooling.LAST,
              normalize: bool = True) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (as vLLM's `LLM.embed`): the final-norm hidden states pooled
        (`last`, `mean` or `cls`), L2-normalized unless `normalize=False`. Text is tokenized with
        the tokenizer's special tokens, as sentence-transformers and TEI do."""
        pooling = Pooling(pooling)
        items = self._prompt_list(prompts)
        requests: list[EmbeddingRequestOutput] = []
        for prompt in items:
            if isinstance(prompt, str):
                token_ids, text = self.tokenizer.encode(prompt), prompt
            else:
                token_ids, text = list(prompt), None
            request = EmbeddingRequestOutput(str(next(self._ids)), text, token_ids, EmbeddingOutput([]))
            self.engine.add_request(request.request_id, token_ids, SamplingParams(max_tokens=1), pooling=pooling)
            requests.append(request)
        by_id = {r.request_id: r for r in requests}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finish_reason is FinishReason.ERROR:
                    raise RuntimeError(f"embedding request {out.request_id} failed: {out.error}")
                if out.embedding is not None:
                    vector = list(out.embedding)
                    by_id[out.request_id].outputs.embedding = normalize_vector(vector) if normalize else vector
        return requests

    @staticmethod
    def _prompt_list(prompts: str | list[int] | Seq[str | list[int]]) -> list[str | list[int]]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            return [prompts]  # type: ignore[list-item]
        return list(prompts)  # type: ignore[arg-type]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
                   for conv in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params)

    def _output(self, request: _Collected) -> RequestOutput:
        text = self.tokenizer.decode(request.token_ids, skip_special_tokens=True)
        finish = request.finish_reason.value if request.finish_reason is not None else None  # vLLM's: a string
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             [CompletionOutput(0, text, request.token_ids, finish, request.logprobs,
                                               request.top_logprobs)],
                             num_cached_tokens=request.num_cached_tokens, prompt_logprobs=request.prompt_logprobs)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """vLLM's shape: `output.outputs.embedding`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class _Collected:
    """One request's engine outputs, gathered as they come."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list] = field(default_factory=list)
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    finish_reason: Any = None

    def add(self, out: EngineOutput) -> None:
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.top_logprobs += out.new_top_logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = list(out.prompt_logprobs)
        self.num_cached_tokens = out.num_cached_tokens
        self.finish_reason = out.finish_reason
