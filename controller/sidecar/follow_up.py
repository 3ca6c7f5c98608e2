"""The limiter's tandem routing: a reservation for a client's follow-up request.

Van der Weij et al. §2: a request leaving stage i joins queue i+1 at that instant. When a stage
has a ``next`` stage, :meth:`Limiter.release` puts a *reservation* for the client's follow-up into
queue i+1 before the policy is consulted (:meth:`FollowUps._reserve`); the follow-up takes it over
(:meth:`FollowUps.claim`) or it is given up (:meth:`FollowUps.abandon`). The limiter inherits
these steps; they keep to its tandem state and listeners and decide nothing themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from overtake.controller.sidecar.listener import LimiterListener
from overtake.controller.sidecar.tandem import DONE, QUEUED, TandemState, Ticket

__all__ = ["FollowUps"]


class FollowUps:
    """Reservations in the limiter's tandem (mixed into :class:`~.limiter.Limiter`)."""

    tandem: TandemState
    listeners: list[LimiterListener]
    clock: Callable[[], float]
    _seq: int

    def _dispatch(self) -> None:
        raise NotImplementedError

    def cancel(self, t: Ticket, reason: str) -> bool:
        raise NotImplementedError

    def release(self, t: Ticket, outcome: str, follow: tuple[int, int] | None = None) -> Ticket | None:
        raise NotImplementedError

    def _reserve(self, done: Ticket, follow: tuple[int, int], now: float) -> Ticket:
        """Queue a reservation for the follow-up of ``done`` in (stage, phase) ``follow`` and tell
        the listeners (they pair one transaction's demands); the caller dispatches."""
        stage, phase = follow
        self._seq += 1
        hold = Ticket(stage, phase, "", self._seq, now)
        hold.held = True
        self.tandem.push(hold)
        for lsn in self.listeners:
            lsn.on_follow(done, hold, now)
        return hold

    def claim(self, hold: Ticket, phase: int, route: str) -> Ticket | None:
        """The follow-up request arrived: it becomes ``hold`` (admitted already, or queued with a
        ``future``) in ``phase``; None if the reservation has lapsed (submit it instead)."""
        if hold.status == DONE or not hold.held:
            return None
        now = self.clock()
        hold.held = False
        hold.route = route
        hold.t_arrive = now
        moved = phase != hold.phase
        if hold.status == QUEUED:
            if moved:
                self.tandem.requeue(hold, phase)
            hold.phase = hold.start_phase = phase
            if moved:
                self._dispatch()
            if hold.status == QUEUED:
                hold.future = asyncio.get_running_loop().create_future()
        else:
            self.tandem.advance(now)
            hold.t_admit, hold.v_admit = now, self.tandem.v  # its service starts now, not at the reservation
            if moved:
                self.tandem.move_thread(hold, phase)
            hold.phase = hold.start_phase = phase
            if moved:
                self._dispatch()
        for lsn in self.listeners:
            lsn.on_claim(hold, now)
        return hold

    def abandon(self, hold: Ticket) -> None:
        """End a reservation whose request did not come (idempotent)."""
        if not hold.held or hold.status == DONE:
            return
        hold.held = False
        if hold.status == QUEUED:
            self.cancel(hold, "follow_up_missing")
        else:
            self.release(hold, "unused")
