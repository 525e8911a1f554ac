"""TGI-compatible endpoints: `POST /generate`, `POST /generate_stream`, and `POST /` (both).

Wire format as text-generation-inference writes it and huggingface_hub parses it: stream events
`data:{"index", "token": {"id", "text", "logprob", "special"}, "generated_text": null,
"details": null}` with the last event carrying `generated_text` and (if asked) `details`; an error
mid-stream is `data:{"error": ..., "error_type": "generation"}` (`"unavailable"` when Redis lost the
request's state: retry it). `POST /` answers a list of one result when not streaming, as TGI's
compat route does.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from baton.common.finish_reason import FinishReason
from gateway import siblings
from gateway.errors import ApiError, error_body
from gateway.finish import spelled
from gateway.generation import ClientGone, Generation, GenerationFailed, Step, TokenOut
from gateway.choices import failed_before_the_end, start_choices
from gateway.logprobs_format import tgi_prefill, tgi_top_tokens
from gateway.respond import SSEResponse, client_gone_response, rejection_reason, services
from gateway.generation_spec import GenerationSpec
from gateway.validation import ignored_fields_header, read_json_body
from gateway.tgi.validation import STATUS, parse_tgi



def _parser(request: Request, streaming: bool) -> Callable[[dict[str, Any]], GenerationSpec]:
    settings = services(request).settings
    return lambda body: parse_tgi(body, settings, streaming)


async def generate(request: Request, body: dict[str, Any] | None = None, as_list: bool = False) -> Response:
    try:
        gens = await start_choices(request, STATUS, _parser(request, streaming=False), body)
    except ClientGone:
        return client_gone_response()
    if (failed := await failed_before_the_end(gens, "tgi", _headers(gens[0]))) is not None:
        return failed
    # best_of: the candidate whose tokens have the highest total logprob (TGI's choice)
    ranked = siblings.ranked(gens)
    gen = ranked[0]
    result: dict[str, Any] = {"generated_text": _generated_text(gen)}
    if gen.spec.api.details:
        result["details"] = {
            **_full_details(gen),
            "best_of_sequences": [{"generated_text": _generated_text(g), **_full_details(g)}
                                  for g in ranked[1:]] if len(gens) > 1 else None,
        }
    # TGI's compat route (`POST /`) wraps the non-streaming result in a list (api-inference shape).
    return JSONResponse([result] if as_list else result, headers=_headers(gen))


async def generate_stream(request: Request, body: dict[str, Any] | None = None) -> Response:
    try:
        # one generation: validation refuses best_of when streaming (TGI's rule)
        [gen] = await start_choices(request, STATUS, _parser(request, streaming=True), body)
    except ClientGone:
        return client_gone_response()
    gen.stop_watching()
    return SSEResponse(_events(gen), gen, headers=_headers(gen))


async def compat_generate(request: Request) -> Response:
    """`POST /` (what huggingface_hub.InferenceClient posts to): `stream` picks the mode."""
    svc = services(request)
    try:
        body = await read_json_body(request, svc.settings, STATUS)
    except ApiError as exc:
        svc.metrics.reject(rejection_reason(exc))
        raise
    if body.get("stream") is True:
        return await generate_stream(request, body)
    return await generate(request, body, as_list=True)


async def _events(gen: Generation) -> AsyncIterator[bytes]:
    try:
        async for step in gen.steps():
            for token, final in _tokens_of(gen, step):
                event: dict[str, Any] = {"index": token.index + 1, "token": _token(token),
                                         "generated_text": None, "details": None}
                if gen.sampling.logprobs:
                    event["top_tokens"] = tgi_top_tokens(gen.svc.tokenizer, token)
                if final:
                    event["generated_text"] = _generated_text(gen)
                    if gen.spec.api.details:
                        event["details"] = _details(gen)
                yield _sse(event)
    except GenerationFailed as exc:
        yield _sse(error_body(exc.error, "tgi"))
    finally:
        gen.close()


def _tokens_of(gen: Generation, step: Step) -> list[tuple[TokenOut, bool]]:
    """The step's tokens, each flagged final or not. TGI attaches the end to a token, so an end
    that arrives without one is sent on an empty special token (text: whatever was held back)."""
    tokens = list(step.tokens)
    if step.finish is not None and not tokens:
        eos = gen.svc.tokenizer.eos_token_id
        tokens = [TokenOut(index=len(gen.tokens), id=eos if eos is not None else 0, text=step.tail,
                           logprob=None, special=True)]
    last = len(tokens) - 1
    return [(t, step.finish is not None and i == last) for i, t in enumerate(tokens)]


def _generated_text(gen: Generation) -> str:
    if gen.spec.api.return_full_text:
        assert isinstance(gen.spec.prompt.input, str)
        return gen.spec.prompt.input + gen.text
    return gen.text


def _details(gen: Generation) -> dict[str, Any]:
    return {
        "finish_reason": spelled(gen.finish_reason or FinishReason.LENGTH, "tgi"),
        "generated_tokens": len(gen.tokens),
        "seed": gen.sampling.seed if gen.spec.api.report_seed else None,  # null when greedy
        "input_length": len(gen.prompt_ids),
    }


def _full_details(gen: Generation) -> dict[str, Any]:
    """details of a non-streamed answer: with its tokens, the prompt's (decoder_input_details) and
    each token's top alternatives (top_n_tokens)."""
    tokenizer = gen.svc.tokenizer
    details = {
        **_details(gen),
        "prefill": tgi_prefill(tokenizer, gen.prompt_ids, gen.prompt_logprobs) if gen.sampling.prompt_logprobs is not None
        else [],
        "tokens": [_token(t) for t in gen.tokens],
    }
    if gen.sampling.logprobs:
        details["top_tokens"] = [tgi_top_tokens(tokenizer, t) for t in gen.tokens]
    return details


def _token(t: TokenOut) -> dict[str, Any]:
    return {"id": t.id, "text": t.text, "logprob": t.logprob, "special": t.special}


def _headers(gen: Generation) -> dict[str, str]:
    # x-request-id (the client's id) is added by RequestIdMiddleware on every response.
    return ignored_fields_header(gen.spec.api.ignored_fields)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data:" + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n"


routes = [
    Route("/generate", generate, methods=["POST"]),
    Route("/generate_stream", generate_stream, methods=["POST"]),
    Route("/", compat_generate, methods=["POST"]),
]
