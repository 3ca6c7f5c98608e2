"""Enforcement: per-(stage, phase) queues released exactly when the policy starts a thread.

The limiter never computes a limit (that is :mod:`overtake.controller.policies`); it keeps the state of
paper 004's tandem — waiting requests per queue and admitted requests ("threads") per
(stage, phase) coordinate — and on every arrival, completion, cancellation and policy swap asks
the policy ``action(state)`` and admits that many waiting requests, oldest first.

Invariants (tested):

* everything runs on one event loop and :meth:`Limiter._dispatch` never awaits, so the check of
  the global hard cap ``max_inflight`` and the admission are one atomic step: the cap is never
  exceeded, whatever the interleaving (the check-then-act race of partitioned limiters cannot
  happen);
* each ticket ends exactly once: admitted tickets as ``completed`` or ``failed``, queued tickets
  as rejected (``queue_full``, ``queue_timeout``, ``client_gone``); so
  ``admitted = completed + failed + inflight`` at all times.

Tandem routing (paper 004 §2: a request leaving stage i joins queue i+1 at that instant): when a
stage has a ``next`` stage, :meth:`Limiter.release` can put a *reservation* for the client's
follow-up request into queue i+1 before the policy is consulted, so the decision made at the
completion sees the request that moves on, as the model's does. The follow-up takes the
reservation over (:meth:`Limiter.claim`, queued or already admitted); if it does not come
(another request on the connection, a close, or the follow-up timeout), :meth:`Limiter.abandon`
ends it as ``follow_up_missing`` (queued) or ``unused`` (admitted). Without it the client's
round trip lets a waiting stage-i request take the thread first, and π(1) is no longer the
model's π(1) (measured: +5-7 % E[W] in Table 2 case 1, bench/apache_table2.py).

Liveness guard: if the policy starts nothing while no stage request is in service and some are
waiting (it cannot happen for a solved policy, but a truncated or hand-made table could idle),
the oldest request of the last non-empty stage is admitted and counted in ``guard_admissions``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from overtake.controller.classifier import Classifier
from overtake.controller.policies import SpawnPolicy

__all__ = ["PASSTHROUGH", "Limiter", "Ticket"]

PASSTHROUGH = -1  #: stage index of requests no stage claims

QUEUED, ADMITTED, DONE = 0, 1, 2


class Ticket:
    """One request's permit: queued, then admitted, then released exactly once."""

    __slots__ = ("stage", "phase", "start_phase", "route", "status", "future", "t_arrive",
                 "t_admit", "v_admit", "seq", "held")

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


