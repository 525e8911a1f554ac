"""Embeddings: OpenAI's `POST /v1/embeddings` and TEI's `POST /embed`.

A request is ONE job (gateway.embeddings.job): its inputs are sized by their characters, tokenized in
one batch call off the event loop, admitted as one in the embeddings lane (their summed tokens:
gateway.admission) and sent as one prefill request carrying them all. A prefill worker feeds them to
its engine a step's budget at a time, behind the chat prompts and round robin with other batches,
pools each input's final-norm hidden states and publishes its vector as soon as it is computed;
nothing is sampled, handed off or decoded. The client leaving cancels the batch; close() releases
the budget.

The workers send the raw pooled vector; the gateway normalizes (here, not in the worker), because
OpenAI's `dimensions` must cut the raw vector and renormalize it, and TEI's `normalize` is the
request's choice: one place does both. Text is tokenized with the tokenizer's special tokens (what
sentence-transformers and TEI feed the model, e.g. the EOS Qwen3-Embedding pools on).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.choices import failed_before_the_end
from gateway.embeddings.job import EmbeddingJob
from gateway.errors import ApiError, error_response
from gateway.generation import ClientGone, send_all, wait_for_disconnect
from gateway.embeddings.pooling_config import PoolingConfig, resolve
from gateway.request_scope import own
from gateway.respond import client_gone_response, rejection_reason, services
from gateway.validation import ignored_fields_header, read_json_body
from gateway.embeddings.validation import (OPENAI_STATUS, TEI_STATUS, EmbeddingSpec, check_characters, fit,
                                           parse_openai, parse_tei)


def pooling_config(request: Request) -> PoolingConfig:
    settings = services(request).settings
    try:
        return resolve(settings.model_dir, settings.pooling, settings.normalize)
    except ValueError as exc:  # the checkpoint pools in a way Baton does not (it says how to choose)
        # 501: this server, as configured, does not do it (the gateway warned at start-up too)
        raise ApiError(501, str(exc), kind="generation") from None


async def _tokenize(request: Request, spec: EmbeddingSpec, status: int) -> list[list[int]]:
    """Every input's token ids within the limits: sized by its characters first (a request that
    cannot fit is refused before anything is tokenized), then the texts tokenized in one batch call
    off the event loop (a client-sized job: 2048 inputs of 470 characters held the loop 3.3 s)."""
    svc = services(request)
    check_characters(spec, svc.settings, svc.tokenizer.max_token_chars, status)
    texts = [item for item in spec.inputs if isinstance(item, str)]
    encoded = iter(await svc.tokenizer.texts_ids(texts) if texts else [])
    name = "input" if status == OPENAI_STATUS else "inputs"
    many = len(spec.inputs) > 1
    return [fit(next(encoded) if isinstance(item, str) else item, spec, svc.settings,
                f"{name}[{i}]" if many else name, status) for i, item in enumerate(spec.inputs)]


async def _start(request: Request, spec: EmbeddingSpec, config: PoolingConfig, status: int) -> EmbeddingJob:
    """Tokenize every input, admit them as one job, send it; raises ApiError or ClientGone."""
    svc = services(request)
    arrival = time.monotonic()
    try:
        inputs = await _tokenize(request, spec, status)
    except ApiError as exc:
        svc.metrics.reject(rejection_reason(exc))
        raise
    job = EmbeddingJob(svc, inputs, arrival, status, config.pooling)
    own(request.scope, job)  # released when the exchange ends, whatever happens
    try:
        await job.admit(asyncio.create_task(wait_for_disconnect(request)))
        await send_all([job], request)
    except BaseException:
        job.close()
        raise
    return job


async def _run(request: Request, status: int, style: str) -> tuple[EmbeddingSpec, EmbeddingJob, PoolingConfig] | Response:
    """Validate, run the job to its end: (spec, finished job) or the error response."""
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
        job = await _start(request, spec, config, status)
    except ClientGone:
        return client_gone_response()
    headers = ignored_fields_header(spec.ignored_fields)
    if (failed := await failed_before_the_end([job], style, headers)) is not None:  # type: ignore[arg-type]
        return failed
    wrong = [i for i, raw in enumerate(job.vectors) if raw is None or len(raw) != 4 * config.hidden_size]
    if wrong:
        err = ApiError(500, f"the workers answered input {wrong[0]} without its embedding", kind="generation")
        return error_response(err, style, headers)  # type: ignore[arg-type]
    svc.metrics.embedding_inputs.inc(len(job.inputs))
    return spec, job, config


def _vectors(job: EmbeddingJob) -> list[np.ndarray]:
    return [np.frombuffer(raw or b"", dtype="<f4") for raw in job.vectors]


def finish_vector(raw: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
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
    spec, job, config = outcome
    svc = services(request)

    def rows() -> list[dict[str, Any]]:
        data: list[dict[str, Any]] = []
        for index, raw in enumerate(_vectors(job)):
            vector = finish_vector(raw, spec.dimensions, config.normalize)
            # base64: little-endian float32 bytes, what the openai SDK decodes (np.frombuffer "float32")
            encoded: Any = (base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii") if spec.base64
                            else vector.tolist())
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        return data

    tokens = job.num_prompt_tokens
    head = {"object": "list", "data": [], "model": spec.model or svc.settings.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    size = len(job.inputs) * (1 if spec.base64 else spec.dimensions or config.hidden_size)
    return await _answer(head, rows, size, ignored_fields_header(spec.ignored_fields))


async def embed(request: Request) -> Response:
    outcome = await _run(request, TEI_STATUS, "tgi")
    if isinstance(outcome, Response):
        return outcome
    spec, job, config = outcome
    normalize = config.normalize if spec.normalize is None else spec.normalize

    def rows() -> list[list[float]]:
        return [finish_vector(raw, None, normalize).tolist() for raw in _vectors(job)]

    return await _answer(None, rows, len(job.inputs) * config.hidden_size, ignored_fields_header(spec.ignored_fields))


# Floats in an answer past which it is built and encoded in a thread (2048 vectors of 576 floats
# took 7 s of json.dumps on a 2-core EPYC: on the loop, every other request would have waited).
_INLINE_VALUES = 1 << 16


async def _answer(head: dict[str, Any] | None, rows: Callable[[], list[Any]], size: int,
                  headers: dict[str, str]) -> Response:
    """`head` with `rows()` as its "data" (None: the rows alone, TEI's shape), as JSON."""
    if size <= _INLINE_VALUES:
        return JSONResponse(rows() if head is None else {**head, "data": rows()}, headers=headers)
    body = await asyncio.to_thread(_encode_in_pieces, head, rows)
    return Response(body, media_type="application/json", headers=headers)


def _dumps(value: Any) -> bytes:
    # Starlette's JSONResponse's rendering, so both paths answer the same bytes
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def _encode_in_pieces(head: dict[str, Any] | None, rows: Callable[[], list[Any]]) -> bytes:
    """One json.dumps per row: each holds the GIL for its own row only, so the event loop keeps
    turning while a thread encodes a big answer."""
    parts = b",".join(_dumps(row) for row in rows())
    if head is None:
        return b"[" + parts + b"]"
    text, marker = _dumps(head), b'"data":[]'
    at = text.index(marker)  # (the first: "data" is a key of the head, and no string holds an unescaped quote)
    return text[:at] + b'"data":[' + parts + b"]" + text[at + len(marker):]


routes = [
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    Route("/embed", embed, methods=["POST"]),
]
