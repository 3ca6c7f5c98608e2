"""Counting turns of the running event loop, for tests of what one turn may do (no timing)."""

from __future__ import annotations

import asyncio


class LoopTurns:
    """A callback that reschedules itself with ``call_soon`` runs once per turn of the loop:
    ``turn`` is the number of the turn in progress. Start inside the loop, :meth:`stop` at the end."""

    def __init__(self) -> None:
        self.turn = 0
        self._running = True
        self._loop = asyncio.get_running_loop()
        self._tick()

    def _tick(self) -> None:
        self.turn += 1
        if self._running:
            self._loop.call_soon(self._tick)

    def stop(self) -> None:
        self._running = False
