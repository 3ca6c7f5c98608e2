"""CPU priority levels: how the admitted threads share the CPU, and by what rule each gets a level.

Every active thread sits in a priority level; the CPU is shared in proportion to per-level weights
w_0 = 1 > w_1 > … (the kernel's nice/SCHED_IDLE weights), equally among the threads of one level.
A thread's level is max(its starting class, its age level), the age level being the number of
thresholds a_1 < a_2 < … its request's attained service *at the current stage* has passed. The
starting class comes from the policy: 0 for all (age priority), or per (stage, phase) coordinate
(known-phase short-first, route classes). Thresholds are in the model's time unit of attained
service (seconds of CPU when δ = 0). Apache's mod_overtake_prio applies them
(``OvertakePrioLevels``); :class:`CpuPriority` carries them to the simulator
(:func:`overtake.mdp.simulation.simulate`) and to the sidecar's replay model.

The exact analysis of one M/G/1 with these levels is :mod:`overtake.mdp.mlps`, the choice of
thresholds :mod:`overtake.mdp.thresholds`, what they do to a solved policy
:mod:`overtake.mdp.priority_prediction`, CPU classes by phase :mod:`overtake.mdp.priority_classes`.
"""
from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import ModelError
from .model import Stage, TandemModel

__all__ = [
    "DEFAULT_LOW_WEIGHT",
    "NICE19_WEIGHT",
    "NICE_WEIGHTS",
    "SCHED_IDLE_WEIGHT",
    "CpuPriority",
    "age_priority",
    "class_priority",
    "exempt_stages",
    "level_weights",
    "locked_stages",
    "short_first_levels",
    "weights_for_levels",
]

#: Linux ``sched_prio_to_weight`` (kernel/sched/core.c): CFS/EEVDF weight of each nice level.
NICE_WEIGHTS: Mapping[int, int] = dict(zip(range(-20, 20), (
    88761, 71755, 56483, 46273, 36291, 29154, 23254, 18705, 14949, 11916,
    9548, 7620, 6100, 4904, 3906, 3121, 2501, 1991, 1586, 1277,
    1024, 820, 655, 526, 423, 335, 272, 215, 172, 137,
    110, 87, 70, 56, 45, 36, 29, 23, 18, 15)))
#: ``WEIGHT_IDLEPRIO`` (kernel/sched/sched.h): the weight of a SCHED_IDLE thread.
SCHED_IDLE_WEIGHT = 3
#: nice 19 against nice 0 by the kernel's table: 15/1024 (a documented default, not a measurement).
NICE19_WEIGHT = NICE_WEIGHTS[19] / NICE_WEIGHTS[0]
#: SCHED_IDLE against nice 0 by the kernel's tables: 3/1024 — the default weight of a demoted
#: level until a measurement on the target kernel replaces it (``--level-weights``).
DEFAULT_LOW_WEIGHT = SCHED_IDLE_WEIGHT / NICE_WEIGHTS[0]

_WEIGHT_TOKEN = re.compile(r"^(?:nice(-?\d+)|idle|sched_idle)$")


def level_weights(spec: str | Sequence[float]) -> tuple[float, ...]:
    """Parse per-level CPU weights: numbers, ``niceN`` or ``idle``, comma-separated.

    Kernel tokens take the kernel's tables (``nice0,nice19`` = 1, 15/1024; ``idle`` = 3/1024)
    and everything is divided by the first entry, so level 0 has weight 1. Weights must be
    positive and strictly decreasing (each level below the one before it).
    """
    items: list[Any] = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    out: list[float] = []
    for it in items:
        if isinstance(it, str):
            m = _WEIGHT_TOKEN.match(it.lower())
            if m:
                if m.group(1) is None:
                    out.append(float(SCHED_IDLE_WEIGHT))
                    continue
                nice = int(m.group(1))
                if nice not in NICE_WEIGHTS:
                    raise ModelError(f"level weights: nice must be in -20..19, got {it!r}")
                out.append(float(NICE_WEIGHTS[nice]))
                continue
            try:
                out.append(float(it))
            except ValueError:
                raise ModelError(f"level weights: {it!r} is not a number, niceN or idle "
                                 "(e.g. 1,0.0146 or nice0,nice19 or nice0,idle)") from None
        else:
            out.append(float(it))
    if len(out) < 1 or not all(math.isfinite(w) and w > 0 for w in out):
        raise ModelError(f"level weights must be positive numbers, got {spec!r}")
    if any(b >= a for a, b in itertools.pairwise(out)):
        raise ModelError(f"level weights must be strictly decreasing (level 0 first), got {spec!r}")
    return tuple(w / out[0] for w in out)


