"""One API request, several generations: OpenAI's `n` and batched prompts, TGI's `best_of`.

Each choice is its own request through the pipeline (its own seed: the request's seed + its place
among its prompt's choices), but they are admitted as one (one ticket for their summed cost, so a
request either fits whole or waits) and they share their prompt's prefill: the first choice of a
prompt is sent at once, its siblings once it has its first token. By then the prompt's blocks are
in the prefill worker's prefix cache and in the block store, so the siblings' prefills load them
instead of computing the prompt again (one prefill, n decodes; only the partial last block is
recomputed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request

from gateway.errors import ApiError
from gateway.generation import ClientGone, Generation, Step, wait_for_disconnect
from gateway.respond import rejection_reason, services
from gateway.tokenizer import apply_limits
from gateway.validation import GenerationSpec, read_json_body

# How long siblings wait for their first choice's first token before being sent anyway.
SIBLING_WAIT_S = 30.0


async def start_choices(request: Request, status: int, parse: Callable[[dict[str, Any]], GenerationSpec],
                        body: dict[str, Any] | None = None) -> list[Generation]:
    """Validate, tokenize every prompt, admit all choices as one, send; raises ApiError or
    ClientGone (nothing is held then)."""
    svc = services(request)
    arrival = time.monotonic()
    gens: list[Generation] = []
    try:
        if body is None:
            body = await read_json_body(request, svc.settings, status)
        spec = parse(body)
        prompts = spec.batch if spec.batch is not None else [spec.prompt]
        for p, prompt in enumerate(prompts):
            one = dataclasses.replace(spec, prompt=prompt, batch=None)
            prompt_ids = await svc.tokenizer.prompt_ids(one, status)
            prompt_ids, max_new_tokens = apply_limits(one, prompt_ids, svc.settings, status)
            gens += [Generation(svc, one, prompt_ids, max_new_tokens, arrival, status, choice=p * spec.n + j,
                                sibling=j) for j in range(spec.n)]
    except ApiError as exc:
        svc.metrics.reject(rejection_reason(exc))
        raise
    try:
        await gens[0].admit(asyncio.create_task(wait_for_disconnect(request)), cost=sum(g.cost for g in gens))
        for gen in gens[1:]:
            gen.attach()
        for gen in gens:
            if gen.sibling == 0:
                await gen.send(request)
        for leader in (g for g in gens if g.sibling == 0):
            siblings = [g for g in gens if g.choice // spec.n == leader.choice // spec.n and g is not leader]
            if siblings:
                svc.spawn(_send_after_first_token(request, leader, siblings))
    except BaseException:
        close_all(gens)
        raise
    return gens


async def _send_after_first_token(request: Request, leader: Generation, siblings: list[Generation]) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(leader.first_event.wait(), SIBLING_WAIT_S)
    for gen in siblings:
        try:
            await gen.send(request)
        except ApiError as exc:
            gen.lost(exc.message)


def close_all(gens: list[Generation]) -> None:
    for gen in gens:
        gen.close()


async def run_all_to_end(gens: list[Generation]) -> None:
    """Non-streaming: consume every choice; give up as soon as the client disconnects or one
    choice fails. Raises ClientGone or GenerationFailed."""

    async def consume(gen: Generation) -> None:
        async for _ in gen.steps():
            pass

    tasks = [asyncio.create_task(consume(gen)) for gen in gens]
    watcher = gens[0].client_gone
    waiters: set[asyncio.Future[Any]] = set(tasks) | ({watcher} if watcher is not None else set())
    try:
        while tasks and not all(t.done() for t in tasks):
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if watcher is not None and watcher in done:
                raise ClientGone()
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
                waiters.discard(task)
    finally:
        await _cancel(tasks)


async def merged_steps(gens: list[Generation]) -> AsyncIterator[tuple[Generation, Step]]:
    """Streaming: every choice's steps as they come, tagged with their choice; the first failure
    (GenerationFailed) ends the whole stream."""
    queue: asyncio.Queue[tuple[Generation, Step | BaseException | None]] = asyncio.Queue()

    async def pump(gen: Generation) -> None:
        try:
            async for step in gen.steps():
                await queue.put((gen, step))
            await queue.put((gen, None))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((gen, exc))

    tasks = [asyncio.create_task(pump(gen)) for gen in gens]
    try:
        remaining = len(gens)
        while remaining:
            gen, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield gen, item
    finally:
        await _cancel(tasks)


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        # Their own failures are moot: the caller is already ending the response (with the first
        # failure, or because the client left).
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
