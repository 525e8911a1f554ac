"""The choices of one prompt (OpenAI's `n` and `best_of`, TGI's `best_of`): seeds, late sends, ranking.

Rules of this file:
- Choice `j` of a prompt draws with the request's seed + j (wrapped as a uint64 add): reproducible
  for a seeded request, and never the same stream as its siblings'.
- A prompt's first choice is sent at once, its siblings once that one has its first token (or
  SIBLING_WAIT_S passed): by then the prompt's blocks are in the prefill worker's prefix cache and
  in the block store, so the siblings' prefills load them instead of computing the prompt again
  (one prefill, n decodes). One task per request sends them, in as few round trips as it can.
- A sibling whose send fails is ended through `Generation.lost` (its steps() raise), never left
  waiting for events that cannot come.
- best_of ranks a prompt's candidates by the total logprob of their tokens (TGI's and OpenAI's rule).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from starlette.requests import Request

from baton.common.sampling_params import SamplingParams
from gateway.errors import ApiError
from gateway.generation import Generation, send_all

log = logging.getLogger(__name__)

# How long siblings wait for their first choice's first token before being sent anyway.
SIBLING_WAIT_S = 30.0
SEED_SPAN = 2**64  # the wire carries seeds in [-2**63, 2**64 - 1] (msgpack's integers)


def sibling_seed(seed: int, sibling: int) -> int:
    """Choice `sibling`'s seed: `seed + sibling`, wrapped as a uint64 adds, so a seed near 2**64
    still travels (msgpack cannot carry 2**64) and stays distinct from its siblings'."""
    derived = seed + sibling
    return derived - SEED_SPAN if derived >= SEED_SPAN else derived


def sampling_for(sampling: SamplingParams, max_new_tokens: int, sibling: int) -> SamplingParams:
    """One generation's SamplingParams: the request's, with the length its prompt leaves room for
    and its own seed (the request's always has one: SamplingParams draws it when none was sent)."""
    assert sampling.seed is not None
    return dataclasses.replace(sampling, max_tokens=max_new_tokens, min_tokens=min(sampling.min_tokens, max_new_tokens),
                               seed=sibling_seed(sampling.seed, sibling))


async def send_after_first_tokens(request: Request, groups: list[tuple[Generation, list[Generation]]]) -> None:
    """Send each prompt's siblings once its leader has its first token (or SIBLING_WAIT_S passed):
    one task per request, and the siblings of leaders that got theirs together in one round trip
    (64 prompts x n=16 is one task, not 64 sending at once)."""
    waits = {asyncio.ensure_future(leader.first_event.wait()): siblings for leader, siblings in groups}
    deadline = asyncio.get_running_loop().time() + SIBLING_WAIT_S
    try:
        while waits:
            timeout = deadline - asyncio.get_running_loop().time()
            done, _ = await asyncio.wait(waits, timeout=max(0.0, timeout), return_when=asyncio.FIRST_COMPLETED)
            ready = done or set(waits)  # none in time: send the rest anyway
            await _send_siblings([gen for wait in ready for gen in waits.pop(wait)], request)
    finally:
        for wait in waits:
            wait.cancel()


async def _send_siblings(siblings: list[Generation], request: Request) -> None:
    try:
        await send_all(siblings, request)
    except ApiError as exc:
        for gen in siblings:
            gen.lost(exc.message, exc)
    except Exception as exc:  # noqa: BLE001 - a bug here must end the siblings, never strand them
        # Nobody awaits this task: siblings whose send died silently would wait the whole
        # event_timeout for events that can never come, holding the request's budget.
        choices = ", ".join(str(gen.choice) for gen in siblings)
        log.exception("could not send choices %s of a request", choices)
        for gen in siblings:
            gen.lost(f"internal error sending choices {choices}: {type(exc).__name__}: {exc}",
                     ApiError(500, f"internal error sending choices {choices}", kind="generation"))


def ranked(candidates: list[Generation]) -> list[Generation]:
    """Best first: by the total logprob of their tokens."""
    return sorted(candidates, key=lambda g: g.total_logprob, reverse=True)


def keep_best(gens: list[Generation], n: int, keep: int) -> list[Generation]:
    """best_of: the `keep` best of each prompt's `n` candidates (gens in choice order), renumbered
    as the answer's choices 0, 1, ..."""
    best: list[Generation] = []
    for start in range(0, len(gens), n):
        best += ranked(gens[start:start + n])[:keep]
    for index, gen in enumerate(best):
        gen.choice = index
    return best
