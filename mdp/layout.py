"""Queue layouts of the tandem's truncated state spaces: how waiting requests are queued and what
spawning a thread from a queue does (van der Weij et al., "Dynamic thread assignment", §2).

``full`` (the paper's): one queue per (stage, phase) coordinate. ``start``: one queue per stage,
a waiting request's phase drawn from α_i when its thread starts. ``none``: the chain of ``start``,
the policy seeing only counts per stage. ``route``: built by :mod:`overtake.mdp.routes`. A coupled
model (:attr:`~overtake.mdp.model.TandemModel.routing`) hands a request on by its routing row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from .model import TandemModel, exit_law

__all__ = ["Layout", "PhaseInfo"]

IntArray = npt.NDArray[np.int64]
PhaseInfo = Literal["full", "start", "none", "route"]


@dataclass(frozen=True, eq=False)
class Layout:
    """How waiting requests are queued and what spawning a thread from a queue does.

    ``entry[i]`` lists (queue, probability) for a request entering stage ``i``;
    ``spawn[a]`` lists (coordinate, probability) for spawn action ``a``, which starts a thread for
    a request of queue ``action_queue[a]`` (``None``: action ``a`` is queue ``a``'s one action).
    Several actions on one queue let the controller choose what the thread becomes — the CPU
    class it starts in (:func:`overtake.mdp.priority_classes.class_action_layout`).
    ``handoff[d]`` (coupled models, :attr:`TandemModel.routing`): the (queue, probability) list of
    a request leaving coordinate ``d`` for the next stage, in place of that stage's ``entry``.
    """

    phase_info: PhaseInfo
    queue_stage: IntArray
    entry: tuple[tuple[tuple[int, float], ...], ...]
    spawn: tuple[tuple[tuple[int, float], ...], ...]
    action_queue: IntArray | None = None
    handoff: tuple[tuple[tuple[int, float], ...], ...] | None = None

    def next_entry(self, model: TandemModel, d: int) -> tuple[tuple[int, float], ...]:
        """Where a request leaving coordinate ``d`` waits at the next stage: (queue, probability)."""
        if self.handoff is not None:
            return self.handoff[d]
        return self.entry[int(model.coord_stage()[d]) + 1]

    def __post_init__(self) -> None:
        n = self.queue_stage.size
        if self.action_queue is None:
            if len(self.spawn) != n:
                raise ValueError(f"layout: {len(self.spawn)} spawn entries for {n} queues; give action_queue")
        elif (self.action_queue.size != len(self.spawn) or self.action_queue.min(initial=0) < 0
              or self.action_queue.max(initial=0) >= n or np.unique(self.action_queue).size != n):
            raise ValueError("layout: action_queue must name a queue (0..n_queues-1) per spawn action, "
                             "every queue at least once")

    @property
    def n_queues(self) -> int:
        return int(self.queue_stage.size)

    @property
    def n_actions(self) -> int:
        return len(self.spawn)

    @property
    def queue_of_action(self) -> IntArray:
        """The queue each spawn action draws its request from."""
        if self.action_queue is None:
            return np.arange(self.n_queues, dtype=np.int64)
        return self.action_queue

    def first_action(self, q: int) -> int:
        """Queue ``q``'s first spawn action (the one a projection or a work estimate uses)."""
        return int(np.flatnonzero(self.queue_of_action == q)[0])

    @property
    def deterministic(self) -> bool:
        """True when each queue has one spawn action that starts a known coordinate (``full``)."""
        return self.action_queue is None and all(len(s) == 1 for s in self.spawn)

    @staticmethod
    def build(model: TandemModel, phase_info: PhaseInfo = "full") -> Layout:
        entry: tuple[tuple[tuple[int, float], ...], ...]
        spawn: tuple[tuple[tuple[int, float], ...], ...]
        if phase_info == "full":
            qs = model.coord_stage()
            entry = tuple(
                tuple((model.coord(i, j), float(p)) for j, p in enumerate(st.alpha) if p > 0)
                for i, st in enumerate(model.stages)
            )
            spawn = tuple(((d, 1.0),) for d in range(model.n_coords))
        elif phase_info in ("start", "none"):
            # ``none`` keeps the chain of ``start``: only what the policy may look at differs
            qs = np.arange(model.n_stages)
            entry = tuple(((i, 1.0),) for i in range(model.n_stages))
            spawn = tuple(
                tuple((model.coord(i, j), float(p)) for j, p in enumerate(st.alpha) if p > 0)
                for i, st in enumerate(model.stages)
            )
        elif phase_info == "route":
            raise ValueError("phase_info 'route' needs the route split: build it with RouteSplit.layout(model)")
        else:
            raise ValueError(f"phase_info must be 'full', 'start', 'none' or 'route', got {phase_info!r}")
        if model.coupled:
            return _coupled_layout(model, phase_info, np.asarray(qs, dtype=np.int64), entry, spawn)
        return Layout(phase_info, np.asarray(qs, dtype=np.int64), entry, spawn)


def _coupled_layout(model: TandemModel, phase_info: PhaseInfo, qs: IntArray,
                    entry: tuple[tuple[tuple[int, float], ...], ...],
                    spawn: tuple[tuple[tuple[int, float], ...], ...]) -> Layout:
    """The layout of a coupled model (:attr:`TandemModel.routing`), the smallest exact one.

    ``full``: the queues of the independent layout; a request leaving (i, j) waits in the queue of
    its start phase l at stage i + 1, drawn from R_i[j] (the start phase is all the rest of its
    path depends on). Phase-blind layouts: stage 1 keeps one queue; stage i + 1 has one queue per
    distinct row of R_i among the phases that exit (requests of one row are interchangeable), its
    spawn drawing from that row. Independent routing gives one row per stage: today's layout.
    """
    if phase_info == "full":
        handoff = tuple(
            tuple((model.coord(i + 1, l), float(p)) for l, p in enumerate(model.start_law(i, j)) if p > 0)
            if i + 1 < model.n_stages else ()
            for i, st in enumerate(model.stages) for j in range(st.phases))
        return Layout(phase_info, qs, entry, spawn, handoff=handoff)
    q_stage: list[int] = [0]
    new_spawn: list[tuple[tuple[int, float], ...]] = [spawn[0]]
    new_entry: list[tuple[tuple[int, float], ...]] = [((0, 1.0),)]
    hand: list[tuple[tuple[int, float], ...]] = []
    for i, st in enumerate(model.stages):
        if i + 1 == model.n_stages:
            hand.extend(() for _ in range(st.phases))
            continue
        rows: list[tuple[float, ...]] = []
        for j in range(st.phases):
            row = tuple(float(p) for p in model.start_law(i, j))
            if st.exit_rates[j] > 0 and row not in rows:
                rows.append(row)
        first = len(q_stage)
        for row in rows:
            q_stage.append(i + 1)
            new_spawn.append(tuple((model.coord(i + 1, l), p) for l, p in enumerate(row) if p > 0))
        law = exit_law(st)
        new_entry.append(tuple((first + r, float(sum(law[j] for j in range(st.phases)
                                                    if tuple(float(p) for p in model.start_law(i, j)) == row)))
                               for r, row in enumerate(rows)))
        for j in range(st.phases):
            row = tuple(float(p) for p in model.start_law(i, j))
            hand.append(((first + rows.index(row), 1.0),) if row in rows else ())
    return Layout(phase_info, np.asarray(q_stage, dtype=np.int64), tuple(new_entry), tuple(new_spawn),
                  handoff=tuple(hand))
