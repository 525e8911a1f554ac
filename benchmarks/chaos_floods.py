"""Issue 38's requests in the chaos soak's mix (benchmarks/chaos.py): keyless probes, embedding floods
and stored-response floods. Each must get its own clear answer, never a hang, a 500 or a silent loss:

- keyless: a request without the API key to a route that needs it must be a JSON 401; the probes
  (/health, /live, /metrics, /version) must answer without it (a 503 from /health while Redis is down
  is a clear answer too);
- embed_flood: one /v1/embeddings request of 64-512 inputs: 200 with one vector per input, in order,
  or a clear 429/503 (overload, a fault under way); never a timeout;
- responses_flood: /v1/responses with `store: true` and a short prompt (chaos.py admits 128 input tokens), against a 16 KiB
  --responses-max-bytes: 200, and the stored answer is either read back by its id or was dropped
  (404) to make room for newer ones; never a 500.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import httpx

KEYED_ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"),
                ("POST", "/v1/embeddings"), ("POST", "/embed"), ("GET", "/v1/responses/resp_x"),
                ("DELETE", "/v1/responses/resp_x"), ("GET", "/stats"), ("GET", "/v1/models"),
                ("POST", "/v1/messages"), ("POST", "/generate"), ("GET", "/openapi.json"), ("GET", "/info")]
OPEN_PROBES = ["/health", "/live", "/metrics", "/version"]
WORDS = ["rain", "río", "川", "Fluss", "река", "rivière", "نهر", "sông"]


@dataclass
class FloodTally:
    answered: dict[str, int] = field(default_factory=lambda: {"keyless": 0, "embed_flood": 0, "responses_flood": 0})
    clear_errors: dict[str, int] = field(default_factory=dict)  # 429 / 503: overload or a fault under way
    stored_then_dropped: int = 0  # a stored answer dropped for newer ones (the cap), by design
    unexpected: list[str] = field(default_factory=list)
    hung: int = 0

    def clear(self, kind: str, status: int) -> None:
        key = f"{kind}: {status}"
        self.clear_errors[key] = self.clear_errors.get(key, 0) + 1


async def flood(client: httpx.AsyncClient, key_headers: dict[str, str], tally: FloodTally, rng: random.Random,
                hang_s: float) -> None:
    kind = rng.choice(["keyless", "embed_flood", "responses_flood"])
    try:
        async with asyncio.timeout(hang_s):
            if kind == "keyless":
                await _keyless(client, tally, rng)
            elif kind == "embed_flood":
                await _embed_flood(client, key_headers, tally, rng)
            else:
                await _responses_flood(client, key_headers, tally, rng)
    except TimeoutError:
        tally.hung += 1
        tally.unexpected.append(f"{kind}: hung")
    except httpx.HTTPError as exc:
        tally.clear(kind, 0)  # the connection failed (a fault under way): the client knows
        del exc


async def _keyless(client: httpx.AsyncClient, tally: FloodTally, rng: random.Random) -> None:
    if rng.random() < 0.3:
        path = rng.choice(OPEN_PROBES)
        r = await client.get(path)
        if r.status_code == 200 or (r.status_code == 503 and path == "/health"):
            tally.answered["keyless"] += 1
        else:
            tally.unexpected.append(f"keyless probe {path}: {r.status_code}")
        return
    method, path = rng.choice(KEYED_ROUTES)
    r = await client.request(method, path, json={"prompt": "x"} if method == "POST" else None)
    if r.status_code == 401 and r.headers.get("content-type", "").startswith("application/json"):
        tally.answered["keyless"] += 1
    else:
        tally.unexpected.append(f"keyless {method} {path}: {r.status_code} {r.text[:60]!r}")


async def _embed_flood(client: httpx.AsyncClient, key_headers: dict[str, str], tally: FloodTally,
                       rng: random.Random) -> None:
    n = rng.choice([64, 256, 512])
    inputs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))) for _ in range(n)]
    r = await client.post("/v1/embeddings", json={"input": inputs}, headers=key_headers)
    if r.status_code == 200:
        data = r.json()["data"]
        if [d["index"] for d in data] == list(range(n)) and all(d["embedding"] for d in data):
            tally.answered["embed_flood"] += 1
        else:
            tally.unexpected.append(f"embed_flood: {len(data)} of {n} vectors")
    elif r.status_code in (429, 503):
        tally.clear("embed_flood", r.status_code)
    else:
        tally.unexpected.append(f"embed_flood: {r.status_code} {r.text[:60]!r}")


async def _responses_flood(client: httpx.AsyncClient, key_headers: dict[str, str], tally: FloodTally,
                           rng: random.Random) -> None:
    body = {"input": "Say hi.", "instructions": "Be brief. " * 20, "store": True, "max_output_tokens": 4}
    r = await client.post("/v1/responses", json=body, headers=key_headers)
    if r.status_code in (429, 503):
        tally.clear("responses_flood", r.status_code)
        return
    if r.status_code != 200:
        tally.unexpected.append(f"responses_flood: {r.status_code} {r.text[:60]!r}")
        return
    response_id = r.json()["id"]
    await asyncio.sleep(rng.random())  # others' floods may drop it meanwhile: the cap at work
    got = await client.get(f"/v1/responses/{response_id}", headers=key_headers)
    if got.status_code == 200 and got.json().get("id") == response_id:
        tally.answered["responses_flood"] += 1
    elif got.status_code == 404:
        tally.stored_then_dropped += 1
        tally.answered["responses_flood"] += 1
    elif got.status_code == 503:
        tally.clear("responses_flood", 503)
    else:
        tally.unexpected.append(f"responses_flood read back: {got.status_code} {got.text[:60]!r}")


def report_rows(tally: FloodTally) -> list[tuple[str, object]]:
    return [
        ("keyless requests answered 401 (probes 200)", tally.answered["keyless"]),
        ("embedding floods answered with every vector", tally.answered["embed_flood"]),
        ("stored-response floods answered (of them dropped by the cap)",
         f"{tally.answered['responses_flood']} ({tally.stored_then_dropped})"),
        ("floods answered 429/503 (overload or a fault under way)", sum(tally.clear_errors.values())),
        ("floods answered otherwise", len(tally.unexpected)),
        ("floods hung", tally.hung),
    ]
