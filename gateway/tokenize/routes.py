"""vLLM's tokenizer endpoints: `POST /tokenize` and `POST /detokenize`, in vLLM's shapes.

`/tokenize` takes `{"prompt": str}` (add_special_tokens defaults to true) or `{"messages": [...]}`
(rendered with the chat template; add_generation_prompt defaults to true, add_special_tokens to
false, as vLLM's do) and answers `{"count", "max_model_len", "tokens", "token_strs"}` (token_strs
only with `return_token_strs`). `/detokenize` takes `{"tokens": [ids]}` and answers `{"prompt"}`.
Both use the gateway's tokenizer, so the ids are exactly those a generation request would run.
Errors are OpenAI-shaped (400), and `model`, when given, must be a served name (else 404).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.errors import validation_error
from gateway.respond import services
from gateway.tokenizer import maybe_in_thread
from gateway.validation import Fields, ignored_fields_header, read_json_body
from gateway.openai.validation import STATUS, parse_messages, served_model

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "continue_final_message", "return_token_strs"}
DETOKENIZE_FIELDS = {"model", "tokens"}
# A detokenize body holds at most max_body_bytes of ids anyway; this keeps one call's work bounded.
MAX_DETOKENIZE_IDS = 1 << 17
# A body of many MB tokenizes to millions of ids: past this many, the answer is encoded in a thread
# a slice at a time (one json.dumps of them all would hold the GIL, so the event loop, for a second).
_INLINE_IDS = 1 << 16


async def tokenize(request: Request) -> Response:
    svc = services(request)
    body = await read_json_body(request, svc.settings, STATUS)
    f = Fields(body, STATUS)
    ignored = f.unknown(TOKENIZE_FIELDS, "the request", svc.settings.strict_api)
    served_model(f, svc.settings)
    # Continuing the last message instead of opening a new one needs a template feature we do not
    # use: refused rather than tokenized differently from what the client asked.
    f.unsupported_unless("continue_final_message", (False,))
    return_strs = f.boolean("return_token_strs", False)
    tok = svc.tokenizer
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise validation_error("give either `prompt` or `messages`, not both", param="prompt", status=STATUS)
        messages = parse_messages(body["messages"], svc.settings.max_chat_messages)
        add_generation_prompt = f.boolean("add_generation_prompt", True)
        add_special = f.boolean("add_special_tokens", False)
        if not tok.has_chat_template:
            raise validation_error("this model has no chat template; send `prompt`", param="messages",
                                   status=STATUS)
        ids = await tok.chat_ids(messages, STATUS, add_generation_prompt, add_special)
    else:
        prompt = f.string("prompt")
        if prompt is None:
            raise validation_error("`prompt` or `messages` is required", param="prompt", status=STATUS)
        add_special = f.boolean("add_special_tokens", True)
        ids = await maybe_in_thread(len(prompt), tok.encode_text, prompt, add_special)
    headers = ignored_fields_header(ignored)
    answer = {"count": len(ids), "max_model_len": svc.settings.max_total_tokens, "tokens": ids,
              "token_strs": await maybe_in_thread(len(ids), tok.token_strs, ids) if return_strs else None}
    if len(ids) <= _INLINE_IDS:
        return JSONResponse(answer, headers=headers)
    return Response(await asyncio.to_thread(_encode_in_slices, answer), media_type="application/json",
                    headers=headers)


def _encode_in_slices(answer: dict[str, Any]) -> bytes:
    """`answer` as JSONResponse writes it, its lists encoded _INLINE_IDS items per json.dumps."""
    def array(items: list[Any]) -> bytes:
        slices = (_compact(items[i:i + _INLINE_IDS])[1:-1] for i in range(0, len(items), _INLINE_IDS))
        return b"[" + b",".join(slices) + b"]"

    lists = {key: answer.pop(key) for key in ("tokens", "token_strs")}
    parts = [_compact(answer)[:-1]]
    for key, items in lists.items():
        parts.append(b"," + _compact(key) + b":" + (array(items) if items is not None else b"null"))
    return b"".join(parts) + b"}"


def _compact(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


async def detokenize(request: Request) -> Response:
    svc = services(request)
    body = await read_json_body(request, svc.settings, STATUS)
    f = Fields(body, STATUS)
    ignored = f.unknown(DETOKENIZE_FIELDS, "the request", svc.settings.strict_api)
    served_model(f, svc.settings)
    if body.get("tokens") is None:
        raise validation_error("`tokens` is required", param="tokens", status=STATUS)
    ids = f.token_ids("tokens", svc.tokenizer.vocab_size, MAX_DETOKENIZE_IDS)
    # Special tokens are kept, so that detokenize inverts tokenize (vLLM keeps them too).
    text = await maybe_in_thread(len(ids), svc.tokenizer.decode, ids, False)
    return JSONResponse({"prompt": text}, headers=ignored_fields_header(ignored))


routes = [
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
