"""A stage's serialising resource, enforced in the sidecar: ``lock: m`` in the stages file.

A stage whose requests take a lock (MediaWiki on SQLite runs every write in an IMMEDIATE
transaction: one preview at a time) gains nothing from a second request inside Apache: it only
blocks there, holding a worker, in the database's busy handler, which sleeps and polls, so the
lock also idles between holders. The MDP with a lock (:mod:`overtake.mdp.lock`) starts a thread
in a locked stage only while the lock has room; :class:`StageLock` makes the limiter do the same:
whatever the policy starts, at most ``m`` requests of the stage are admitted and not yet
answered (policy ∧ lock). The others wait in the stage's sidecar queue under its usual
``queue_cap`` and ``queue_timeout``.

A policy solved for a model with the same locks (``overtake solve`` of a scenario with ``lock``),
and Apache's default or a π(k) baseline, keep their say over the locked stage: their starts there
are cut to the lock's free slots (policy ∧ lock). A policy solved without the lock has no
meaningful decision for the locked stage (it priced a world where those requests run side by
side, and may keep them waiting while the lock idles): it decides the other stages, and the lock
fills its own free slots (:meth:`StageLock.governs`).

Which waiting request takes a free slot: with a learned-classification ``key`` on the stage's
routes (``key: [body_size]``), the one with the highest response ratio (wait + predicted holding
time) / predicted holding time, oldest first among equals (Brinch Hansen's "highest response ratio
next"). A request's prediction is the mean of the last holding times of its key's completed
requests (admission to the whole answer), a key not yet seen taken at the stage's mean. The ratio
starts every request at 1 and raises a short one fastest, so the shortest go first, as shortest job
first does at a single server (Smith, "Various optimizers for single-stage production"), while
every waiting request's ratio grows without bound, so none is passed over for ever, and a long one
that has waited many times its own length goes before a short one just arrived. Why not shortest
first with a fixed waiting bound past which the oldest go first: in a burst every request passes
the bound together and the lock turns first-come first-served exactly when the order matters
most. ``lock_aging`` (off unless set) is that bound on top of the ratio: a request that has waited
``lock_aging`` seconds goes before every request that has not, oldest first among them. Without a
key, oldest first. Within a per-phase policy's queue the order applies to the phase the policy
starts.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from overtake.controller.sidecar.listener import LimiterListener
from overtake.controller.sidecar.stages import StageTable
from overtake.controller.sidecar.tandem import TandemState, Ticket

__all__ = ["StageLock"]

_KEYS_MAX = 4096  # keys whose holding times are remembered per stage (LRU)


@dataclass
class _Cost:
    """The last holding times of one key: their sum and count for the mean."""

    samples: deque[float]
    total: float = 0.0


class StageLock(LimiterListener):
    """Capacity, release order and holding-time estimates of every locked stage.

    The limiter asks :meth:`take` for the next request to start in a stage (it returns None when
    the stage's lock is full) and calls :meth:`settle` after each decision; as a listener the
    lock learns holding times from completions.
    """

    def __init__(self, names: tuple[str, ...], caps: tuple[int | None, ...], keyed: tuple[bool, ...],
                 aging: tuple[float | None, ...], history: int = 64) -> None:
        self.names = names
        self.caps = caps
        #: per stage: where its capacity comes from, ``configured`` (``lock: m``), ``learned``
        #: (``lock: auto``, set by the serialisation detector: :meth:`learn_cap`) or None
        self.source: list[str | None] = ["configured" if c is not None else None for c in caps]
        self.auto: tuple[bool, ...] = (False,) * len(names)
        self.keyed = keyed
        self.aging = aging
        self.history = history
        self._costs: list[OrderedDict[str, _Cost]] = [OrderedDict() for _ in names]
        self._stage_total = [0.0] * len(names)
        self._stage_n = [0] * len(names)
        #: per stage: requests waiting while the lock was full, at the last decision
        self.waiting = [0] * len(names)
        #: per stage: request-seconds spent waiting in the sidecar while the lock was full
        self.wait_seconds = [0.0] * len(names)
        #: per stage: requests started ahead of a waiting one predicted shorter (their wait raised
        #: their response ratio, or they had waited lock_aging)
        self.aged = [0] * len(names)
        self._t = 0.0

    @staticmethod
    def from_table(table: StageTable) -> StageLock | None:
        """The lock of a stages file, None when no stage has one."""
        n = len(table.names)
        caps = tuple(table.lock(i) for i in range(n))
        auto = tuple(table.lock_auto(i) for i in range(n))
        if all(c is None for c in caps) and not any(auto):
            return None
        lock = StageLock(table.names, caps, tuple(table.keyed(i) for i in range(n)),
                         tuple(s.lock_aging for s in table.config.stages), table.config.classifier.history)
        lock.auto = auto
        return lock

    def learn_cap(self, stage: int, cap: int | None) -> None:
        """Set a ``lock: auto`` stage's capacity to what the detector estimated (None: the stage is
        not serialised, no lock). The limiter applies it from its next decision."""
        if not self.auto[stage]:
            raise ValueError(f"stage {self.names[stage]!r}: its lock is not auto")
        self.caps = tuple(cap if i == stage else c for i, c in enumerate(self.caps))
        self.source[stage] = "learned" if cap is not None else None

    def governs(self, policy: object) -> tuple[int, ...]:
        """The locked stages whose free slots the lock fills itself under ``policy``: all of them
        for a solved policy whose model has other locks than these (module docstring), none for
        one solved with them or a baseline."""
        chosen = getattr(policy, "chosen", policy)  # auto: the member in force
        model = getattr(getattr(chosen, "policy", None), "model", None)
        if model is None:
            return ()
        if tuple(model.locks or (None,) * len(self.caps)) == self.caps:
            return ()
        return tuple(i for i, c in enumerate(self.caps) if c is not None)

    def locked(self, stage: int) -> bool:
        return 0 <= stage < len(self.caps) and self.caps[stage] is not None

    def room(self, tandem: TandemState, stage: int) -> int:
        """Free slots of the stage's lock (admitted requests not yet answered hold one each)."""
        cap = self.caps[stage]
        assert cap is not None
        off = tandem.offset
        return cap - sum(tandem.threads[off[stage]:off[stage + 1]])

    # ---- the release order -----------------------------------------------------------------
    def take(self, tandem: TandemState, stage: int, phase: int | None, now: float) -> Ticket | None:
        """The waiting ticket to start next in ``stage`` (in ``phase``'s queue, or any), taken out
        of its queue (the counts change when the limiter starts it), or None: none waits, or
        the stage's lock is full."""
        if self.caps[stage] is None:
            return tandem.pop_oldest(stage, phase)
        if self.room(tandem, stage) <= 0:
            return None
        queues = tandem.queues[stage] if phase is None else [tandem.queues[stage][phase]]
        t = self.pick(stage, (t for q in queues for t in q), now)
        if t is None:
            return None
        tandem.queues[stage][t.phase].remove(t)
        return t

    def pick(self, stage: int, waiting: Iterable[Ticket], now: float) -> Ticket | None:
        """The module docstring's order: past ``lock_aging`` first (oldest first), then the highest
        response ratio, ties and unkeyed stages oldest first."""
        if not self.keyed[stage]:
            return min(waiting, key=lambda t: t.seq, default=None)
        limit = self.aging[stage]
        best: Ticket | None = None
        best_rank: tuple[int, float, int] | None = None
        best_pred = shortest = math.inf
        for t in waiting:
            wait = now - t.t_arrive
            pred = self.predict(stage, t.route)
            shortest = min(shortest, pred)
            if limit is not None and wait >= limit:
                rank = (0, 0.0, t.seq)
            else:  # nothing learned yet (pred 0): every ratio is infinite and the oldest goes first
                rank = (1, -math.inf if pred <= 0 else -(wait + pred) / pred, t.seq)
            if best_rank is None or rank < best_rank:
                best, best_rank, best_pred = t, rank, pred
        if best is not None and best_pred > shortest:
            self.aged[stage] += 1
        return best

    def predict(self, stage: int, key: str) -> float:
        """Predicted holding time (s) of a request learned under ``key``: its key's mean, else the
        stage's mean, else 0 (nothing learned yet: the order is oldest first)."""
        c = self._costs[stage].get(key)
        if c is not None:
            return c.total / len(c.samples)
        n = self._stage_n[stage]
        return self._stage_total[stage] / n if n else 0.0

    def learn(self, stage: int, key: str, seconds: float) -> None:
        """One completed request of ``key`` held the lock for ``seconds``."""
        costs = self._costs[stage]
        c = costs.get(key)
        if c is None:
            c = costs[key] = _Cost(deque())
            if len(costs) > _KEYS_MAX:
                costs.popitem(last=False)
        else:
            costs.move_to_end(key)
        c.samples.append(seconds)
        c.total += seconds
        if len(c.samples) > self.history:
            c.total -= c.samples.popleft()
        self._stage_total[stage] += seconds
        self._stage_n[stage] += 1

    # ---- the limiter's hooks ---------------------------------------------------------------
    def on_release(self, ticket: Ticket, now: float, outcome: str) -> None:
        if outcome == "completed" and self.locked(ticket.stage):
            self.learn(ticket.stage, ticket.route, now - ticket.t_admit)

    def settle(self, tandem: TandemState, now: float) -> None:
        """After a decision: add the wait since the last one, and count who waits on a full lock
        now (every count changes only inside a decision, so the integral is exact)."""
        dt = max(now - self._t, 0.0)
        self._t = now
        for i, cap in enumerate(self.caps):
            if cap is None:
                continue
            self.wait_seconds[i] += self.waiting[i] * dt
            self.waiting[i] = tandem.stage_waiting[i] if self.room(tandem, i) <= 0 else 0

    def info(self, policy: object = None) -> dict[str, Any]:
        """Per locked stage, for ``GET /-/policy``: who starts its requests under ``policy``."""
        own = self.governs(policy)
        return {self.names[i]: {"capacity": cap, "source": self.source[i],
                                "starts": "lock" if i in own else "policy and lock",
                                "order": "shortest predicted first" if self.keyed[i] else "oldest first",
                                "aging_seconds": self.aging[i], "waiting": self.waiting[i],
                                "released_by_aging": self.aged[i],
                                "wait_seconds": self.wait_seconds[i], "keys_learned": len(self._costs[i])}
                for i, cap in enumerate(self.caps) if cap is not None} | {
                    self.names[i]: {"capacity": None, "source": "auto: not serialised (yet)"}
                    for i, cap in enumerate(self.caps) if cap is None and self.auto[i]}
