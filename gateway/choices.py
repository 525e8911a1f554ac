"""One API request, several generations: OpenAI's `n` and batched prompts, TGI's `best_of`.

Each choice is its own request through the pipeline, but they are admitted as one (one ticket for
their summed cost, so a request either fits whole or waits) and they share their prompt's prefill:
the first choice of a prompt is sent at once, its siblings once it has its first token (their
seeds, that late send and best_of's ranking are gateway.siblings'). Here: validate -> tokenize ->
admit -> send, and the two ways of reading every choice to its end (whole, or merged as a stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import ApiError, ApiStyle, error_response
from gateway.generation import ClientGone, Generation, GenerationFailed, Step, send_all, wait_for_disconnect
from gateway.request_scope import own
from gateway.respond import client_gone_response, rejection_reason, services
from gateway.siblings import sampling_for, send_after_first_tokens
from gateway.generation_spec import GenerationSpec
from gateway.tokenizer import apply_limits
from gateway.validation import read_json_body


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
        # In a thread: a request's schemas and tools are compiled here (llguidance), and a client
        # can send many large ones; the event loop must keep serving every other stream.
        spec = await asyncio.to_thread(parse, body)
        n = spec.choices.n
        for p, one in enumerate(spec.per_prompt()):
            prompt_ids = await svc.tokenizer.prompt_ids(one, status, svc.settings)  # refused by characters if need be
            prompt_ids, max_new_tokens = apply_limits(one, prompt_ids, svc.settings, status)
            choices = [Generation(svc, one, prompt_ids, sampling_for(one.sampling, max_new_tokens, j), arrival,
                                  status, choice=p * n + j, sibling=j) for j in range(n)]
            own(request.scope, *choices)  # released when the exchange ends, whatever happens
            gens += choices
    except ApiError as exc:
        svc.metrics.reject(rejection_reason(exc))
        raise
    try:
        await gens[0].admit(asyncio.create_task(wait_for_disconnect(request)), cost=sum(g.cost for g in gens))
        for gen in gens[1:]:
            gen.attach()
        await send_all([gen for gen in gens if gen.sibling == 0], request)
        # gens are in choice order: prompt p's choices are gens[p * n:(p + 1) * n]
        groups = [(gens[i], gens[i + 1:i + n]) for i in range(0, len(gens), n)]
        if n > 1:
            svc.spawn(send_after_first_tokens(request, groups))
    except BaseException:
        close_all(gens)
        raise
    return gens


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


async def failed_before_the_end(gens: list[Generation], style: ApiStyle,
                                headers: dict[str, str]) -> Response | None:
    """Non-streaming: run every choice to its end and release them; None when they all finished,
    else what to answer instead (the client left: 499; a generation failed: its error in the API's
    shape)."""
    try:
        await run_all_to_end(gens)
    except ClientGone:
        return client_gone_response()
    except GenerationFailed as exc:
        return error_response(exc.error, style, headers)
    finally:
        close_all(gens)
    return None


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
