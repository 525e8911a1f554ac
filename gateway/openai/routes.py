"""OpenAI-compatible endpoints: `POST /v1/completions`, `POST /v1/chat/completions`.

Streams are `data: {json}\\n\\n` chunks ending with `data: [DONE]\\n\\n`, as the openai client
parses them; chat chunks carry `choices[0].delta` (each choice's first one the role), and with
`stream_options.include_usage` a last chunk has `"choices": []` and the usage (and with
`continuous_usage_stats` too, every chunk carries the usage so far, as vLLM sends it). With `n` (or
batched completion prompts) each chunk carries one choice, by its `index`. Logprobs come in the
API's own shape (gateway.logprobs_format); completions' `echo` puts the prompt (and, with
`logprobs`, its tokens' logprobs) before the output. The response names the served model the
request asked for (the first served name if it asked for none). An error after the stream started
is sent as `data: {"error": {...}}`, which the openai client raises as APIError.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.choices import close_all, failed_before_the_end, merged_steps, start_choices
from gateway.errors import error_body
from gateway.generation import ClientGone, GenerationFailed
from gateway.openai.reply import OpenAIReply, sse
from gateway.respond import SSEResponse, client_gone_response, services
from gateway.generation_spec import GenerationSpec
from gateway.validation import ignored_fields_header
from gateway.openai.validation import STATUS, parse_chat, parse_completion


def _parser(request: Request, chat: bool) -> Callable[[dict[str, Any]], GenerationSpec]:
    svc = services(request)
    parse = parse_chat if chat else parse_completion
    return lambda body: parse(body, svc.settings, svc.tokenizer.vocab_size)


async def _handle(request: Request, chat: bool) -> Response:
    try:
        gens = await start_choices(request, STATUS, _parser(request, chat))
    except ClientGone:
        return client_gone_response()
    reply = OpenAIReply(gens, chat)
    # x-request-id (the client's id) is added by RequestIdMiddleware on every response.
    headers = ignored_fields_header(reply.api.ignored_fields)
    if reply.api.stream:
        gens[0].stop_watching()
        return SSEResponse(_stream(reply), gens, headers=headers)
    if (failed := await failed_before_the_end(gens, "openai", headers)) is not None:
        return failed
    reply.keep_best()
    if reply.formatting_cost() <= _INLINE_FORMATTING:
        return JSONResponse(reply.full(), headers=headers)
    # Thousands of choices x tokens x top logprobs: built and encoded in a thread, one choice at a
    # time (each json.dumps holds the GIL only for its own choice), so the event loop keeps
    # serving every other stream meanwhile.
    body = await asyncio.to_thread(_encode_in_pieces, reply.full)
    return Response(body, media_type="application/json", headers=headers)


async def completions(request: Request) -> Response:
    return await _handle(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _handle(request, chat=True)


async def _stream(reply: OpenAIReply) -> AsyncIterator[bytes]:
    gens = reply.gens
    try:
        for gen in gens:
            if reply.chat:
                yield sse(reply.chunk(gen, None, role=True))
            elif reply.api.echo:
                yield sse(reply.chunk(gen, None, echo=True))
        async for gen, step in merged_steps(gens):
            # (a token whose text is still held back, e.g. half a character, shows only in logprobs)
            if step.text or step.finish or (step.tokens and reply.sampling.logprobs is not None):
                yield sse(reply.chunk(gen, step))
        if reply.api.include_usage:
            yield sse({**reply.head(reply.object + (".chunk" if reply.chat else "")),
                        "choices": [], "usage": reply.usage()})
    except GenerationFailed as exc:
        yield sse(error_body(exc.error, "openai"))
    finally:
        close_all(gens)
    yield b"data: [DONE]\n\n"


# Below this many token entries, formatting inline costs less than a thread hop (~1 ms).
_INLINE_FORMATTING = 20_000


def _encode_in_pieces(build: Callable[[], dict[str, Any]]) -> bytes:
    answer = build()
    choices = answer.pop("choices")
    head = json.dumps({**answer, "choices": []}, ensure_ascii=False).encode("utf-8")
    parts = b",".join(json.dumps(c, ensure_ascii=False).encode("utf-8") for c in choices)
    marker = b'"choices": []'
    at = head.index(marker)
    return head[:at] + b'"choices": [' + parts + b"]" + head[at + len(marker):]


routes = [
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
