"""Workloads for the benchmark: random token prompts (as vLLM's `random` dataset), input-grounded
chat prompts whose answer repeats the prompt (`grounded`: where speculative decoding pays), or a file."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens, counted with the benchmark's tokenizer
    expected_output_len: int  # sent as max_tokens
    # sent instead of `prompt` to a chat endpoint, when `prompt` is already chat-templated text
    chat_prompt: str | None = None


def load_tokenizer(path: str | os.PathLike | None) -> Any:
    """A Hugging Face tokenizer from a local directory (or the local HF cache): never the network."""
    from transformers import AutoTokenizer

    if path is None:
        from baton.common.model_files import default_model_dir

        path = default_model_dir()
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _allowed_token_ids(tokenizer: Any) -> np.ndarray:
    # Special and added tokens (<|im_start|>, <repo_name>, ...) would change what the server sees
    # (chat markup, EOS) and re-encode unpredictably: sample only ordinary vocabulary.
    vocab_size = len(tokenizer)
    banned = set(tokenizer.all_special_ids)
    banned.update(tokenizer.get_added_vocab().values())
    return np.array([t for t in range(vocab_size) if t not in banned], dtype=np.int64)


def _uniform_lengths(rng: np.random.Generator, length: int, ratio: float, n: int) -> np.ndarray:
    # vLLM's rule: uniform integers in [len*(1-r), len*(1+r)], at least 1.
    low = max(1, int(length * (1 - ratio)))
    high = max(low, int(length * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def sample_random_requests(tokenizer: Any, num_requests: int, input_len: int, output_len: int,
                           range_ratio: float = 0.0, seed: int = 0,
                           output_range_ratio: float | None = None) -> list[SampleRequest]:
    """Prompts of random token ids, decoded to text (what is sent) and re-encoded to count them.

    Decoding random ids and encoding the text again rarely gives the same ids (tokens merge at the
    seams), so, as vLLM does, the re-encoded ids are cut to the target length and decoded again;
    the prompt's length is what the tokenizer says of the final text.
    """
    output_range_ratio = range_ratio if output_range_ratio is None else output_range_ratio
    if not 0 <= range_ratio < 1 or not 0 <= output_range_ratio < 1:
        raise ValueError("--random-range-ratio and --random-output-range-ratio must be in [0, 1)")
    rng = np.random.default_rng(seed)
    allowed = _allowed_token_ids(tokenizer)
    input_lens = _uniform_lengths(rng, input_len, range_ratio, num_requests)
    output_lens = _uniform_lengths(rng, output_len, output_range_ratio, num_requests)
    requests = []
    for in_len, out_len in zip(input_lens, output_lens):
        ids = allowed[rng.integers(0, len(allowed), size=int(in_len))].tolist()
        text = tokenizer.decode(ids)
        re_encoded = tokenizer.encode(text, add_special_tokens=False)[: int(in_len)]
        text = tokenizer.decode(re_encoded)
        prompt_len = len(tokenizer.encode(text, add_special_tokens=False))
        requests.append(SampleRequest(text, prompt_len, int(out_len)))
    return requests


def sample_file_requests(path: str | os.PathLike, tokenizer: Any, num_requests: int,
                         default_output_len: int) -> list[SampleRequest]:
    """Prompts from a file: JSON lines with "prompt" (and optional "max_tokens"), or plain text lines.

    A file shorter than --num-prompts is cycled, as vLLM oversamples a small dataset.
    """
    entries: list[tuple[str, int]] = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        prompt, max_tokens = line, default_output_len
        if line.lstrip().startswith("{"):
            obj = json.loads(line)
            prompt = obj["prompt"]
            max_tokens = int(obj.get("max_tokens") or default_output_len)
        entries.append((prompt, max_tokens))
    if not entries:
        raise ValueError(f"{path}: no prompts")
    requests = []
    for i in range(num_requests):
        prompt, max_tokens = entries[i % len(entries)]
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        requests.append(SampleRequest(prompt, prompt_len, max_tokens))
    return requests


# Passages to repeat or lightly edit: prose, code, a notice, an explanation (the work people give
# self-hosted models most: editing code, answering from a document).
PASSAGES = [
    "The river starts in the mountains as a narrow stream of melted snow. It gathers water from a hundred "
    "small creeks as it runs down through the pine forests, and by the time it reaches the valley it is wide "
    "and slow. Farmers along its banks have used it for centuries to water their fields of wheat and barley. "
    "In spring the river floods the low meadows, leaving a layer of dark soil behind when the water goes down. "
    "In summer children swim in the shallow pools near the old stone bridge, and in autumn the fishermen come "
    "back to the same places their fathers fished, waiting for the salmon to return from the sea.",
    "def merge_sorted(a, b):\n    result = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            result.append(a[i])\n            i += 1\n        else:\n"
    "            result.append(b[j])\n            j += 1\n    result.extend(a[i:])\n    result.extend(b[j:])\n"
    "    return result\n\n\ndef binary_search(items, target):\n    low, high = 0, len(items) - 1\n"
    "    while low <= high:\n        middle = (low + high) // 2\n        if items[middle] == target:\n"
    "            return middle\n        if items[middle] < target:\n            low = middle + 1\n"
    "        else:\n            high = middle - 1\n    return -1\n",
    '{\n  "name": "inventory-service",\n  "version": "2.4.1",\n  "port": 8080,\n  "database": {\n'
    '    "host": "db.internal",\n    "port": 5432,\n    "user": "inventory",\n    "pool_size": 20\n  },\n'
    '  "cache": {\n    "enabled": true,\n    "ttl_seconds": 300\n  },\n  "features": ["search", "export", '
    '"audit-log"],\n  "log_level": "info"\n}',
    "Our office will be closed on Monday for the public holiday. Orders placed over the weekend will be "
    "shipped on Tuesday morning. If you need help before then, please write to the support address and a "
    "member of the team will answer as soon as possible. Returns received during the closure will be "
    "processed on Wednesday, and refunds will reach your account within five working days. The warehouse "
    "will open one hour later than usual on Tuesday while the new shelves are installed. Thank you for your "
    "patience, and we wish you a pleasant long weekend.",
]
ASKS = ["Repeat the following text exactly, with no comment:\n\n{}",
        "Copy this text word for word, then stop:\n\n{}",
        "Rewrite the following with the same words, fixing nothing:\n\n{}"]


def sample_grounded_requests(tokenizer: Any, num_requests: int, output_len: int, seed: int = 0) -> list[SampleRequest]:
    """Chat prompts (the tokenizer's own template, sent as completion text) asking to repeat or
    rewrite a passage: the answer repeats the prompt. Cycled through passages and asks from `seed`."""
    requests = []
    for i in range(num_requests):
        text = ASKS[(seed + i) % len(ASKS)].format(PASSAGES[(seed + i) % len(PASSAGES)])
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True)
        requests.append(SampleRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), output_len,
                                      chat_prompt=text))
    return requests
