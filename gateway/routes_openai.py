"""OpenAI-compatible endpoints: `POST /v1/completions`, `POST /v1/chat/completions`.

Streams are `data: {json}\\n\\n` chunks ending with `data: [DONE]\\n\\n`, as the openai client
parses them; chat chunks carry `choices[0].delta` (the first one the role), and with
`stream_options.include_usage` a last chunk has `"choices": []` and the usage (and with
`continuous_usage_stats` too, every chunk carries the usage so far, as vLLM sends it). The response
names the served model the request asked for (the first served name if it asked for none). An
error after the stream started is sent as `data: {"error": {...}}`, which the openai client raises as APIError.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.errors import error_body, error_response
from gateway.generation import ClientGone, Generation, GenerationFailed, Step
from gateway.respond import SSEResponse, client_gone_response, run_to_end, services, start_generation
from gateway.validation import GenerationSpec, ignored_fields_header
from gateway.validation_openai import STATUS, parse_chat, parse_completion

FINISH = {"eos": "stop", "stop_sequence": "stop", "length": "length"}


class _Reply:
    """Identity and shape of one OpenAI response (completion or chat)."""

    def __init__(self, gen: Generation, chat: bool) -> None:
        self.gen = gen
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = gen.spec.model or gen.svc.settings.model_name
        self.object = ("chat.completion" if chat else "text_completion")

    def usage(self) -> dict[str, int]:
        prompt, completion = len(self.gen.prompt_ids), len(self.gen.tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self) -> dict[str, Any]:
        finish = FINISH.get(self.gen.finish_reason or "", "length")
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": self.gen.text},
                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": self.gen.text, "logprobs": None, "finish_reason": finish}
        return {**self.head(self.object), "choices": [choice], "usage": self.usage()}

    def chunk(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            body = {**self.head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            body = {**self.head("text_completion"), "choices": [choice]}
        if self.gen.spec.continuous_usage:
            body["usage"] = self.usage()
        elif self.gen.spec.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return body


def _parser(request: Request, chat: bool) -> Callable[[dict[str, Any]], GenerationSpec]:
    svc = services(request)
    parse = parse_chat if chat else parse_completion
    return lambda body: parse(body, svc.settings, svc.tokenizer.vocab_size)


async def _handle(request: Request, chat: bool) -> Response:
    try:
        gen = await start_generation(request, STATUS, _parser(request, chat))
    except ClientGone:
        return client_gone_response()
    reply = _Reply(gen, chat)
    # x-request-id (the client's id) is added by RequestIdMiddleware on every response.
    headers = ignored_fields_header(gen.spec.ignored_fields)
    if gen.spec.stream:
        gen.stop_watching()
        return SSEResponse(_stream(reply), gen, headers=headers)
    try:
        await run_to_end(gen)
    except ClientGone:
        return client_gone_response()
    except GenerationFailed as exc:
        return error_response(exc.error, "openai", headers)
    finally:
        gen.close()
    return JSONResponse(reply.full(), headers=headers)


async def completions(request: Request) -> Response:
    return await _handle(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _handle(request, chat=True)


async def _stream(reply: _Reply) -> AsyncIterator[bytes]:
    gen = reply.gen
    try:
        if reply.chat:
            yield _sse(reply.chunk("", None, role=True))
        async for step in gen.steps():
            text = _step_text(step)
            finish = FINISH[step.finish] if step.finish is not None else None
            if text or finish:
                yield _sse(reply.chunk(text if (text or not reply.chat) else None, finish))
        if gen.spec.include_usage:
            yield _sse({**reply.head(reply.object + (".chunk" if reply.chat else "")),
                        "choices": [], "usage": reply.usage()})
    except GenerationFailed as exc:
        yield _sse(error_body(exc.error, "openai"))
    finally:
        gen.close()
    yield b"data: [DONE]\n\n"


def _step_text(step: Step) -> str:
    return "".join(t.text for t in step.tokens) + step.tail


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n"


routes = [
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
