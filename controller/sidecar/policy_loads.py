"""How many policy loads may run at once, counted by their threads rather than their callers.

A policy is loaded in a worker thread under a deadline (``policy_load_timeout``). A thread cannot
be stopped: a load that outlives its deadline goes on inflating and allocating after its caller
was told so. Counting callers (a lock released at the deadline) would let every timed-out load
keep its memory while the next one starts; :class:`LoadSlots` keeps a slot busy until the thread
itself ends. At most ``running`` loads run; up to ``waiting`` more wait for a slot, within their
own deadline; any further load is refused at once with :class:`LoadBusy` (``PUT /-/policy``
answers 503), so a burst of uploads holds at most ``running`` loads' memory plus the waiting
requests' bodies.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from overtake.controller.errors import PolicyLoadError

__all__ = ["LoadBusy", "LoadSlots"]

T = TypeVar("T")


class LoadBusy(PolicyLoadError):
    """Every load slot is taken and the waiting line is full, or the wait outlasted the deadline."""


class LoadSlots:
    """Run blocking loads in threads, at most ``running`` at once and ``waiting`` queued."""

    def __init__(self, running: int = 1, waiting: int = 4) -> None:
        self.running = running
        self.max_waiting = waiting
        self._free = asyncio.Semaphore(running)
        self._waiting = 0
        self.threads = 0  #: load threads alive now (a timed-out one included)

    async def run(self, fn: Callable[[], T], timeout: float, what: str) -> T:
        """``fn()`` in a worker thread; its result, or :class:`TimeoutError` after ``timeout``
        seconds (the slot stays busy until the thread ends). Waiting for a slot counts toward
        ``timeout``.

        Raises
        ------
        LoadBusy
            No slot free and ``waiting`` loads already waiting, or none freed within ``timeout``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        await self._acquire(timeout, what)
        self.threads += 1
        fut = loop.run_in_executor(None, fn)
        fut.add_done_callback(self._finished)
        async with asyncio.timeout_at(deadline):
            return await asyncio.shield(fut)

    async def _acquire(self, timeout: float, what: str) -> None:
        if self._free.locked() and self._waiting >= self.max_waiting:
            raise LoadBusy(f"policy: {what}: {self.running} policy load(s) running and {self._waiting} waiting, "
                           "the most the sidecar takes at once; retry when they are done")
        self._waiting += 1
        try:
            async with asyncio.timeout(timeout):
                await self._free.acquire()
        except TimeoutError:
            raise LoadBusy(f"policy: {what}: no load slot freed within policy_load_timeout = {timeout:g} s "
                           "(an earlier load is still running past its deadline); retry later") from None
        finally:
            self._waiting -= 1

    def _finished(self, fut: asyncio.Future[Any]) -> None:
        self.threads -= 1
        self._free.release()
        if not fut.cancelled():
            fut.exception()  # retrieved: a load abandoned at its deadline logs no "never retrieved"
