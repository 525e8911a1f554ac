"""Embeddings: OpenAI's `POST /v1/embeddings` and TEI's `POST /embed`.

Each input is its own prefill-only job (a `Generation` with `pooling`): the prefill workers run its
prompt through the engine, batched and chunked with every other prompt, pool its final-norm hidden
states and publish the vector in the request's one token event; nothing is sampled, handed off or
decoded, and the worker frees its KV blocks at once. A request's inputs are admitted as one (their
summed prompt tokens: nothing else is reserved) and sent in one round trip; the client leaving
cancels every job (choices.run_all_to_end watches it) and every job's close() releases the budget.

The workers send the raw pooled vector; the gateway normalizes (here, not in the worker), because
OpenAI's `dimensions` must cut the raw vector and renormalize it, and TEI's `normalize` is the
request's choice: one place does both. Text is tokenized with the tokenizer's special tokens (what
sentence-transformers and TEI feed the model, e.g. the EOS Qwen3-Embedding pools on).
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from baton.common.sampling_params import SamplingParams
from gateway.choices import close_all, failed_before_the_end
from gateway.errors import ApiError, error_response
from gateway.generation import ClientGone, Generation, send_all, wait_for_disconnect
from gateway.pooling_config import PoolingConfig, resolve
from gateway.request_scope import own
from gateway.respond import client_gone_response, rejection_reason, services
from gateway.spec import ApiView, GenerationSpec, Prompt
from gateway.tokenizer import maybe_in_thread
from gateway.validation import ignored_fields_header, read_json_body
from gateway.validation_embeddings import (OPENAI_STATUS, TEI_STATUS, EmbeddingSpec, fit, parse_openai,
                                           parse_tei)


def pooling_config(request: Request) -> PoolingConfig:
    settings = services(request).settings
    try:
        return resolve(settings.model_dir, settings.pooling, settings.normalize)
    except ValueError as exc:  # the checkpoint pools in a way Baton does not (it says how to choose)
        # 501: this server, as configured, does not do it (the gateway warned at start-up too)
        raise ApiError(501, str(exc), kind="generation") from None


async def _start(request: Request, spec: EmbeddingSpec, config: PoolingConfig, status: int) -> list[Generation]:
    """Tokenize every input, admit them as one, send them; raises ApiError or ClientGone."""
    svc = services(request)
    arrival = time.monotonic()
    gens: list[Generation] = []
    many = len(spec.inputs) > 1
    name = "input" if status == OPENAI_STATUS else "inputs"
    for i, item in enumerate(spec.inputs):
        ids = (await maybe_in_thread(len(item), svc.tokenizer.encode_text, item, True)
               if isinstance(item, str) else item)
        try:
            ids = fit(ids, spec, svc.settings, f"{name}[{i}]" if many else name, status)
        except ApiError as exc:
            svc.metrics.reject(rejection_reason(exc))
            raise
        one = GenerationSpec(Prompt(input=ids), SamplingParams(max_tokens=1), ApiView())
        gen = Generation(svc, one, ids, one.sampling, arrival, status, choice=i, pooling=config.pooling)
        own(request.scope, gen)  # released when the exchange ends, whatever happens
        gens.append(gen)
    try:
        await gens[0].admit(asyncio.create_task(wait_for_disconnect(request)), cost=sum(g.cost for g in gens))
        for gen in gens[1:]:
            gen.attach()
        await send_all(gens, request)
    except BaseException:
        close_all(gens)
        raise
    return gens


async def _run(request: Request, status: int, style: str) -> tuple[EmbeddingSpec, list[Generation], PoolingConfig] | Response:
    """Validate, run every input to its end: (spec, finished jobs) or the error response."""
    svc = services(request)
    config = pooling_config(request)
    try:
        body = await read_json_body(request, svc.settings, status)
        if status == OPENAI_STATUS:
            spec = parse_openai(body, svc.settings, svc.tokenizer.vocab_size, config.hidden_size)
        else:
            spec = parse_tei(body, svc.settings)
    except ApiError as exc:
        svc.metrics.reject(rejection_reason(exc))
        raise
    try:
        gens = await _start(request, spec, config, status)
    except ClientGone:
        return client_gone_response()
    headers = ignored_fields_header(spec.ignored_fields)
    if (failed := await failed_before_the_end(gens, style, headers)) is not None:  # type: ignore[arg-type]
        return failed
    missing = [g.choice for g in gens if g.embedding is None or len(g.embedding) != config.hidden_size]
    if missing:
        err = ApiError(500, f"the workers answered input {missing[0]} without its embedding", kind="generation")
        return error_response(err, style, headers)  # type: ignore[arg-type]
    svc.metrics.embedding_inputs.inc(len(gens))
    return spec, gens, config


def finish_vector(raw: list[float], dimensions: int | None, normalize: bool) -> np.ndarray:
    """Cut to `dimensions` (OpenAI's), then L2-normalize if asked (after the cut: a shortened
    vector is renormalized, as text-embedding-3's are)."""
    vector = np.asarray(raw[:dimensions] if dimensions else raw, dtype=np.float32)
    if normalize:
        norm = float(np.linalg.norm(vector))
        if norm > 0:
            vector = vector / norm
    return vector


async def embeddings(request: Request) -> Response:
    outcome = await _run(request, OPENAI_STATUS, "openai")
    if isinstance(outcome, Response):
        return outcome
    spec, gens, config = outcome
    svc = services(request)
    data: list[dict[str, Any]] = []
    for gen in gens:
        vector = finish_vector(gen.embedding or [], spec.dimensions, config.normalize)
        # base64: little-endian float32 bytes, what the openai SDK decodes (np.frombuffer "float32")
        encoded: Any = (base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii") if spec.base64
                        else vector.tolist())
        data.append({"object": "embedding", "index": gen.choice, "embedding": encoded})
    tokens = sum(len(g.prompt_ids) for g in gens)
    body = {"object": "list", "data": data, "model": spec.model or svc.settings.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return JSONResponse(body, headers=ignored_fields_header(spec.ignored_fields))


async def embed(request: Request) -> Response:
    outcome = await _run(request, TEI_STATUS, "tgi")
    if isinstance(outcome, Response):
        return outcome
    spec, gens, config = outcome
    normalize = config.normalize if spec.normalize is None else spec.normalize
    body = [finish_vector(gen.embedding or [], None, normalize).tolist() for gen in gens]
    return JSONResponse(body, headers=ignored_fields_header(spec.ignored_fields))


routes = [
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    Route("/embed", embed, methods=["POST"]),
]
