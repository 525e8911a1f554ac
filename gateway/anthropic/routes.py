"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

As vLLM and llama-server serve it to Claude Code and the `anthropic` SDK: the body is checked and
written as a chat body (gateway.anthropic.validation), run through the chat pipeline
(parse_chat -> start_choices: admission, budget, cancellation when the client leaves, tool and
reasoning parsers), and chat's answer is translated back (gateway.anthropic.reply). Errors are in
Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`, gateway.errors picks it by
path), before the stream as the HTTP status, after it started as an `event: error`.
count_tokens answers `{"input_tokens": N}`: the templated prompt's tokens, as generation counts them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.anthropic.reply import MessagesReply
from gateway.choices import failed_before_the_end, start_choices
from gateway.errors import ApiError
from gateway.generation import ClientGone
from gateway.openai.reply import OpenAIReply
from gateway.respond import SSEResponse, client_gone_response, services
from gateway.generation_spec import GenerationSpec
from gateway.validation import ignored_fields_header, read_json_body
from gateway.anthropic.validation import STATUS, MessagesRequest, renamed, to_chat
from gateway.openai.validation import parse_chat


def _parser(request: Request, count_only: bool = False) -> Callable[[dict[str, Any]], GenerationSpec]:
    """Messages body -> spec: our checks (Anthropic's field names), then chat's."""
    svc = services(request)

    def parse(body: dict[str, Any]) -> GenerationSpec:
        checked: MessagesRequest = to_chat(body, svc.settings, count_only)
        try:
            spec = parse_chat(checked.chat, svc.settings, svc.tokenizer.vocab_size)
        except ApiError as exc:
            raise renamed(exc) from None
        spec.api.stream = checked.stream
        spec.api.ignored_fields = checked.ignored + spec.api.ignored_fields
        return spec

    return parse


async def messages(request: Request) -> Response:
    try:
        gens = await start_choices(request, STATUS, _parser(request))
    except ClientGone:
        return client_gone_response()
    reply = MessagesReply(OpenAIReply(gens, chat=True))
    headers = ignored_fields_header(gens[0].spec.api.ignored_fields)
    if gens[0].spec.api.stream:
        gens[0].stop_watching()  # SSEResponse watches for the client leaving
        return SSEResponse(reply.stream(), gens, headers=headers)
    if (failed := await failed_before_the_end(gens, "anthropic", headers)) is not None:
        return failed
    return JSONResponse(reply.full(), headers=headers)


async def count_tokens(request: Request) -> Response:
    svc = services(request)
    body = await read_json_body(request, svc.settings, STATUS)
    spec = await asyncio.to_thread(_parser(request, count_only=True), body)  # tools' schemas compile
    ids = await svc.tokenizer.prompt_ids(spec, STATUS)
    return JSONResponse({"input_tokens": len(ids)}, headers=ignored_fields_header(spec.api.ignored_fields))


routes = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