class Limiter:
    """Queues and counters for every stage, the passthrough lane, and the global hard cap."""

    def __init__(
        self,
        policy: SpawnPolicy,
        classifier: Classifier,
        *,
        stage_names: tuple[str, ...],
        queue_caps: tuple[int, ...],
        max_inflight: int,
        passthrough_cap: int | None,
        passthrough_queue_cap: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.n = len(stage_names)
        self.stage_names = stage_names
        self.queue_caps = queue_caps
        self.max_inflight = max_inflight
        self.passthrough_cap = passthrough_cap
        self.passthrough_queue_cap = passthrough_queue_cap
        self.clock = clock
        self.classifier = classifier
        self._seq = 0
        self.inflight_total = 0  # stage + passthrough requests inside Apache
        self.max_seen_inflight = 0
        self.guard_admissions = 0
        self.policy_consults = 0
        self.admitted_total = 0
        # passthrough lane
        self.pt_queue: deque[Ticket] = deque()
        self.pt_inflight = 0
        # counters: key (stage, phase) -> int ; stage PASSTHROUGH uses phase 0
        self.admitted: dict[tuple[int, int], int] = {}
        self.completed: dict[tuple[int, int, str], int] = {}
        self.rejected: dict[tuple[int, str], int] = {}
        # attained service clock: V(t) = ∫ 1/K(t) dt over busy periods (hidden mode)
        self._v = 0.0
        self._v_t = clock()
        self._active: set[Ticket] = set()
        self.policy = policy
        self._build(policy)

    # ---- layout ----------------------------------------------------------------------------
    def _build(self, policy: SpawnPolicy) -> None:
        self.policy = policy
        self.phases = policy.phases
        self.offset = [0]
        for m in self.phases:
            self.offset.append(self.offset[-1] + m)
        d = self.offset[-1]
        self.queues: list[list[deque[Ticket]]] = [[deque() for _ in range(m)] for m in self.phases]
        self.waiting = [0] * d  # per coordinate
        self.stage_waiting = [0] * self.n
        self.threads = [0] * d
        self.per_phase = policy.per_phase_queues
        self._loop_start = not policy.per_phase_queues and any(m > 1 for m in self.phases)
        for key in ((i, j) for i in range(self.n) for j in range(self.phases[i])):
            self.admitted.setdefault(key, 0)

    def swap(self, policy: SpawnPolicy) -> None:
        """Install a new policy atomically: re-bucket queued and in-service requests, then dispatch."""
        queued = sorted((t for qs in self.queues for q in qs for t in q), key=lambda t: t.seq)
        self.classifier.bind(policy)
        self._build(policy)
        for t in queued:
            t.phase = t.start_phase = min(t.start_phase, self.phases[t.stage] - 1)
            self.queues[t.stage][t.phase].append(t)
            self.waiting[self.offset[t.stage] + t.phase] += 1
            self.stage_waiting[t.stage] += 1
        for t in self._active:
            t.phase = t.start_phase = min(t.start_phase, self.phases[t.stage] - 1)
            self.threads[self.offset[t.stage] + t.phase] += 1
        self._dispatch()

    # ---- state -----------------------------------------------------------------------------
    def state(self) -> tuple[int, ...]:
        """The policy's state vector (:attr:`overtake.mdp.Policy.columns` order)."""
        w = self.waiting if self.per_phase else self.stage_waiting
        return (*w, *self.threads)

    def stage_inflight(self) -> int:
        return len(self._active)

    def _advance_v(self, now: float) -> None:
        k = len(self._active)
        if k:
            self._v += (now - self._v_t) / k
        self._v_t = now

    # ---- arrivals --------------------------------------------------------------------------
    def submit(self, stage: int, phase: int, route: str) -> Ticket | None:
        """Enqueue a request and dispatch; None (counted ``queue_full``) when its queue is full.

        The returned ticket is admitted already (``status == ADMITTED``) or its ``future``
        resolves on admission.
        """
        now = self.clock()
        self._seq += 1
        t = Ticket(stage, phase, route, self._seq, now)
        if stage == PASSTHROUGH:
            full = len(self.pt_queue) >= self.passthrough_queue_cap
            self.pt_queue.append(t)
        else:
            full = self.stage_waiting[stage] >= self.queue_caps[stage]
            self.queues[stage][phase].append(t)
            self.waiting[self.offset[stage] + phase] += 1
            self.stage_waiting[stage] += 1
        # the policy sees every arrival (it may start it at once even when the queue is full);
        # only a request that would have to wait beyond the cap is turned away
        self._dispatch()
        if t.status == QUEUED and full:
            self.cancel(t, "queue_full")
            return None
        if t.status == QUEUED:
            t.future = asyncio.get_running_loop().create_future()
        return t

    def cancel(self, t: Ticket, reason: str) -> bool:
        """Withdraw a queued ticket (``queue_timeout``, ``client_gone``); False if already admitted."""
        if t.status != QUEUED:
            return False
        if t.stage == PASSTHROUGH:
            self.pt_queue.remove(t)
        else:
            self.queues[t.stage][t.phase].remove(t)
            self.waiting[self.offset[t.stage] + t.phase] -= 1
            self.stage_waiting[t.stage] -= 1
        self._reject(t, reason)
        self._dispatch()
        return True

    def _reject(self, t: Ticket, reason: str) -> None:
        t.status = DONE
        key = (t.stage, reason)
        self.rejected[key] = self.rejected.get(key, 0) + 1

    # ---- completions -----------------------------------------------------------------------
    def release(self, t: Ticket, outcome: str, follow: tuple[int, int] | None = None) -> Ticket | None:
        """End an admitted ticket: ``completed`` (whole response received), ``failed``, or
        ``unused`` (an admitted reservation whose request never came).

        ``follow=(stage, phase)``: the client will ask for that stage next; a reservation joins
        its queue *before* the policy decides (module docstring) and is returned.
        """
        if t.status != ADMITTED:
            raise RuntimeError(f"release of a ticket in status {t.status}")
        t.status = DONE
        self.inflight_total -= 1
        if t.stage == PASSTHROUGH:
            self.pt_inflight -= 1
            key = (PASSTHROUGH, 0, outcome)
        else:
            self._advance_v(self.clock())
            self._active.discard(t)
            self.threads[self.offset[t.stage] + t.phase] -= 1
            key = (t.stage, t.start_phase, outcome)
        self.completed[key] = self.completed.get(key, 0) + 1
        hold = None
        if follow is not None:
            stage, phase = follow
            self._seq += 1
            hold = Ticket(stage, phase, "", self._seq, self.clock())
            hold.held = True
            self.queues[stage][phase].append(hold)
            self.waiting[self.offset[stage] + phase] += 1
            self.stage_waiting[stage] += 1
        self._dispatch()
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
                self.queues[hold.stage][hold.phase].remove(hold)
                self.waiting[self.offset[hold.stage] + hold.phase] -= 1
                q = self.queues[hold.stage][phase]
                # keep its place: the queue is in arrival (seq) order
                q.insert(sum(1 for x in q if x.seq < hold.seq), hold)
                self.waiting[self.offset[hold.stage] + phase] += 1
            hold.phase = hold.start_phase = phase
            if moved:
                self._dispatch()
            if hold.status == QUEUED:
                hold.future = asyncio.get_running_loop().create_future()
        else:
            self._advance_v(now)
            hold.t_admit, hold.v_admit = now, self._v  # its service starts now, not at the reservation
            if moved:
                self.threads[self.offset[hold.stage] + hold.phase] -= 1
                self.threads[self.offset[hold.stage] + phase] += 1
            hold.phase = hold.start_phase = phase
            if moved:
                self._dispatch()
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

    # ---- the decision ----------------------------------------------------------------------
    def _pt_room(self) -> bool:
        return self.passthrough_cap is None or self.pt_inflight < self.passthrough_cap

    def _admit(self, t: Ticket, now: float) -> None:
        t.status = ADMITTED
        t.t_admit = now
        self.inflight_total += 1
        if self.inflight_total > self.max_seen_inflight:
            self.max_seen_inflight = self.inflight_total
        if t.stage == PASSTHROUGH:
            self.pt_inflight += 1
            key = (PASSTHROUGH, 0)
        else:
            c = self.offset[t.stage] + t.phase
            self.waiting[c] -= 1
            self.stage_waiting[t.stage] -= 1
            self.threads[c] += 1
            t.v_admit = self._v
            self._active.add(t)
            key = (t.stage, t.phase)
        self.admitted[key] = self.admitted.get(key, 0) + 1
        self.admitted_total += 1
        if t.future is not None and not t.future.done():
            t.future.set_result(None)

    def _pop_oldest(self, stage: int, phase: int | None) -> Ticket | None:
        qs = self.queues[stage]
        if phase is not None:
            return qs[phase].popleft() if qs[phase] else None
        best = None
        for q in qs:
            if q and (best is None or q[0].seq < best[0].seq):
                best = q
        return best.popleft() if best is not None else None

    def _reestimate(self) -> None:
        """Hidden mode: move in-service requests to their most likely current phase."""
        for t in self._active:
            a = (self._v - t.v_admit)
            j = self.classifier.current_phase(t.stage, t.start_phase, a)
            if j != t.phase:
                self.threads[self.offset[t.stage] + t.phase] -= 1
                self.threads[self.offset[t.stage] + j] += 1
                t.phase = j

    def _dispatch(self) -> None:
        """Consult the policy and admit; never awaits (atomic with respect to the event loop)."""
        now = self.clock()
        self._advance_v(now)
        if self.classifier.mode == "hidden" and self._active:
            self._reestimate()
        rounds = max(self.offset[-1], 1) if self._loop_start else 1
        for _ in range(rounds):
            if self.inflight_total >= self.max_inflight or not any(self.stage_waiting):
                break
            self.policy_consults += 1
            act = self.policy.action(self.state())
            started = 0
            for q, k in enumerate(act):
                if not k:
                    continue
                if self.per_phase:
                    stage = next(i for i in range(self.n) if q < self.offset[i + 1])
                    phase: int | None = q - self.offset[stage]
                else:
                    stage, phase = q, None
                for _ in range(k):
                    if self.inflight_total >= self.max_inflight:
                        break
                    t = self._pop_oldest(stage, phase)
                    if t is None:
                        break
                    if phase is None and self.classifier.mode == "hidden":
                        pass  # phase stays the prior's; re-estimated as it runs
                    self._admit(t, now)
                    started += 1
            if not started:
                break
        if (not self._active and self.inflight_total < self.max_inflight and any(self.stage_waiting)):
            stage = max(i for i in range(self.n) if self.stage_waiting[i])
            t = self._pop_oldest(stage, None)
            if t is not None:
                self.guard_admissions += 1
                self._admit(t, now)
        while self.pt_queue and self.inflight_total < self.max_inflight and self._pt_room():
            self._admit(self.pt_queue.popleft(), now)

    # ---- introspection ---------------------------------------------------------------------
    def stage_limit(self, stage: int, phase: int) -> float:
        """Threads the policy would allow in (stage, phase) now, were its queue long (gauge);
        +Inf for π(∞)."""
        if getattr(self.policy, "unlimited", False):
            return float("inf")
        c = self.offset[stage] + phase
        base = list(self.state())
        q = c if self.per_phase else stage
        base[q] += 64
        act = self.policy.action(tuple(base))
        return self.threads[c] + int(act[q])
