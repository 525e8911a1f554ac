"""Chat's answer (gateway.openai.reply.OpenAIReply) in the Anthropic Messages shape, whole or streamed.

The message: `content` is a `thinking` block (chat's `reasoning_content`, when a reasoning parser
found some), a `text` block (when there is text) and one `tool_use` block per tool call (input: the
call's JSON arguments as an object; arguments that are not a JSON object, e.g. cut short by
max_tokens, come back as text rather than as a call the client would run). `stop_reason`:
tool calls -> "tool_use", a stop string -> "stop_sequence" (with `stop_sequence` the one matched),
max tokens -> "max_tokens", else "end_turn".

The stream is Anthropic's event sequence, each as `event: <type>` + `data: {json}`: message_start,
ping, then per block content_block_start / content_block_delta (text_delta, thinking_delta,
input_json_delta) / content_block_stop, one block open at a time; then message_delta (stop_reason,
stop_sequence, usage.output_tokens) and message_stop. Chat's deltas drive it: a delta of another
kind (reasoning, text, a new tool call) closes the open block and opens the next.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from baton.common.finish_reason import FinishReason
from gateway.choices import close_all, merged_steps
from gateway.errors import error_body
from gateway.generation import GenerationFailed, Generation
from gateway.openai.reply import OpenAIReply


def tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def event(kind: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps({"type": kind, **payload}, ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode("utf-8")


def matched_stop(gen: Generation) -> str | None:
    """The stop string that ended `gen` (its text is cut before it): the one found where the
    text ends in the decoded tokens, the earliest and then the first listed, as the matcher
    chose."""
    stops = gen.spec.stop
    if len(stops) <= 1:
        return stops[0] if stops else None
    full = gen.svc.tokenizer.decode([t.id for t in gen.tokens])
    found = [(at, i) for i, stop in enumerate(stops) if (at := full.find(stop, len(gen.text))) != -1]
    return stops[min(found)[1]] if found else stops[0]


def stop_reason(gen: Generation, finish: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from chat's finish_reason (after its tool-call rewrite)."""
    if finish == "tool_calls":
        return "tool_use", None
    if gen.finish_reason is FinishReason.STOP_SEQUENCE:
        return "stop_sequence", matched_stop(gen)
    if finish == "length":
        return "max_tokens", None
    return "end_turn", None


class MessagesReply:
    """One Messages answer over chat's (a single choice: Messages has no `n`)."""

    def __init__(self, reply: OpenAIReply) -> None:
        self.reply = reply
        self.gen = reply.gens[0]
        self.id = "msg_" + uuid.uuid4().hex

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                 output_tokens: int) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.reply.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": {"input_tokens": len(self.gen.prompt_ids), "output_tokens": output_tokens}}

    def full(self) -> dict[str, Any]:
        choice = self.reply.full()["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        texts = [message["content"]] if message.get("content") else []
        calls = []
        for call in message.get("tool_calls") or []:
            arguments = call["function"]["arguments"]
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                calls.append({"type": "tool_use", "id": tool_use_id(), "name": call["function"]["name"],
                              "input": parsed})
            else:  # not a call anyone could run: the text as generated
                texts.append(arguments)
        if texts:
            content.append({"type": "text", "text": "".join(texts)})
        content += calls
        stop = stop_reason(self.gen, finish if calls or finish != "tool_calls" else "stop")
        return self._message(content, stop, len(self.gen.tokens))

    async def stream(self) -> AsyncIterator[bytes]:
        reply, gen = self.reply, self.gen
        blocks = _Blocks()
        finish: str | None = None
        try:
            yield event("message_start", {"message": self._message([], (None, None), 0)})
            yield event("ping", {})
            first = reply.chunk(gen, None, role=True)["choices"][0]  # a named tool's call opens here
            for out in blocks.feed(first["delta"]):
                yield out
            async for _, step in merged_steps([gen]):
                if not (step.text or step.finish):
                    continue
                choice = reply.chunk(gen, step)["choices"][0]
                for out in blocks.feed(choice["delta"]):
                    yield out
                finish = choice["finish_reason"] or finish
            for out in blocks.close():
                yield out
            stop_kind, sequence = stop_reason(gen, finish)
            yield event("message_delta", {"delta": {"stop_reason": stop_kind, "stop_sequence": sequence},
                                          "usage": {"output_tokens": len(gen.tokens)}})
            yield event("message_stop", {})
        except GenerationFailed as exc:
            yield event("error", {"error": error_body(exc.error, "anthropic")["error"]})
        finally:
            close_all(reply.gens)


class _Blocks:
    """The stream's content blocks: at most one open; chat deltas in, Messages events out."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking", "text", "tool_use"
        self.calls: dict[int, int] = {}  # chat's tool call index -> its block index

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = block["type"]
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def feed(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id") is not None or call["index"] not in self.calls:  # a new call
                out += self._start({"type": "tool_use", "id": tool_use_id(), "name": fn.get("name") or "",
                                    "input": {}})
                self.calls[call["index"]] = self.index
            if fn.get("arguments") and self.calls[call["index"]] == self.index and self.open == "tool_use":
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out
