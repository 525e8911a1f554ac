"""One streaming request to an OpenAI-compatible `/v1/completions` or `/v1/chat/completions`, timed
as vLLM's benchmark does (its `openai` and `openai-chat` backends)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class RequestInput:
    prompt: str
    prompt_len: int
    output_len: int
    model: str
    api_url: str
    ignore_eos: bool = False
    chat: bool = False  # the prompt is one user message to a chat completions endpoint


@dataclass
class RequestOutput:
    success: bool = False
    error: str = ""
    generated_text: str = ""
    ttft: float = 0.0  # seconds from sending to the first chunk with text
    itl: list[float] = field(default_factory=list)  # gaps between consecutive chunks with text
    latency: float = 0.0  # E2EL: sending to the end of the stream
    prompt_len: int = 0
    output_tokens: int | None = None  # from the final usage chunk, when the server sends one
    start_time: float = 0.0  # seconds since the benchmark started


def make_client(max_connections: int | None = None, api_key: str | None = None) -> httpx.AsyncClient:
    # trust_env=False: a proxy from the environment must not sit between us and a local server.
    # No read timeout beyond vLLM's 6 hours: a slow server is what is being measured.
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600, connect=60), limits=limits, trust_env=False,
                             headers=headers)


def _payload(req: RequestInput) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": req.model, "temperature": 0.0, "stream": True,
                               "stream_options": {"include_usage": True}}
    if req.chat:  # as vLLM's openai-chat backend sends it
        payload.update(messages=[{"role": "user", "content": req.prompt}], max_completion_tokens=req.output_len)
    else:
        payload.update(prompt=req.prompt, max_tokens=req.output_len)
    if req.ignore_eos:  # an extension (vLLM, Baton); plain OpenAI servers reject unknown fields
        payload["ignore_eos"] = True
    return payload


async def request_completion(client: httpx.AsyncClient, req: RequestInput,
                             bench_start: float = 0.0) -> RequestOutput:
    """Send one request and time its stream. Never raises: failures are recorded, not retried."""
    out = RequestOutput(prompt_len=req.prompt_len)
    start = time.perf_counter()
    out.start_time = start - bench_start
    last = start
    text_parts: list[str] = []
    first_choice: float | None = None  # a chunk with choices but no text (e.g. only special tokens)
    try:
        async with client.stream("POST", req.api_url, json=_payload(req)) as resp:
            if resp.status_code != 200:
                # 429 overloaded included: counted as failed, as the server answered it.
                body = (await resp.aread()).decode("utf-8", "replace")
                out.error = f"HTTP {resp.status_code}: {body[:500]}"
                return out
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line or line.startswith(":"):  # keep-alive / SSE comment
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # an error after the stream started
                    out.error = json.dumps(chunk["error"])[:500]
                    return out
                choices = chunk.get("choices")
                if choices:
                    text = _chunk_text(choices[0], req.chat)
                    if first_choice is None:
                        first_choice = time.perf_counter()
                    if text:
                        now = time.perf_counter()
                        if not text_parts:
                            out.ttft = now - start
                        else:
                            out.itl.append(now - last)
                        last = now
                        text_parts.append(text)
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    out.output_tokens = int(usage["completion_tokens"])
        out.latency = time.perf_counter() - start
        out.generated_text = "".join(text_parts)
        if text_parts:
            out.success = True
        elif first_choice is not None:  # tokens came, none of them visible as text
            out.success = True
            out.ttft = first_choice - start
        else:
            out.error = "Never received a chunk with text to calculate TTFT."
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    """A chunk's generated text; chat's reasoning too (a thinking model's first tokens are thoughts)."""
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


async def fetch_first_model(client: httpx.AsyncClient, base_url: str) -> str:
    resp = await client.get(base_url.rstrip("/") + "/v1/models", timeout=30)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]