@dataclass(frozen=True)
class CpuPriority:
    """Priority levels on the shared CPU (see the module docstring).

    Parameters
    ----------
    weights
        L per-level CPU weights, ``weights[0] == 1`` and strictly decreasing (strict priority is
        the limit of a tiny ratio, e.g. 1e-9).
    thresholds
        One tuple per stage of L − 1 increasing attained-service thresholds (model time units;
        ``inf`` = never demoted past that level): level ℓ holds attained service in
        [thresholds[ℓ−1], thresholds[ℓ]).
    start_levels
        ``None`` (every thread starts in level 0) or one tuple per stage giving each phase's
        starting level (known-phase short-first, route classes). A thread's level is
        max(start level, age level).
    name
        A label for reports.
    """

    weights: tuple[float, ...]
    thresholds: tuple[tuple[float, ...], ...]
    start_levels: tuple[tuple[int, ...], ...] | None = None
    name: str = "cpu priority"

    def __post_init__(self) -> None:
        w = tuple(float(x) for x in self.weights)
        object.__setattr__(self, "weights", w)
        if len(w) < 1 or w[0] != 1.0 or not all(math.isfinite(x) and x > 0 for x in w) or any(
                b >= a for a, b in itertools.pairwise(w)):
            raise ModelError(f"cpu priority weights must start at 1 and decrease strictly, got {w}")
        th = tuple(tuple(float(x) for x in row) for row in self.thresholds)
        object.__setattr__(self, "thresholds", th)
        for i, row in enumerate(th):
            if len(row) != len(w) - 1:
                raise ModelError(f"cpu priority thresholds[{i}]: {len(w)} levels need {len(w) - 1} thresholds, "
                                 f"got {len(row)}")
            if any(not (x > 0) for x in row) or any(b <= a for a, b in itertools.pairwise(row) if math.isfinite(a)):
                raise ModelError(f"cpu priority thresholds[{i}] must be > 0 and increasing, got {row}")
        if self.start_levels is not None:
            sl = tuple(tuple(int(x) for x in row) for row in self.start_levels)
            object.__setattr__(self, "start_levels", sl)
            if len(sl) != len(th):
                raise ModelError(f"cpu priority start_levels: one row per stage ({len(th)}), got {len(sl)}")
            for i, row in enumerate(sl):
                if any(not 0 <= x < len(w) for x in row):
                    raise ModelError(f"cpu priority start_levels[{i}] must be in 0..{len(w) - 1}, got {row}")

    @property
    def levels(self) -> int:
        return len(self.weights)

    def check(self, model: TandemModel) -> None:
        """Raise :class:`ModelError` unless these levels fit ``model`` (stages, phases)."""
        if len(self.thresholds) != model.n_stages:
            raise ModelError(f"cpu priority: thresholds for {len(self.thresholds)} stages, the model has "
                             f"{model.n_stages}")
        if self.start_levels is not None:
            for i, (row, s) in enumerate(zip(self.start_levels, model.stages)):
                if len(row) != s.phases:
                    raise ModelError(f"cpu priority start_levels[{i}]: stage {s.name} has {s.phases} phases, "
                                     f"got {len(row)} levels")

    def coord_start(self, model: TandemModel) -> npt.NDArray[np.int64]:
        """Starting level per (stage, phase) coordinate, in the model's coordinate order."""
        self.check(model)
        if self.start_levels is None:
            return np.zeros(model.n_coords, dtype=np.int64)
        return np.asarray([x for row in self.start_levels for x in row], dtype=np.int64)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "weights": list(self.weights),
                "thresholds": [list(r) for r in self.thresholds],
                "start_levels": None if self.start_levels is None else [list(r) for r in self.start_levels]}


