"""Enforcement: per-(stage, phase) queues released exactly when the policy starts a thread.

The limiter never computes a limit (that is :mod:`overtake.controller.sidecar.policies`); it keeps the state of
van der Weij et al.'s tandem — waiting requests per queue and admitted requests ("threads") per
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

Tandem routing (van der Weij et al. §2: a request leaving stage i joins queue i+1 at that instant): when a
stage has a ``next`` stage, :meth:`Limiter.release` can put a *reservation* for the client's
follow-up request into queue i+1 before the policy is consulted, so the decision made at the
completion sees the request that moves on, as the model's does. The follow-up takes the
reservation over (:meth:`Limiter.claim`, queued or already admitted); if it does not come
(another request on the connection, a close, or the follow-up timeout), :meth:`Limiter.abandon`
ends it as ``follow_up_missing`` (queued) or ``unused`` (admitted). Without it the client's
round trip lets a waiting stage-i request take the thread first, and π(1) is no longer the
model's π(1) (its E[W] rises; bench/apache_table2.py).

Liveness guard: if the policy starts nothing while no stage request is in service and some are
waiting (it cannot happen for a solved policy, but a truncated or hand-made table could idle),
the oldest request of the last non-empty stage is admitted and counted in ``guard_admissions``.

Locks (``lock: m`` on a stage, :class:`overtake.controller.sidecar.stage_lock.StageLock`): the
policy's starts in a locked stage are cut to the lock's free slots, and the lock picks which
waiting request starts (highest response ratio first); the guard's admission takes the lock's pick.
Under a policy solved without the lock, the lock fills its stage's free slots itself.

Observers (the online loop's recorder, :mod:`overtake.controller.online`) subscribe with
:meth:`Limiter.add_listener` and are told of every arrival, admission, release, rejection and
claim (:class:`LimiterListener`); they cannot change a decision. The queue and thread counts
themselves are :class:`overtake.controller.sidecar.tandem.TandemState`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from overtake.controller.sidecar.classifier import Classifier
from overtake.controller.sidecar.follow_up import FollowUps
from overtake.controller.sidecar.listener import LimiterListener
from overtake.controller.sidecar.policies import SpawnPolicy
from overtake.controller.sidecar.tandem import ADMITTED, DONE, QUEUED, TandemState, Ticket

if TYPE_CHECKING:
    from overtake.controller.sidecar.stage_lock import StageLock

__all__ = ["ADMITTED", "DONE", "PASSTHROUGH", "QUEUED", "Limiter", "LimiterListener", "Ticket"]

PASSTHROUGH = -1  #: stage index of requests no stage claims


class Limiter(FollowUps):
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
        self.listeners: list[LimiterListener] = []
        #: called at the end of every decision (the gate's idle starts; never admit here)
        self.after_dispatch: list[Callable[[], None]] = []
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
        self.tandem = TandemState(policy.phases, policy.per_phase_queues, clock(), policy.threads_per_stage)
        self.policy = policy
        #: the stages' locks (controller.sidecar.stage_lock): which waiting request starts, and
        #: none in a stage whose lock is full, whatever the policy says
        self.lock: StageLock | None = None
        self._install(policy)

    def set_lock(self, lock: StageLock | None) -> None:
        """Enforce the stages' locks from the next decision on (None: no lock)."""
        if self.lock is not None:
            self.listeners.remove(self.lock)
        self.lock = lock
        if lock is not None:
            self.listeners.append(lock)
        self._dispatch()

    def add_listener(self, listener: LimiterListener) -> None:
        """Tell ``listener`` of every ticket event from now on."""
        self.listeners.append(listener)

    # ---- layout and state ------------------------------------------------------------------
    def _install(self, policy: SpawnPolicy) -> None:
        self.policy = policy
        # views for metrics and tests: the TandemState's own lists, which it updates in place
        tandem = self.tandem
        self.phases, self.offset, self.waiting = tandem.phases, tandem.offset, tandem.waiting
        self.stage_waiting, self.threads = tandem.stage_waiting, tandem.threads
        self.per_phase = policy.per_phase_queues
        self._loop_start = not policy.per_phase_queues and any(m > 1 for m in policy.phases)
        for key in ((i, j) for i in range(self.n) for j in range(policy.phases[i])):
            self.admitted.setdefault(key, 0)

    def swap(self, policy: SpawnPolicy) -> None:
        """Install a new policy atomically: re-bucket queued and in-service requests, then dispatch."""
        self.classifier.bind(policy)
        self.tandem = self.tandem.relayout(policy.phases, policy.per_phase_queues, policy.threads_per_stage)
        self._install(policy)
        self._dispatch()

    def set_limits(self, *, queue_caps: tuple[int, ...], max_inflight: int, passthrough_cap: int | None,
                   passthrough_queue_cap: int) -> None:
        """New caps (a reloaded stages file): queued and admitted requests stay; a raised cap may
        admit at once. A lowered one admits nothing new until enough have left."""
        self.queue_caps = queue_caps
        self.max_inflight = max_inflight
        self.passthrough_cap = passthrough_cap
        self.passthrough_queue_cap = passthrough_queue_cap
        self._dispatch()

    def state(self) -> tuple[int, ...]:
        """The policy's state vector (:attr:`overtake.mdp.Policy.columns` order)."""
        return self.tandem.state()

    # ---- arrivals --------------------------------------------------------------------------
    def submit(self, stage: int, phase: int, route: str) -> Ticket | None:
        """Enqueue a request and dispatch; None (counted ``queue_full``) when its queue is full.

        The returned ticket is admitted already (``status == ADMITTED``) or its ``future``
        resolves on admission.
        """
        now = self.clock()
        self._seq += 1
        t = Ticket(stage, phase, route, self._seq, now)
        for lsn in self.listeners:
            lsn.on_arrival(t, now)
        if stage == PASSTHROUGH:
            full = len(self.pt_queue) >= self.passthrough_queue_cap
            self.pt_queue.append(t)
        else:
            full = self.tandem.stage_waiting[stage] >= self.queue_caps[stage]
            self.tandem.push(t)
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
            self.tandem.remove(t)
        self._reject(t, reason)
        self._dispatch()
        return True

    def _reject(self, t: Ticket, reason: str) -> None:
        t.status = DONE
        key = (t.stage, reason)
        self.rejected[key] = self.rejected.get(key, 0) + 1
        for lsn in self.listeners:
            lsn.on_reject(t, reason)

    # ---- completions -----------------------------------------------------------------------
    def release(self, t: Ticket, outcome: str, follow: tuple[int, int] | None = None) -> Ticket | None:
        """End an admitted ticket: ``completed`` (whole response received), ``failed``, or
        ``unused`` (an admitted reservation whose request never came).

        ``follow=(stage, phase)``: the client will ask for that stage next; a reservation joins
        its queue *before* the policy decides (module docstring) and is returned.
        """
        if t.status != ADMITTED:
            raise RuntimeError(f"release of a ticket in status {t.status}")
        now = self.clock()
        for lsn in self.listeners:
            lsn.on_release(t, now, outcome)
        t.status = DONE
        self.inflight_total -= 1
        if t.stage == PASSTHROUGH:
            self.pt_inflight -= 1
            key = (PASSTHROUGH, 0, outcome)
        else:
            self.tandem.advance(now)
            self.tandem.finish(t)
            key = (t.stage, t.start_phase, outcome)
        self.completed[key] = self.completed.get(key, 0) + 1
        hold = None if follow is None else self._reserve(t, follow, now)
        self._dispatch()
        return hold

    # ---- the decision ----------------------------------------------------------------------
    def _admit(self, t: Ticket, now: float) -> None:
        t.status = ADMITTED
        t.t_admit = now
        self.inflight_total += 1
        self.max_seen_inflight = max(self.max_seen_inflight, self.inflight_total)
        if t.stage == PASSTHROUGH:
            self.pt_inflight += 1
            key = (PASSTHROUGH, 0)
        else:
            self.tandem.start(t)
            key = (t.stage, t.phase)
        self.admitted[key] = self.admitted.get(key, 0) + 1
        self.admitted_total += 1
        if t.future is not None and not t.future.done():
            t.future.set_result(None)
        for lsn in self.listeners:
            lsn.on_admit(t, now)

    def _dispatch(self) -> None:
        """Consult the policy and admit; never awaits (atomic with respect to the event loop)."""
        now = self.clock()
        tandem = self.tandem
        tandem.advance(now)
        if self.classifier.reestimates and tandem.active:
            tandem.reestimate(self.classifier)
        offset, stage_waiting = tandem.offset, tandem.stage_waiting
        rounds = max(offset[-1], 1) if self._loop_start else 1
        for _ in range(rounds):
            if self.inflight_total >= self.max_inflight or not any(stage_waiting):
                break
            self.policy_consults += 1
            act = self.policy.action(tandem.state())
            started = 0
            for stage, phase, k in _starts(act, offset, self.per_phase):
                for _ in range(k):
                    if self.inflight_total >= self.max_inflight:
                        break
                    t = self._next(stage, phase, now)
                    if t is None:
                        break
                    self._admit(t, now)
                    started += 1
            if not started:
                break
        if self.lock is not None:  # stages whose lock fills its own slots (StageLock.governs)
            for stage in self.lock.governs(self.policy):
                while stage_waiting[stage] and self.inflight_total < self.max_inflight:
                    t = self._next(stage, None, now)
                    if t is None:
                        break
                    self._admit(t, now)
        if (not tandem.active and self.inflight_total < self.max_inflight and any(stage_waiting)):
            stage = max(i for i in range(self.n) if stage_waiting[i])
            t = self._next(stage, None, now)
            if t is not None:
                self.guard_admissions += 1
                self._admit(t, now)
        while (self.pt_queue and self.inflight_total < self.max_inflight
               and (self.passthrough_cap is None or self.pt_inflight < self.passthrough_cap)):
            self._admit(self.pt_queue.popleft(), now)
        if self.lock is not None:
            self.lock.settle(tandem, now)
        for fn in self.after_dispatch:
            fn()

    def _next(self, stage: int, phase: int | None, now: float) -> Ticket | None:
        """The waiting ticket to start in (stage, phase): the oldest, or the lock's choice."""
        if self.lock is None:
            return self.tandem.pop_oldest(stage, phase)
        return self.lock.take(self.tandem, stage, phase, now)

    # ---- introspection ---------------------------------------------------------------------
    def stage_limit(self, stage: int, phase: int) -> float:
        """Threads the policy would allow in (stage, phase) now, were its queue long (gauge);
        +Inf for π(∞)."""
        if getattr(self.policy, "unlimited", False):
            return float("inf")
        c = self.tandem.offset[stage] + phase
        base = list(self.state())
        q = c if self.per_phase else stage
        base[q] += 64
        act = self.policy.action(tuple(base))
        return self.tandem.threads[c] + int(act[q])


def _starts(act: Sequence[int], offset: Sequence[int], per_phase: bool) -> Iterator[tuple[int, int | None, int]]:
    """(stage, phase, threads) the action starts; phase None: a stage's oldest request, whatever its
    phase (hidden mode: the prior's)."""
    for q, k in enumerate(act):
        if not k:
            continue
        if per_phase:
            stage = next(i for i in range(len(offset) - 1) if q < offset[i + 1])
            yield stage, q - offset[stage], int(k)
        else:
            yield q, None, int(k)
