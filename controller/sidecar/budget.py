"""A byte budget shared by many holders: request bodies held in memory, answers spooled to disk.

One limit for the whole sidecar, not one per connection: a per-connection cap times many
connections is no bound (hundreds of clients each holding a nearly complete body, or not
reading a large answer, each stayed within its own cap). Holders :meth:`take` bytes before they
hold them (refused beyond the limit) or :meth:`add` bytes they could not refuse, and
:meth:`give` them back; a holder waiting for room registers an :class:`asyncio.Event` with
:meth:`watch`, set whenever bytes are given back.
"""

from __future__ import annotations

import asyncio

__all__ = ["ByteBudget"]


class ByteBudget:
    """``used`` bytes held against ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._watchers: set[asyncio.Event] = set()

    @property
    def over(self) -> bool:
        """More bytes held than the limit (possible after :meth:`add`)."""
        return self.used > self.limit

    def take(self, n: int) -> bool:
        """Hold ``n`` more bytes if they fit within the limit; False (nothing held) if not."""
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def add(self, n: int) -> None:
        """Hold ``n`` more bytes, over the limit or not (the holder then waits for room)."""
        self.used += n

    def give(self, n: int) -> None:
        """``n`` bytes are no longer held; wakes the watchers."""
        if n <= 0:
            return
        self.used -= n
        for ev in self._watchers:
            ev.set()

    def watch(self, ev: asyncio.Event) -> None:
        """Set ``ev`` whenever bytes are given back, until :meth:`unwatch`."""
        self._watchers.add(ev)

    def unwatch(self, ev: asyncio.Event) -> None:
        self._watchers.discard(ev)
