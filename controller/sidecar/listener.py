"""What a limiter tells the parts that watch it (the online loop's recorder, the gate opener, a
stage's lock, the live verification): :class:`LimiterListener`, apart from the limiter itself so
that a watcher the limiter consults (:class:`overtake.controller.sidecar.stage_lock.StageLock`)
imports no cycle."""

from __future__ import annotations

from overtake.controller.sidecar.tandem import Ticket

__all__ = ["LimiterListener"]


class LimiterListener:
    """Observer of a :class:`Limiter`'s tickets; subclass it and override the events you need.

    Called synchronously on the event loop inside the limiter's atomic step, for stage and
    passthrough tickets alike (``ticket.stage == PASSTHROUGH``): keep each call O(1), and never
    call back into the limiter. ``now`` is the limiter's clock at the event.
    """

    def on_arrival(self, ticket: Ticket, now: float) -> None:
        """A request was submitted, before the policy decides (it may still be turned away)."""

    def on_admit(self, ticket: Ticket, now: float) -> None:
        """``ticket`` was admitted: its thread starts (also a reservation's, see :meth:`on_claim`)."""

    def on_release(self, ticket: Ticket, now: float, outcome: str) -> None:
        """Admitted ``ticket`` ended: ``completed``, ``failed`` or ``unused``."""

    def on_reject(self, ticket: Ticket, reason: str) -> None:
        """Queued ``ticket`` ended unserved: ``queue_full``, ``queue_timeout``, ``client_gone``,
        ``follow_up_missing``."""

    def on_claim(self, ticket: Ticket, now: float) -> None:
        """A follow-up request took over its reservation ``ticket`` (queued or admitted already);
        it arrived at ``ticket.t_arrive`` and, if admitted, its service starts at ``ticket.t_admit``."""

    def on_follow(self, ticket: Ticket, hold: Ticket, now: float) -> None:
        """Completed ``ticket``'s client will send ``hold``'s stage next (its ``next``): ``hold`` is
        the reservation that request will claim, the link between one transaction's two stages."""