def weights_for_levels(weights: Sequence[float] | str | None, levels: int) -> tuple[float, ...]:
    """``levels`` weights: ``weights`` parsed (:func:`level_weights`), or by default 1 then powers of
    :data:`DEFAULT_LOW_WEIGHT`."""
    if weights is None:
        return (1.0,) + tuple(DEFAULT_LOW_WEIGHT ** k for k in range(1, levels))
    w = level_weights(weights)
    if len(w) != levels:
        raise ModelError(f"level weights: {levels} levels need {levels} weights, got {len(w)}")
    return w


def age_priority(model: TandemModel, thresholds: Sequence[float] | Sequence[Sequence[float]], *,
                 weights: Sequence[float] | str | None = None) -> CpuPriority:
    """Age priority: every thread starts in level 0 and is demoted as its stage's attained service
    passes ``thresholds`` (one list for all stages, or one per stage). Default weights: 1 then
    powers of :data:`DEFAULT_LOW_WEIGHT` (SCHED_IDLE by the kernel's tables)."""
    rows: list[tuple[float, ...]] = []
    flat: list[float] = []
    for item in thresholds:
        if isinstance(item, Sequence):
            rows.append(tuple(float(x) for x in item))
        else:
            flat.append(float(item))
    if flat or not rows:
        rows = [tuple(flat)] * model.n_stages
    w = weights_for_levels(weights, len(rows[0]) + 1)
    name = "age priority " + "; ".join(",".join(f"{x:.4g}" for x in r) for r in rows)
    return CpuPriority(w, tuple(rows), None, name)


def exempt_stages(priority: CpuPriority, stages: Sequence[int]) -> CpuPriority:
    """``priority`` with the requests of ``stages`` never demoted (their thresholds at infinity).

    mod_overtake_prio exempts a request that may hold a lock others wait for (the stages file's
    ``cpu_exempt``, sent as ``X-Overtake-Exempt``): a demoted holder would make every waiter wait
    at the idle weight (priority inversion). A stage with a lock (:mod:`overtake.mdp.lock`) is
    such a stage; its holders compete at level 0 with everyone else's young requests.
    """
    if not stages:
        return priority
    never = (math.inf,) * (priority.levels - 1)
    rows = tuple(never if i in stages else r for i, r in enumerate(priority.thresholds))
    return CpuPriority(priority.weights, rows, priority.start_levels,
                       f"{priority.name}; stages {', '.join(str(i) for i in sorted(stages))} exempt")


def locked_stages(model: TandemModel) -> tuple[int, ...]:
    """The stages with a lock (:mod:`overtake.mdp.lock`): exempt from demotion under age priority."""
    return tuple(i for i in range(model.n_stages) if model.lock_of(i) is not None)


def short_first_levels(stage: Stage) -> tuple[int, ...]:
    """Known-phase short-first: level 0 for start phases whose expected work is at most the
    stage's mean, level 1 for the others (for an H2, the short branch first)."""
    pm = stage.phase_means()
    return tuple(0 if m <= stage.mean() * (1 + 1e-12) else 1 for m in pm)


def class_priority(model: TandemModel, *, weights: Sequence[float] | str | None = None,
                   start_levels: Sequence[Sequence[int]] | None = None) -> CpuPriority:
    """Class priority: two levels, each thread's level fixed by its start phase
    (:func:`short_first_levels` unless ``start_levels`` is given); no age demotion."""
    sl = tuple(tuple(r) for r in start_levels) if start_levels is not None else \
        tuple(short_first_levels(s) for s in model.stages)
    L = max(max(r) for r in sl) + 1 if sl else 1
    L = max(L, 2)
    w = weights_for_levels(weights, L)
    th = tuple((math.inf,) * (L - 1) for _ in model.stages)
    return CpuPriority(w, th, sl, "class priority (known-phase short-first)")
