"""CPU classes by phase: the model with them, the classes worth choosing, and the class as an action.

Class priority (:func:`overtake.mdp.priority.class_priority`) puts each thread in a CPU class by
its request's phase: the high class (weight 1) or the low one (the kernel's SCHED_IDLE weight by
default, :data:`overtake.mdp.priority.DEFAULT_LOW_WEIGHT`). Where no phase moves to another
(hyperexponential stages) a request's class is its current phase's, so class priority is weighted
sharing by phase (:func:`class_model`, ``TandemModel.weights``) and the chain is exact:
:func:`choose_classes` solves the spawn policy that is optimal with the classes in force, for each
assignment of :func:`class_candidates`, and keeps the best. :func:`class_action_optimum` solves the
larger MDP in which the class is part of the action (each spawn starts the thread in the high or
the low class, whatever its phase): the optimum that classes fixed by phase are measured against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .average_cost import SolveResult, induced_matrix, solve_space
from .errors import ModelError
from .evaluate import PolicyMetrics, metrics, stationary_distribution
from .model import Stage, TandemModel
from .optimum import Optimum, solve_mdp
from .priority import DEFAULT_LOW_WEIGHT, short_first_levels
from .statespace import Layout, StateSpace, Truncation

__all__ = [
    "ClassActionOptimum", "ClassChoice", "Levels", "class_action_layout", "class_action_optimum", "class_candidates",
    "class_model", "choose_classes", "model_levels", "phases_stay",
]

FloatArray = np.typing.NDArray[np.float64]


def phases_stay(model: TandemModel) -> bool:
    """True when no phase moves to another (every T diagonal: hyperexponential stages)."""
    return all(np.count_nonzero(s.T - np.diag(np.diag(s.T))) == 0 for s in model.stages)


Levels = tuple[tuple[int, ...], ...]


def class_model(model: TandemModel, weight: float = DEFAULT_LOW_WEIGHT, levels: Levels | None = None) -> TandemModel:
    """``model`` with class priority as CPU weights by phase: 1 for class 0, ``weight`` for class 1.

    ``levels[i][j]`` is the class of stage i's phase j; by default short-first (class 0 for
    phases whose expected work is at most the stage's mean, :func:`short_first_levels`).

    Raises
    ------
    ModelError
        A phase moves to another: the module's class is the start phase's, no longer the
        current phase's, and weighted sharing by phase would be another policy.
    """
    if not phases_stay(model):
        raise ModelError("cpu priority class: exact only for stages whose phases do not move (hyperexponential "
                         "fits, --structure hyperexp); use the simulated prediction of predict_priority")
    lv = tuple(short_first_levels(s) for s in model.stages) if levels is None else levels
    if [len(r) for r in lv] != [s.phases for s in model.stages] or any(x not in (0, 1) for r in lv for x in r):
        raise ModelError(f"cpu priority class: levels must give class 0 or 1 per phase of each stage, got {lv!r}")
    w = tuple(1.0 if x == 0 else float(weight) for r in lv for x in r)
    return replace(model, weights=w)


def model_levels(model: TandemModel) -> Levels | None:
    """The classes a model was solved with (:func:`class_model`): 1 where a phase's CPU weight is
    below the highest, per stage; None without weights."""
    if model.weights is None:
        return None
    top = max(model.weights)
    flat = [int(w < top) for w in model.weights]
    out, at = [], 0
    for s in model.stages:
        out.append(tuple(flat[at:at + s.phases]))
        at += s.phases
    return tuple(out)


def class_candidates(model: TandemModel) -> list[Levels]:
    """Two-class assignments worth solving: rank every (stage, phase) by its expected remaining
    work through the last stage (the phase's mean plus the later stages' means: shortest expected
    remaining work first, the cμ order of one server) and cut the ranking at each place, plus
    short-first within each stage (:func:`short_first_levels`). Solving the MDP with the class in
    the action (:func:`class_action_optimum`) on Table 1's H2 cases found its optimum close to
    the best of these (BENCHMARKS.md ``cpu-priority-model``)."""
    later = [sum(t.mean() for t in model.stages[i + 1:]) for i in range(model.n_stages)]
    work = [(float(m) + later[i], i, j) for i, s in enumerate(model.stages) for j, m in enumerate(s.phase_means())]
    order = sorted(work)
    cands: list[Levels] = [tuple(short_first_levels(s) for s in model.stages)]
    for cut in range(1, len(order)):
        low = {(i, j) for _, i, j in order[cut:]}
        if order[cut - 1][0] >= order[cut][0] * (1 - 1e-12):
            continue  # a tie: both sides of the cut are the same work
        lv = tuple(tuple(int((i, j) in low) for j in range(s.phases)) for i, s in enumerate(model.stages))
        if lv not in cands:
            cands.append(lv)
    return cands


@dataclass(frozen=True)
class ClassChoice:
    """The class assignment whose spawn optimum has the lowest exact E[W] (:func:`choose_classes`)."""

    levels: Levels
    optimum: Optimum  # of class_model(model, levels=levels)
    candidates: tuple[tuple[Levels, float], ...]  # each assignment and its optimum's E[W]


def choose_classes(model: TandemModel, *, weight: float = DEFAULT_LOW_WEIGHT, truncation: Truncation | None = None,
                   tol: float = 1e-3, method: str = "anderson", progress: Any = None) -> ClassChoice:
    """Solve the spawn optimum under each of :func:`class_candidates` (exact: H2 phases stay) and
    keep the best; ties go to the earlier candidate (short-first first)."""
    best = None
    seen: list[tuple[Levels, float]] = []
    for lv in class_candidates(model):
        opt = solve_mdp(class_model(model, weight, lv), truncation=truncation, tol=tol, method=method,
                            progress=progress)
        ew = float(opt.metrics.mean_response_time)
        seen.append((lv, ew))
        if best is None or ew < best[1] * (1 - 1e-9):
            best = (lv, ew, opt)
    assert best is not None
    return ClassChoice(best[0], best[2], tuple(seen))


def class_action_layout(model: TandemModel, weight: float = DEFAULT_LOW_WEIGHT) -> tuple[TandemModel, Layout]:
    """The tandem in which each spawn also picks the thread's CPU class (high: weight 1, low: ``weight``).

    Each stage's PH is doubled: phases ``0..M-1`` are the high class, ``M..2M-1`` the same phases
    in the low class (block-diagonal T: a request keeps its class at the stage, its phases move as
    before), with weighted sharing between them (``TandemModel.weights``). Waiting requests queue
    by phase as in the ``full`` layout, and queue (i, j) has two spawn actions: into (i, j, high)
    or (i, j, low). Exact for any PH, moving phases included.
    """
    if not (0.0 < weight <= 1.0):
        raise ModelError(f"cpu priority class: the low class's weight must be in (0, 1], got {weight!r}")
    stages = []
    for st in model.stages:
        m = st.phases
        T = np.zeros((2 * m, 2 * m))
        T[:m, :m] = st.T
        T[m:, m:] = st.T
        stages.append(Stage(st.name, np.concatenate([st.alpha, np.zeros(m)]), T))
    weights = tuple(w for st in model.stages for w in [1.0] * st.phases + [float(weight)] * st.phases)
    big = replace(model, stages=tuple(stages), weights=weights)
    entry = tuple(
        tuple((model.coord(i, j), float(p)) for j, p in enumerate(st.alpha) if p > 0)
        for i, st in enumerate(model.stages)
    )
    spawn: list[tuple[tuple[int, float], ...]] = []
    action_queue: list[int] = []
    for i, st in enumerate(model.stages):
        for j in range(st.phases):
            for level in (0, 1):
                spawn.append(((big.coord(i, level * st.phases + j), 1.0),))
                action_queue.append(model.coord(i, j))
    layout = Layout("full", np.asarray(model.coord_stage(), dtype=np.int64), entry, tuple(spawn),
                    np.asarray(action_queue, dtype=np.int64))
    return big, layout


@dataclass(frozen=True)
class ClassActionOptimum:
    """The optimum with the CPU class chosen at each spawn, on one truncation, beside the best
    optimum with the class fixed by the phase (:func:`class_model`) on the same truncation.

    ``gain`` is the average cost (requests present plus the truncation's blocking charge, what
    the solver minimises); ``low_share[d]`` is the share of active threads of (stage, phase)
    coordinate ``d`` that run in the low class under the optimum.
    """

    gain: float
    gain_bounds: tuple[float, float]
    mean_response_time: float
    low_share: tuple[float, ...]
    fixed_gain: float | None
    fixed_mean_response_time: float | None
    states: int
    seconds: float

    @property
    def gap(self) -> float | None:
        """Relative excess of the fixed-class optimum's E[W] over the class-action optimum's."""
        if self.fixed_mean_response_time is None:
            return None
        return self.fixed_mean_response_time / self.mean_response_time - 1.0


def _optimum_metrics(space: StateSpace, tol: float, method: str) -> tuple[SolveResult, PolicyMetrics, FloatArray]:
    res = solve_space(space, method=method, tol=tol)
    reach, pi = stationary_distribution(induced_matrix(space, res.decision))
    m = metrics(space.model, space.rows[reach], space.layout.queue_stage, pi, space.cap)
    full = np.zeros(space.size)
    full[reach] = pi
    return res, m, full


def class_action_optimum(model: TandemModel, truncation: Truncation, *, weight: float = DEFAULT_LOW_WEIGHT,
                         tol: float = 1e-8, method: str = "anderson", levels: Levels | None = None) -> ClassActionOptimum:
    """Solve the MDP with the class in the action (:func:`class_action_layout`) on ``truncation``.

    The fixed-class optimum (the class fixed by the phase: ``levels``, or the best of
    :func:`class_candidates`, which ``overtake solve --cpu-priority class`` writes) is one of its
    policies, so its gain is never below this one's: the ``gap`` is what fixing the class by phase
    costs. Computed only where phases stay (else ``None``).
    """
    t0 = time.perf_counter()
    big, layout = class_action_layout(model, weight)
    space = StateSpace(big, truncation, layout=layout)
    res, m, pi = _optimum_metrics(space, tol, method)
    Q = layout.n_queues
    low_share = []
    for i, st in enumerate(model.stages):
        for j in range(st.phases):
            hi = float(pi @ space.rows[:, Q + big.coord(i, j)])
            lo = float(pi @ space.rows[:, Q + big.coord(i, st.phases + j)])
            low_share.append(lo / (hi + lo) if hi + lo > 0 else 0.0)
    fixed_gain = fixed_ew = None
    if phases_stay(model):
        cands = [levels] if levels is not None else class_candidates(model)
        for lv in cands:
            fres, fm, _ = _optimum_metrics(StateSpace(class_model(model, weight, lv), truncation), tol, method)
            if fixed_gain is None or fres.gain < fixed_gain:
                fixed_gain, fixed_ew = float(fres.gain), float(fm.mean_response_time)
    return ClassActionOptimum(float(res.gain), (float(res.gain_bounds[0]), float(res.gain_bounds[1])),
                              float(m.mean_response_time), tuple(low_share), fixed_gain, fixed_ew,
                              space.size, time.perf_counter() - t0)
