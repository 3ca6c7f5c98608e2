"""van der Weij et al.'s state as the sidecar holds it: tickets, queues per (stage, phase), threads per coordinate.

The MDP's state (van der Weij et al. §2-3) is the number of waiting requests per queue and of threads per
(stage, phase) coordinate. :class:`TandemState` keeps exactly that, in the running policy's
layout (:attr:`overtake.controller.sidecar.policies.SpawnPolicy.phases`), plus the tickets behind the
counts: FIFO queues of waiting tickets and the set of tickets in service. It never decides
anything; :class:`overtake.controller.sidecar.limiter.Limiter` asks the policy and moves tickets with
these primitives.

Hidden mode (the phase of a request in service is not observed) needs each request's attained
service; under processor sharing with K requests in service it grows at rate 1/K, so one clock
V(t) = ∫ 1/K(t) dt over busy periods serves all of them (:meth:`TandemState.advance`):
a request admitted at V₀ has attained V(t) − V₀.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from overtake.controller.sidecar.classifier import Classifier

__all__ = ["ADMITTED", "DONE", "QUEUED", "TandemState", "Ticket"]

QUEUED, ADMITTED, DONE = 0, 1, 2  #: :attr:`Ticket.status` values


class Ticket:
    """One request's permit: queued, then admitted, then released exactly once."""

    __slots__ = ("future", "gate", "held", "phase", "route", "seq", "stage", "start_phase", "status", "t_admit",
                 "t_arrive", "v_admit")

    def __init__(self, stage: int, phase: int, route: str, seq: int, now: float) -> None:
        self.stage = stage
        self.phase = phase  # current coordinate's phase (re-estimated in hidden mode)
        self.start_phase = phase
        self.route = route
        self.status = QUEUED
        self.future: asyncio.Future[None] | None = None
        self.t_arrive = now
        self.t_admit = 0.0
        self.v_admit = 0.0
        self.seq = seq
        self.held = False  # a reservation for a follow-up request not yet arrived
        self.gate: int | None = None  # its slot while held in Apache's admission gate (controller.sidecar.gate)


class TandemState:
    """Waiting tickets per (stage, phase) queue and threads per coordinate, in one policy's layout.

    Parameters
    ----------
    phases
        Phases per stage in the policy's layout (``M_i``; 1 for a policy without phases).
    per_phase
        The policy's state has one queue per coordinate (else one per stage).
    now
        Start of the attained-service clock.
    threads_per_stage
        The policy's state counts threads per stage (observation policies, whose labels are route
        classes: a thread's class no longer matters once it runs), else per coordinate.
    """

    def __init__(self, phases: tuple[int, ...], per_phase: bool, now: float, threads_per_stage: bool = False) -> None:
        self.n = len(phases)
        self.phases = phases
        self.per_phase = per_phase
        self.threads_per_stage = threads_per_stage
        self.offset = [0]  #: first coordinate of each stage, and the coordinate count last
        for m in phases:
            self.offset.append(self.offset[-1] + m)
        d = self.offset[-1]
        self.queues: list[list[deque[Ticket]]] = [[deque() for _ in range(m)] for m in phases]
        self.waiting = [0] * d  #: per coordinate
        self.stage_waiting = [0] * self.n
        self.threads = [0] * d  #: per coordinate
        self.active: set[Ticket] = set()  #: stage tickets in service
        self.v = 0.0  # the attained-service clock V (module docstring)
        self._v_t = now

    def relayout(self, phases: tuple[int, ...], per_phase: bool, threads_per_stage: bool = False) -> TandemState:
        """The same tickets in another policy's layout: queues keep their arrival order, and a
        phase beyond a stage's new phase count becomes its last phase."""
        new = TandemState(phases, per_phase, self._v_t, threads_per_stage)
        new.v = self.v
        for t in sorted((t for qs in self.queues for q in qs for t in q), key=lambda t: t.seq):
            t.phase = t.start_phase = min(t.start_phase, phases[t.stage] - 1)
            new.push(t)
        new.active = self.active
        for t in self.active:
            t.phase = t.start_phase = min(t.start_phase, phases[t.stage] - 1)
            new.threads[new.offset[t.stage] + t.phase] += 1
        return new

    def state(self) -> tuple[int, ...]:
        """The policy's state vector (:attr:`overtake.mdp.Policy.columns` order)."""
        w = self.waiting if self.per_phase else self.stage_waiting
        if self.threads_per_stage:
            off = self.offset
            return (*w, *(sum(self.threads[off[i]:off[i + 1]]) for i in range(self.n)))
        return (*w, *self.threads)

    # ---- queues ----------------------------------------------------------------------------
    def push(self, t: Ticket) -> None:
        """``t`` joins the back of queue (t.stage, t.phase)."""
        self.queues[t.stage][t.phase].append(t)
        self.waiting[self.offset[t.stage] + t.phase] += 1
        self.stage_waiting[t.stage] += 1

    def remove(self, t: Ticket) -> None:
        """``t`` leaves its queue unserved."""
        self.queues[t.stage][t.phase].remove(t)
        self.waiting[self.offset[t.stage] + t.phase] -= 1
        self.stage_waiting[t.stage] -= 1

    def requeue(self, t: Ticket, phase: int) -> None:
        """Move waiting ``t`` to ``phase``'s queue, keeping its place (queues are in seq order)."""
        self.queues[t.stage][t.phase].remove(t)
        self.waiting[self.offset[t.stage] + t.phase] -= 1
        q = self.queues[t.stage][phase]
        q.insert(sum(1 for x in q if x.seq < t.seq), t)
        self.waiting[self.offset[t.stage] + phase] += 1

    def pop_oldest(self, stage: int, phase: int | None) -> Ticket | None:
        """Take the oldest waiting ticket of (stage, phase), or of the whole stage if phase is None;
        the counts change only when it is started (:meth:`start`)."""
        qs = self.queues[stage]
        if phase is not None:
            return qs[phase].popleft() if qs[phase] else None
        best = None
        for q in qs:
            if q and (best is None or q[0].seq < best[0].seq):
                best = q
        return best.popleft() if best is not None else None

    def waiting_tickets(self) -> Iterable[Ticket]:
        return (t for qs in self.queues for q in qs for t in q)

    # ---- threads ---------------------------------------------------------------------------
    def start(self, t: Ticket) -> None:
        """A thread starts for ``t``, just taken from its queue (:meth:`pop_oldest`)."""
        c = self.offset[t.stage] + t.phase
        self.waiting[c] -= 1
        self.stage_waiting[t.stage] -= 1
        self.threads[c] += 1
        t.v_admit = self.v
        self.active.add(t)

    def finish(self, t: Ticket) -> None:
        """``t``'s thread ends."""
        self.active.discard(t)
        self.threads[self.offset[t.stage] + t.phase] -= 1

    def move_thread(self, t: Ticket, phase: int) -> None:
        """``t``, in service, is now counted in ``phase``."""
        self.threads[self.offset[t.stage] + t.phase] -= 1
        self.threads[self.offset[t.stage] + phase] += 1
        t.phase = phase

    # ---- attained service (hidden mode) ----------------------------------------------------
    def advance(self, now: float) -> None:
        """Advance V to ``now`` (K constant since the last call)."""
        k = len(self.active)
        if k:
            self.v += (now - self._v_t) / k
        self._v_t = now

    def reestimate(self, classifier: Classifier) -> None:
        """Hidden mode: move in-service requests to their most likely current phase."""
        for t in self.active:
            j = classifier.current_phase(t.stage, t.start_phase, self.v - t.v_admit)
            if j != t.phase:
                self.move_thread(t, j)
