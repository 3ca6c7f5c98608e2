"""Per client, the reservation for its next-stage request (the limiter's tandem routing: a
stage's ``next``), and the timer that gives it up when the follow-up does not come.
"""

from __future__ import annotations

import asyncio

from overtake.controller.sidecar.http1 import ClientConnection
from overtake.controller.sidecar.limiter import Limiter, Ticket

__all__ = ["Reservations"]


class Reservations:
    """The clients' reservations, each with the timer that gives it up."""

    def __init__(self, limiter: Limiter) -> None:
        self.limiter = limiter
        self._holds: dict[ClientConnection, tuple[Ticket, asyncio.TimerHandle]] = {}

    def held(self, conn: ClientConnection) -> Ticket | None:
        """The client's reservation, if it has one."""
        held = self._holds.get(conn)
        return None if held is None else held[0]

    def keep(self, conn: ClientConnection, hold: Ticket, timeout: float) -> None:
        """Hold ``hold`` for the client's next request for ``timeout`` seconds."""
        self._holds[conn] = (hold, asyncio.get_running_loop().call_later(timeout, self._expire, conn, hold))

    def drop(self, conn: ClientConnection) -> Ticket | None:
        """Forget the client's reservation (its timer too); the reservation, if it had one."""
        held = self._holds.pop(conn, None)
        if held is None:
            return None
        held[1].cancel()
        return held[0]

    def _expire(self, conn: ClientConnection, hold: Ticket) -> None:
        """The follow-up did not come within ``follow_up_timeout``: the reservation is given up."""
        held = self._holds.get(conn)
        if held is not None and held[0] is hold:
            self.drop(conn)
            self.limiter.abandon(hold)

