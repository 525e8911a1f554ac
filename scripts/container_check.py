"""The HTTP side of scripts/container_check.sh: standard library only, so it runs on any host python3.

    reference                  (inside the image) transformers' greedy float32 output for the check's
                               prompts, as JSON on stdout: the oracle every served text must equal
                               (the stack runs --dtype float32, which serves the default model from
                               its GGUF's dequantized weights: the same weights as MODEL_DIR's)
    wait-ready URL SECONDS     until GET /ready answers 200
    parity URL REF             a streamed chat and a streamed completion equal the reference
    spread URL REF N           N concurrent streams; every decode worker's finished counter grows
    kill URL REF N CMD...      N concurrent streams; once all stream, run CMD (kill a decode
                               container); every stream completes with the reference text
    drain URL REF CMD...       one long stream; once it streams, run CMD (stop the services); the
                               stream completes with the reference text; prints CMD's seconds
    serves URL                 a streamed chat and completion come back, not empty
    idle URL SECONDS           until nothing is held: no running or waiting request, budget and
                               every decode worker's KV blocks back to zero
    decode-workers URL N SECONDS  until /stats lists N live decode workers
    pip-conf OUT               pip's effective settings on this host (`pip config list`: CA bundle,
                               find-links, file:// indexes, constraints) written to OUT as a pip.conf
                               for the build; prints the host paths the build must see (one a line)
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

MODEL_DIR = "/opt/baton/cache/models/SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
CHAT_TOKENS = 40
COMPLETION = ("Explain, step by step and in plain words, how a transformer language model turns a prompt "
              "into the next token: tokenization, embeddings, attention over previous tokens, the MLP, "
              "and finally the softmax over the vocabulary.")
COMPLETION_TOKENS = 48
LONG_TOKENS = 96  # kill and drain: long enough to be mid-stream when the signal lands


def reference() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    from baton.common.model_files import transformers_source

    path, kwargs = transformers_source(Path(MODEL_DIR))  # a GGUF's directory: transformers reads the file
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)

    def greedy(ids: list[int], n: int) -> str:
        t = torch.tensor([ids])
        out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=n, do_sample=False,
                             pad_token_id=2)
        return tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)

    chat_ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "input_ids"):
        chat_ids = chat_ids["input_ids"]
    prompt_ids = tok.encode(COMPLETION, add_special_tokens=False)
    json.dump({"chat": greedy(list(chat_ids), CHAT_TOKENS),
               "completion": greedy(prompt_ids, COMPLETION_TOKENS),
               "long": greedy(prompt_ids, LONG_TOKENS)}, sys.stdout)


def get(url: str, timeout: float = 5) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}
    except (OSError, ValueError):
        return 0, {}


RETRIED: list[str] = []  # 503s answered before any token (the API says: retry), reported


def open_stream(req: urllib.request.Request):
    """urlopen, retrying a 503 (refused at admission, nothing started) as a client should."""
    for attempt in range(5):
        try:
            return urllib.request.urlopen(req, timeout=300)
        except urllib.error.HTTPError as e:
            if e.code != 503 or attempt == 4:
                raise RuntimeError(f"HTTP {e.code}: {e.read()[:300]!r}") from None
            RETRIED.append(e.read()[:160].decode("utf-8", "replace"))
            time.sleep(min(float(e.headers.get("Retry-After") or 1), 2))


def retried() -> str:
    return f"; {len(RETRIED)} request(s) retried after a 503: {RETRIED[0]!r}" if RETRIED else ""


def stream(url: str, path: str, body: dict, on_token=None) -> str:
    """POST a streaming request, return the text of its SSE events; raises on an error event."""
    req = urllib.request.Request(url + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    text = []
    with open_stream(req) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"error event: {event}")
            for choice in event.get("choices", []):
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                text.append(piece)
                if piece and on_token:
                    on_token()
    return "".join(text)


def chat(url: str, on_token=None) -> str:
    return stream(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": CHAT_TOKENS, "temperature": 0},
                  on_token)


def completion(url: str, n: int = COMPLETION_TOKENS, on_token=None) -> str:
    return stream(url, "/v1/completions", {"prompt": COMPLETION, "max_tokens": n, "temperature": 0}, on_token)


def fail(msg: str) -> None:
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def wait_ready(url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    status, body = 0, {}
    while time.monotonic() < deadline:
        status, body = get(url + "/ready")
        if status == 200:
            print(f"ready: {body}")
            return
        time.sleep(1)
    fail(f"{url}/ready not 200 after {seconds:g} s (last: {status} {body})")


def serves(url: str) -> None:
    got_chat, got_completion = chat(url), completion(url)
    if not got_chat.strip() or not got_completion.strip():
        fail(f"empty output: chat {got_chat!r}, completion {got_completion!r}")
    print(f"chat: {got_chat[:60]!r}... completion: {got_completion[:60]!r}...")


def parity(url: str, ref: dict) -> None:
    got_chat, got_completion = chat(url), completion(url)
    if got_chat != ref["chat"]:
        fail(f"chat differs:\n  got  {got_chat!r}\n  want {ref['chat']!r}")
    if got_completion != ref["completion"]:
        fail(f"completion differs:\n  got  {got_completion!r}\n  want {ref['completion']!r}")
    print(f"chat and completion equal the reference ({got_chat[:40]!r}...){retried()}")


def concurrent(url: str, n: int, tokens: int, then: list[str] | None = None, min_tokens: int = 4) -> list:
    """n streams at once; `then` runs once every stream has `min_tokens` pieces. Returns texts or errors."""
    results: list = [None] * n
    counts = [0] * n
    lock = threading.Lock()

    def one(i: int) -> None:
        def tick() -> None:
            with lock:
                counts[i] += 1
        try:
            results[i] = completion(url, tokens, tick)
        except Exception as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    if then:
        deadline = time.monotonic() + 120
        while min(counts) < min_tokens and time.monotonic() < deadline and any(t.is_alive() for t in threads):
            time.sleep(0.05)
        print(f"tokens per stream before `{' '.join(then)}`: {counts}")
        subprocess.run(then, check=True)
    for t in threads:
        t.join(600)
    return results


def decode_finished(url: str) -> dict[str, int]:
    _, stats = get(url + "/stats")
    return {w["worker_id"]: int(w.get("num_requests_finished", 0)) for w in stats.get("workers", {}).get("decode", [])}


def spread(url: str, ref: dict, n: int) -> None:
    for attempt in range(4):
        before = decode_finished(url)
        results = concurrent(url, n, COMPLETION_TOKENS)
        bad = [r for r in results if r != ref["completion"]]
        if bad:
            fail(f"{len(bad)} of {n} streams differ from the reference: {bad[:2]}")
        time.sleep(2.5)  # the next heartbeat carries the counters
        after = decode_finished(url)
        grew = {w: after.get(w, 0) - before.get(w, 0) for w in after}
        print(f"round {attempt + 1}: finished per decode worker {grew}{retried()}")
        if len(after) >= 2 and all(v > 0 for v in grew.values()):
            return
    fail(f"not every decode worker served: {grew}")


def kill(url: str, ref: dict, n: int, cmd: list[str]) -> None:
    results = concurrent(url, n, LONG_TOKENS, then=cmd)
    errors = [r for r in results if isinstance(r, Exception)]
    wrong = [r for r in results if not isinstance(r, Exception) and r != ref["long"]]
    if errors or wrong:
        fail(f"{len(errors)} failed ({errors[:2]}), {len(wrong)} differ ({wrong[:1]}) of {n}")
    print(f"all {n} streams completed with the reference text{retried()}")


def drain(url: str, ref: dict, cmd: list[str]) -> None:
    took = []

    def run_cmd() -> None:
        t0 = time.monotonic()
        subprocess.run(cmd, check=True)
        took.append(time.monotonic() - t0)

    started = threading.Event()
    box: list = []

    def one() -> None:
        try:
            box.append(completion(url, LONG_TOKENS, started.set))
        except Exception as e:  # noqa: BLE001
            box.append(e)

    t = threading.Thread(target=one)
    t.start()
    if not started.wait(120):
        fail("the stream never started")
    stopper = threading.Thread(target=run_cmd)
    stopper.start()
    t.join(300)
    stopper.join(300)
    result = box[0] if box else RuntimeError("no result")
    print(f"`{' '.join(cmd)}` took {took[0] if took else float('nan'):.1f} s")
    if result != ref["long"]:
        fail(f"the stream in flight did not finish with the reference text: {result!r}")
    print(f"the stream in flight finished with the reference text{retried()}")


def idle(url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    stats: dict = {}
    while time.monotonic() < deadline:
        _, stats = get(url + "/stats")
        decode = stats.get("workers", {}).get("decode", [])
        if (stats and stats["token_budget"]["in_use"] == 0 and stats["requests"]["running"] == 0
                and stats["requests"]["waiting"] == 0 and decode
                and all(d.get("num_kv_blocks_used", 0) == 0 and d.get("num_requests_running", 0) == 0
                        for d in decode)):
            print(f"idle: budget {stats['token_budget']}, requests {stats['requests']}")
            return
        time.sleep(0.5)
    fail(f"still holding something after {seconds:g} s: {json.dumps(stats)[:2000]}")


def decode_workers(url: str, n: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    seen = 0
    while time.monotonic() < deadline:
        _, stats = get(url + "/stats")
        seen = len(stats.get("workers", {}).get("decode", []))
        if seen == n:
            print(f"{n} decode workers live")
            return
        time.sleep(1)
    fail(f"{seen} decode workers live after {seconds:g} s, wanted {n}")


def pip_conf(out: str) -> None:
    import os
    import shlex

    try:
        listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                                text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        listed = ""
    keys = ("cert", "find-links", "extra-index-url", "index-url", "constraint", "trusted-host")
    found: dict[str, str] = {}
    for line in sorted(listed.splitlines(), key=lambda l: l.startswith(":env:")):  # the environment wins
        name, _, value = line.partition("=")
        key = name.rsplit(".", 1)[-1]
        if key in keys and value:
            found[key] = " ".join(shlex.split(value))
    paths = set()
    for key, value in found.items():
        for item in value.split():
            path = (item[len("file://"):] if item.startswith("file://") else item).rstrip("/")
            if key.endswith("index-url"):  # a file:// index's pages link to files beside it
                path = os.path.dirname(path)
            if path.startswith("/") and path != "/" and os.path.exists(path):
                paths.add(path)
    with open(out, "w") as f:
        f.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in found.items()))
    for path in sorted(paths):
        print(path)


def main(argv: list[str]) -> None:
    cmd, args = argv[0], argv[1:]
    if cmd == "reference":
        return reference()
    if cmd == "pip-conf":
        return pip_conf(args[0])
    url = args[0].rstrip("/")
    if cmd == "wait-ready":
        return wait_ready(url, float(args[1]))
    if cmd == "idle":
        return idle(url, float(args[1]))
    if cmd == "serves":
        return serves(url)
    if cmd == "decode-workers":
        return decode_workers(url, int(args[1]), float(args[2]))
    ref = json.load(open(args[1]))
    if cmd == "parity":
        return parity(url, ref)
    if cmd == "spread":
        return spread(url, ref, int(args[2]))
    if cmd == "kill":
        return kill(url, ref, int(args[2]), args[3:])
    if cmd == "drain":
        return drain(url, ref, args[2:])
    fail(f"unknown command {cmd}")


if __name__ == "__main__":
    main(sys.argv[1:])
