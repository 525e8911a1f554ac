"""Chat's answer -> a Responses answer: `ResponseBuilder` turns the assistant message's deltas (as
gateway.openai.reply.OpenAIReply builds them: `content`, `reasoning_content`, `tool_calls`) into
Responses' output items and stream events, the whole answer being one big delta.

Rules:
- Output items come in the order their text starts: `reasoning` (its text as `reasoning_text`
  content), `message` (one `output_text` part), one `function_call` item per tool call. Text of
  another kind closes the open text item; calls stay open to the end (their arguments may still
  stream) and close in order.
- Every event carries `type` and a `sequence_number` counting from 0; the stream opens with
  `response.created` + `response.in_progress` and ends with exactly one of `response.completed`,
  `response.incomplete` (the answer hit max_output_tokens: status "incomplete",
  `incomplete_details.reason` "max_output_tokens") or `response.failed` (with `error`).
- An answer with no item at all still gets an (empty) message, so `output_text` is always there.
"""

from __future__ import annotations

import time
import uuid
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    details = chat_usage.get("completion_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens") or 0},
            "total_tokens": chat_usage["total_tokens"]}


class ResponseBuilder:
    """One response: its object (`snapshot`), its output items, and the events not yet sent."""

    def __init__(self, head: dict[str, Any]) -> None:
        # head: id, model and the request's settings (gateway.responses.validation's `settings`)
        self.response: dict[str, Any] = {"id": head["id"], "object": "response", "created_at": int(time.time()),
                                         "status": "in_progress", "error": None, "incomplete_details": None,
                                         "output": [], "usage": None, **head}
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._seq = 0
        self._text: dict[str, Any] | None = None  # the open message or reasoning item
        self._calls: dict[int, dict[str, Any]] = {}  # chat's tool call index -> its open item

    # ---- events ----

    def _event(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, "sequence_number": self._seq, **fields})
        self._seq += 1

    def drain(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    def snapshot(self) -> dict[str, Any]:
        return {**self.response, "output": [_public(item) for item in self.items]}

    def start(self) -> None:
        self._event("response.created", response=self.snapshot())
        self._event("response.in_progress", response=self.snapshot())

    # ---- deltas ----

    def feed(self, delta: dict[str, Any]) -> None:
        """One delta of chat's assistant message (the first one's role is no text)."""
        if delta.get("reasoning_content"):
            self._add_text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            self._add_text("message", delta["content"])
        for entry in delta.get("tool_calls") or []:
            self._add_call(entry)

    def _open(self, item: dict[str, Any]) -> int:
        self.items.append(item)
        index = len(self.items) - 1
        self._event("response.output_item.added", output_index=index, item=dict(item))
        return index

    def _add_text(self, kind: str, text: str) -> None:
        item = self._text
        if item is not None and item["type"] != kind:
            self._close_text()
            item = None
        if item is None:
            if kind == "message":
                item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                        "content": []}
                part = {"type": "reasoning_text", "text": ""}
            item["_index"] = self._open(item)
            self._event("response.content_part.added", item_id=item["id"], output_index=item["_index"],
                        content_index=0, part=dict(part))
            item["content"] = [part]
            self._text = item
        if not text:  # (the empty message of an answer without output)
            return
        item["content"][0]["text"] += text
        kind_event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        self._event(kind_event, item_id=item["id"], output_index=item["_index"], content_index=0, delta=text,
                    **extra)

    def _close_text(self, status: str = "completed") -> None:
        item, self._text = self._text, None
        if item is None:
            return
        index = item.pop("_index")
        part = item["content"][0]
        if item["type"] == "message":
            self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"], logprobs=[])
        else:
            self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"])
        self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                    part=dict(part))
        item["status"] = status
        self._event("response.output_item.done", output_index=index, item=_public(item))

    def _add_call(self, entry: dict[str, Any]) -> None:
        index = entry.get("index", len(self._calls))
        fn = entry.get("function") or {}
        item = self._calls.get(index)
        if item is None:
            self._close_text()  # a call ends the text before it
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": entry.get("id") or new_id("call"), "name": fn.get("name") or "", "arguments": ""}
            item["_index"] = self._open(item)
            self._calls[index] = item
        arguments = fn.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=item["_index"],
                        delta=arguments)

    # ---- the end ----

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        """Close every item (their events queued); the final response object."""
        cut = finish_reason == "length"
        status = "incomplete" if cut else "completed"
        if not self.items:
            self._add_text("message", "")
        self._close_text(status)
        for item in self._calls.values():
            index = item.pop("_index")
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=item["name"], arguments=item["arguments"])
            item["status"] = status
            self._event("response.output_item.done", output_index=index, item=_public(item))
        self._calls = {}
        self.response.update(status=status, usage=usage, completed_at=int(time.time()),
                             incomplete_details={"reason": "max_output_tokens"} if cut else None)
        return self.snapshot()

    def complete(self) -> None:
        """The stream's last event (once the response is stored)."""
        done = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        self._event(done, response=self.snapshot())

    def fail(self, message: str) -> None:
        """The generation failed after the stream began: `response.failed` with the error."""
        self.response.update(status="failed", error={"code": "server_error", "message": message})
        self._event("response.failed", response=self.snapshot())

    def chat_message(self) -> dict[str, Any]:
        """The answer as chat's assistant message (for the stored conversation)."""
        content = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


def _public(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if not k.startswith("_")}


def full_message_delta(message: dict[str, Any]) -> dict[str, Any]:
    """Chat's whole assistant message as one delta (its calls indexed, as streamed ones are)."""
    calls = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls") or [])]
    return {"content": message.get("content"), "reasoning_content": message.get("reasoning_content"),
            "tool_calls": calls}
