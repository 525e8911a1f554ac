"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{response_id}`.

A Responses request is translated into a chat-completions body (gateway.responses.validation) and
served by the chat pipeline itself (parse_chat -> start_choices -> OpenAIReply), so admission,
budget, cancellation, structured output, tool-call and reasoning parsing are chat's; chat's answer
is then written in Responses' shape (gateway.responses.output). Streams are server-sent events
`event: <type>` + `data: {json}` (no `[DONE]`), as the openai SDK's `responses.stream` reads them;
an error after the stream began ends it with `response.failed`. With `store` (the default) the
response and its conversation are kept in Redis (gateway.responses.store) before the answer
completes, so a follow-up naming it as `previous_response_id` always finds it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.choices import close_all, failed_before_the_end, merged_steps, start_choices
from gateway.errors import ApiError, error_response
from gateway.generation import ClientGone, GenerationFailed
from gateway.openai.reply import OpenAIReply
from gateway.respond import SSEResponse, client_gone_response, rejection_reason, services
from gateway.responses.store import ResponseStore
from gateway.responses.output import ResponseBuilder, full_message_delta, new_id, responses_usage
from gateway.validation import ignored_fields_header, read_json_body
from gateway.openai.validation import STATUS, parse_chat
from gateway.responses.validation import ResponsesRequest, check_response_id, parse_responses, responses_error

Save = Callable[[dict[str, Any]], Awaitable[None]]


def _store(request: Request) -> ResponseStore:
    svc = services(request)
    return ResponseStore(svc.redis, svc.settings.responses_ttl, svc.settings.responses_max_bytes,
                         svc.settings.retry_after_s)


async def _read(request: Request, store: ResponseStore) -> tuple[ResponsesRequest, list[dict[str, Any]]]:
    """The checked request and the conversation of the response it follows ([] if none)."""
    svc = services(request)
    try:
        body = await read_json_body(request, svc.settings, STATUS)
        req = parse_responses(body, svc.settings)
        if req.previous_response_id is None:
            return req, []
        record = await store.load(req.previous_response_id, "previous_response_id")
        return req, record["conversation"]
    except ApiError as exc:  # (start_choices counts its own refusals)
        svc.metrics.reject(rejection_reason(exc))
        raise


async def create_response(request: Request) -> Response:
    svc = services(request)
    store = _store(request)
    req, history = await _read(request, store)
    chat_body, origins = req.chat_body(history)
    settings, vocab = svc.settings, svc.tokenizer.vocab_size
    try:
        gens = await start_choices(request, STATUS, lambda body: parse_chat(body, settings, vocab), body=chat_body)
    except ClientGone:
        return client_gone_response()
    except ApiError as exc:
        raise responses_error(exc, origins) from None
    reply = OpenAIReply(gens, chat=True)
    builder = ResponseBuilder({"id": new_id("resp"), "model": reply.model, **req.settings,
                               "store": req.store and store.enabled})
    conversation = history + req.input_messages  # what a follow-up continues (no instructions)

    async def save(response: dict[str, Any]) -> None:
        if req.store and store.enabled and not await store.save(response, conversation + [builder.chat_message()]):
            # larger than --responses-max-bytes on its own: answered, not stored, and it says so
            response["store"] = builder.response["store"] = False

    headers = ignored_fields_header(req.ignored)
    if req.stream:
        gens[0].stop_watching()
        return SSEResponse(_stream(reply, builder, save), gens, headers=headers)
    if (failed := await failed_before_the_end(gens, "openai", headers)) is not None:
        return failed
    choice = reply.full()["choices"][0]
    builder.feed(full_message_delta(choice["message"]))
    response = builder.finish(choice["finish_reason"], responses_usage(reply.usage()))
    try:
        await save(response)
    except ApiError as exc:
        return error_response(exc, "openai", headers)
    return JSONResponse(response, headers=headers)


def _frames(events: list[dict[str, Any]]) -> bytes:
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + json.dumps(e, ensure_ascii=False).encode("utf-8")
                    + b"\n\n" for e in events)


async def _stream(reply: OpenAIReply, builder: ResponseBuilder, save: Save) -> AsyncIterator[bytes]:
    gens = reply.gens
    gen = gens[0]
    finish: str | None = None
    try:
        builder.start()
        # chat's first delta: the role, or (a named tool_choice) the call it will be
        builder.feed(reply.chunk(gen, None, role=True)["choices"][0]["delta"])
        yield _frames(builder.drain())
        async for gen, step in merged_steps(gens):
            if step.text or step.finish:
                choice = reply.chunk(gen, step)["choices"][0]
                builder.feed(choice["delta"])
                finish = choice["finish_reason"] or finish
                yield _frames(builder.drain())
        final = builder.finish(finish, responses_usage(reply.usage()))
        yield _frames(builder.drain())
        await save(final)  # before it completes: a follow-up sent at once must find it
        builder.complete()
        yield _frames(builder.drain())
    except (GenerationFailed, ApiError) as exc:
        err = exc.error if isinstance(exc, GenerationFailed) else exc
        builder.fail(err.message)
        yield _frames(builder.drain())
    finally:
        close_all(gens)


async def retrieve_response(request: Request) -> Response:
    response_id = check_response_id(request.path_params["response_id"], "response_id")
    record = await _store(request).load(response_id, "response_id")
    return JSONResponse(record["response"])


async def delete_response(request: Request) -> Response:
    response_id = check_response_id(request.path_params["response_id"], "response_id")
    store = _store(request)
    if not store.enabled or not await store.delete(response_id):
        raise ApiError(404, f"Response with id '{response_id}' not found.", kind="not_found", param="response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


routes = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
]
