"""One-at-a-time gates for work the gateway moves off its event loop (batch tokenizing, parsing big
bodies): a thread each would let a burst of them take every core and the loop's GIL turns."""

from __future__ import annotations

import asyncio
import weakref


class LoopGate:
    """Calling it gives the running event loop's semaphore of one (a semaphore is bound to one loop;
    tests run several)."""

    def __init__(self) -> None:
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = \
            weakref.WeakKeyDictionary()

    def __call__(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        gate = self._gates.get(loop)
        if gate is None:
            gate = self._gates[loop] = asyncio.Semaphore(1)
        return gate
