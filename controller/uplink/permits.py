"""Write turns: at most ``n`` holders, waiters served least remaining first (Crovella et al.,
"Connection scheduling in web servers", §3.3).

Both the application-level scheduler (:mod:`overtake.controller.uplink.app`) and the ordered
kernel bands (:mod:`overtake.controller.uplink.kernel`, ``lowest_writers``) hand out their write
turns through one :class:`Permits`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

__all__ = ["Permits"]


class Permits:
    """At most ``n`` holders; waiters served smallest key first (Crovella et al.'s SRPT queue)."""

    def __init__(self, n: int) -> None:
        self._free = n
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    async def acquire(self, key: float) -> None:
        """Wait for a turn; among waiters the smallest ``key`` (remaining bytes) goes first."""
        if self._free > 0 and not self._heap:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (key, next(self._seq), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted just before the cancel: hand it on
            raise

    def busy(self) -> bool:
        """An :meth:`acquire` now would wait."""
        return self._free <= 0 or bool(self._heap)

    def keep(self, key: float) -> bool:
        """The holder, now with ``key`` left, may go on unless a smaller key waits; in that
        case the permit passes to that waiter and False is returned."""
        while self._heap and self._heap[0][2].done():
            heapq.heappop(self._heap)  # waiters cancelled while queued
        if self._heap and self._heap[0][0] < key:
            self.release()
            return False
        return True

    def release(self) -> None:
        """Give the turn back: to the smallest waiter still waiting, else to the free pool."""
        while self._heap:
            _, _, fut = heapq.heappop(self._heap)
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1
