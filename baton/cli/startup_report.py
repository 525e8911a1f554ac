"""What `baton serve` prints once it serves: a handful of lines saying what is served, from where,
with which settings, how many requests of the longest length fit in the KV cache, where, and
whether a key is needed.

The KV figures come from the running deployment (the gateway's GET /stats carries each decode
worker's heartbeat: num_kv_blocks_total x block_size; GET /info the longest request), so they are
what the workers allocated, not a guess; a line whose figures did not answer is left out.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def fetch_json(url: str, api_key: str | None, timeout: float = 5.0) -> dict[str, Any] | None:
    """GET `url` (with the API key where one is set: /info and /stats need it); None if it fails."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            body = json.loads(resp.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def model_origin(model_arg: str | None, model_dir: Path, from_hub: bool) -> str:
    """Where the served weights came from, in words."""
    if model_arg is None or str(model_arg) == "":
        return f"the default model, cached in {model_dir}"
    if from_hub:
        return f"the Hugging Face Hub ({model_arg}), cached in {model_dir}"
    if str(model_arg).endswith(".gguf"):
        return f"{model_arg}, its blocks read from the file (config and tokenizer from its metadata in {model_dir})"
    return str(model_dir)


def kv_capacity_line(stats: dict[str, Any] | None, info: dict[str, Any] | None,
                     decode_workers: int | None = None) -> str | None:
    """'KV cache: 21840 tokens per decode worker (1); 2 requests of 8192 tokens fit in each at once'.
    `decode_workers`: how many were started (serving begins with the first: the line says how many
    of them were up when it was written)."""
    workers = ((stats or {}).get("workers") or {}).get("decode") or []
    tokens = [w["num_kv_blocks_total"] * w["block_size"] for w in workers
              if isinstance(w, dict) and isinstance(w.get("num_kv_blocks_total"), int)
              and isinstance(w.get("block_size"), int)]
    if not tokens:
        return None
    fewest = min(tokens)
    per_worker = f"{fewest}" if len(set(tokens)) == 1 else f"{fewest} to {max(tokens)}"
    up = (f"{len(tokens)} of {decode_workers} up, the others still loading"
          if decode_workers is not None and decode_workers > len(tokens) else f"{len(tokens)}")
    line = f"KV cache: {per_worker} tokens per decode worker ({up})"
    longest = (info or {}).get("max_total_tokens")
    seats = [w["max_num_seqs"] for w in workers if isinstance(w, dict) and isinstance(w.get("max_num_seqs"), int)]
    if isinstance(longest, int) and longest > 0:
        fit = fewest // longest
        if seats and fit > min(seats):  # a small model's pool outlasts the batch: seats bound it
            line += (f"; {min(seats)} request(s) run at once in each (--max-num-seqs), even of the longest "
                     f"length ({longest} tokens)")
        else:
            line += (f"; {fit} request(s) of the longest length ({longest} tokens) fit in each at once" if fit
                     else f"; less than one request of the longest length ({longest} tokens): pass a larger "
                          "--kv-cache-memory or a smaller --max-model-len")
    return line


def summary_lines(*, model_name: str, origin: str, url: str, settings: str, api_key: str | None,
                  stats: dict[str, Any] | None, info: dict[str, Any] | None,
                  decode_workers: int | None = None) -> list[str]:
    """The lines printed after 'Baton is serving': the model, its settings, KV room, the URL, the key."""
    lines = [f"Baton is serving {model_name} at {url}",
             f"  model: {origin}",
             f"  settings: {settings}"]
    kv = kv_capacity_line(stats, info, decode_workers)
    if kv:
        lines.append(f"  {kv}")
    lines.append("  API key: required (Authorization: Bearer <key>)" if api_key
                 else "  no API key: anyone who can reach the port can use it (set BATON_API_KEY to require one)")
    return lines
