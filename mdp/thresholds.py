"""Age thresholds for CPU priority levels: chosen on the exact analysis of one M/G/1, and for the tandem.

:func:`choose_thresholds` minimises the exact E[T] over the thresholds (the
SOAP programme of Scully, Harchol-Balter and Scheller-Wolf, *SOAP: one clean analysis of all
age-based scheduling policies*, 2018, does the same for rank-based policies). The tandem has no
exact analysis: :func:`tandem_visit_classes` models it as one M/G/1 whose jobs are the stage
visits (Poisson at rate λ per stage, the stage's PH, its thresholds) — exact for PS by BCMP
insensitivity, an approximation with priority — and the simulator measures the real thing.

That M/G/1 of stage visits is the *visit model*; its E[W] (:func:`tandem_model_mean`) is the
prediction :func:`choose_tandem_thresholds` minimises.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .errors import ModelError
from .mlps import EXACT, SEARCH, Accuracy, JobClass, PHInput, PHMoments, as_ph, fb_mean, mlps_classes_mean, mlps_mean, ps_mean
from .model import TandemModel
from .priority import CpuPriority, exempt_stages, locked_stages, weights_for_levels

__all__ = [
    "TandemChoice", "ThresholdChoice", "choose_tandem_thresholds", "choose_thresholds", "tandem_model_mean",
    "tandem_visit_classes",
]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class ThresholdChoice:
    """Thresholds minimising the exact strict-priority E[T] of one M/G/1, with the yardsticks."""

    thresholds: tuple[float, ...]
    mean_response_time: float
    ps: float
    fb: float
    evaluations: int
    curve: tuple[tuple[float, float], ...] = field(default=())

    @property
    def gain_over_ps(self) -> float:
        return 1.0 - self.mean_response_time / self.ps


def _optimise(fun: Callable[[FloatArray], float], x0: FloatArray, lo: float, hi: float) -> tuple[FloatArray, float, int]:
    """Nelder–Mead over log-thresholds within [lo, hi] (a threshold at a bound means "demote at
    once" or "never": the exact E[T] is flat beyond them)."""
    from scipy.optimize import minimize

    res = minimize(fun, np.clip(x0, lo, hi), method="Nelder-Mead", bounds=[(lo, hi)] * len(x0),
                   options={"xatol": 0.01, "fatol": 1e-6, "maxfev": 200})
    return np.asarray(res.x), float(res.fun), int(res.nfev)


def _bracketed(fun: Callable[[float], float], left: float, right: float) -> tuple[float, float]:
    """Minimise ``fun`` of one log-threshold on [left, right] (Brent, bounded). E[W] is flat at
    its minimum: a threshold 4 % off moves it far less than a simulation's confidence interval."""
    from scipy.optimize import minimize_scalar

    res = minimize_scalar(fun, bounds=(left, right), method="bounded", options={"xatol": 0.04})
    return float(res.x), float(res.fun)


def choose_thresholds(ph: PHInput, arrival_rate: float, *, levels: int = 2, grid: int = 256) -> ThresholdChoice:
    """Age thresholds minimising the exact E[T] (strict priority, PS within levels) of one M/G/1.

    A coarse log-spaced scan of the first threshold (levels = 2) or of geometric thresholds
    (x, 3x, 9x, …; levels > 2) seeds a Nelder–Mead search over log-thresholds. The real levels'
    weights are finite: E[T] under them lies between this prediction and PS; the simulator measures it.
    """
    a, T = as_ph(ph)
    if levels < 1:
        raise ModelError(f"levels must be >= 1, got {levels}")
    p = PHMoments(a, T)
    ps = ps_mean((a, T), arrival_rate)
    fb = fb_mean((a, T), arrival_rate)
    if levels == 1:
        return ThresholdChoice((), ps, ps, fb, 0)
    n_eval = 0
    cache: dict[tuple[float, ...], float] = {}

    def ev(th: Sequence[float]) -> float:
        nonlocal n_eval
        key = tuple(round(float(x), 12) for x in th)
        if key not in cache:
            n_eval += 1
            cache[key] = mlps_mean((a, T), arrival_rate, key, grid=grid)
        return cache[key]

    lo, hi = 0.05 * p.mean, 20.0 * p.mean
    scan = np.geomspace(lo, hi, 17)
    curve: list[tuple[float, float]] = []
    if levels == 2:
        for x in scan:
            curve.append((float(x), ev([x])))
        best = int(np.argmin([c[1] for c in curve]))
        x0 = np.log([curve[best][0]])
    else:
        best_val, x0 = math.inf, np.zeros(levels - 1)
        for x in scan[::2]:
            geometric = x * 3.0 ** np.arange(levels - 1)
            v = ev(geometric)
            if v < best_val:
                best_val, x0 = v, np.log(geometric)

    def fun(lx: FloatArray) -> float:
        th = np.exp(np.sort(lx))
        if np.any(np.diff(th) <= 1e-9 * th[:-1]):
            return math.inf
        return ev(tuple(float(v) for v in th))

    xs, val, _ = _optimise(fun, x0, math.log(1e-3 * p.mean), math.log(1e3 * p.mean))
    th = tuple(float(v) for v in np.exp(np.sort(xs)))
    return ThresholdChoice(th, val, ps, fb, n_eval, tuple(curve))


def tandem_visit_classes(model: TandemModel, priority: CpuPriority) -> list[JobClass]:
    """The tandem's stage visits as classes of one M/G/1: stage-i visits arrive Poisson(λ) with
    the stage's PH split by start phase (class floors from ``priority.start_levels``)."""
    priority.check(model)
    out: list[JobClass] = []
    for i, s in enumerate(model.stages):
        th = priority.thresholds[i]
        if priority.start_levels is None:
            out.append(JobClass(model.arrival_rate, s.alpha, s.T, 0, th))
            continue
        for lvl in sorted(set(priority.start_levels[i])):
            mask = np.asarray([x == lvl for x in priority.start_levels[i]])
            w = float(s.alpha[mask].sum())
            if w <= 0:
                continue
            alpha = np.where(mask, s.alpha, 0.0) / w
            out.append(JobClass(model.arrival_rate * w, alpha, s.T, lvl, th))
    return out


def tandem_model_mean(model: TandemModel, priority: CpuPriority | None = None, *, grid: int = 256,
                      accuracy: Accuracy = EXACT) -> float:
    """E[W] of the tandem under π(∞) and ``priority`` in the visit model (strict priority):
    the sum over stages of the visits' mean response times. Exact without priority (PS)."""
    if model.cores != 1 or model.overhead != 0.0:
        raise ModelError("the visit model needs cores = 1 and overhead = 0 (c(K) = 1)")
    if priority is None or priority.levels == 1:
        return model.mean_service() / (1.0 - model.load)
    classes = tandem_visit_classes(model, priority)
    means = mlps_classes_mean(classes, grid=grid, accuracy=accuracy)
    lam = model.arrival_rate
    return float(sum(c.arrival_rate * m for c, m in zip(classes, means)) / lam)


@dataclass(frozen=True)
class TandemChoice:
    """Thresholds for the tandem chosen in the visit model, and that model's E[W] (strict priority).

    ``priority`` holds the thresholds as the module applies them, to every stage; ``exempt`` the
    stages whose requests it never demotes (:func:`~overtake.mdp.priority.exempt_stages`), as
    the visit model and the simulator take them (:attr:`in_force`)."""

    priority: CpuPriority
    mean_response_time: float
    ps: float
    evaluations: int
    exempt: tuple[int, ...] = ()

    @property
    def in_force(self) -> CpuPriority:
        """The levels each stage's requests see: the exempt stages' never demoted."""
        return exempt_stages(self.priority, self.exempt)


def choose_tandem_thresholds(model: TandemModel, *, levels: int = 2, weights: Sequence[float] | str | None = None,
                             grid: int = 256, common: bool = False,
                             exempt: Sequence[int] | None = None) -> TandemChoice:
    """Age thresholds for the tandem under π(∞), minimising the visit model's E[W].

    Two levels: one threshold per stage (seeded by the best common threshold, then Nelder–Mead
    over the per-stage log-thresholds). More levels: one set of thresholds common to all stages
    (the exact analysis needs equal middle-level widths across classes). ``common``: the same
    thresholds for every stage, as one server-wide ``OvertakePrioLevels`` applies them.
    ``weights`` only label the returned levels (default 1 then
    :data:`~overtake.mdp.priority.DEFAULT_LOW_WEIGHT` powers); the prediction is the
    strict-priority limit, the simulator gives E[W] at the real weights.

    ``exempt``: stages whose requests are never demoted (default: the stages with a lock,
    :func:`~overtake.mdp.priority.locked_stages`); the visit model weighs the thresholds with
    them at level 0. The visit model keeps processor sharing within a level, the lock's
    serialisation included: the threshold search is approximate there, and the simulator
    (:func:`overtake.mdp.priority_prediction.predict_priority`) runs the lock.
    """
    if levels < 2:
        raise ModelError(f"levels must be >= 2 for age priority, got {levels}")
    w = weights_for_levels(weights, levels)
    ex = _exempt(model, exempt)
    ps = tandem_model_mean(model)
    ev = _TandemObjective(model, w, ex, grid)
    rows, val = _search_thresholds(ev, model, levels, common)
    pr = CpuPriority(w, rows, None, "age priority " + "; ".join(",".join(f"{x:.4g}" for x in r) for r in rows))
    return TandemChoice(pr, val, ps, ev.n_eval, ex)


Rows = tuple[tuple[float, ...], ...]


def _exempt(model: TandemModel, exempt: Sequence[int] | None) -> tuple[int, ...]:
    """The stages never demoted: the given ones (checked), by default the stages with a lock."""
    N = model.n_stages
    ex = tuple(sorted(set(locked_stages(model) if exempt is None else (int(i) for i in exempt))))
    if any(not 0 <= i < N for i in ex):
        raise ModelError(f"exempt: stage indices in 0..{N - 1}, got {list(ex)}")
    return ex


class _TandemObjective:
    """The visit model's E[W] under a set of threshold rows, at search accuracy, cached by the rows
    (rounded to 12 digits: the optimisers revisit points) and counting the evaluations made."""

    def __init__(self, model: TandemModel, w: tuple[float, ...], ex: tuple[int, ...], grid: int) -> None:
        self.model, self.w, self.ex, self.grid = model, w, ex, grid
        self.n_eval = 0
        self.cache: dict[tuple[float, ...], float] = {}

    def __call__(self, rows: Rows) -> float:
        key = tuple(round(x, 12) for r in rows for x in r)
        if key not in self.cache:
            self.n_eval += 1
            self.cache[key] = tandem_model_mean(self.model, exempt_stages(CpuPriority(self.w, rows), self.ex),
                                                grid=self.grid, accuracy=SEARCH)
        return self.cache[key]


def _search_thresholds(ev: _TandemObjective, model: TandemModel, levels: int, common: bool) -> tuple[Rows, float]:
    """The best rows and their E[W]: a scan of common thresholds (levels spaced by 3) seeds the
    search, which is then one-dimensional (two levels, common), per stage (two levels), or over
    one common set of ``levels - 1`` thresholds."""
    N = model.n_stages
    scale = float(np.mean([s.mean() for s in model.stages]))
    lo, hi = math.log(1e-3 * scale), math.log(1e3 * scale)
    scan = np.geomspace(0.05 * scale, 20.0 * scale, 9)
    values = [ev((tuple(float(x * 3.0**k) for k in range(levels - 1)),) * N) for x in scan]
    at = int(np.argmin(values))
    x0 = math.log(scan[at])
    if levels == 2 and common:
        # one variable: Brent's method inside the scan's bracket (the neighbours of its best point)
        left = math.log(scan[at - 1]) if at > 0 else lo
        right = math.log(scan[at + 1]) if at < len(scan) - 1 else hi
        x1, val = _bracketed(lambda lx: ev(((math.exp(lx),),) * N), left, right)
        if values[at] < val:
            x1, val = x0, values[at]
        return ((float(math.exp(x1)),),) * N, val
    if levels == 2:
        return _per_stage_search(ev, N, x0, lo, hi)
    return _common_levels_search(ev, N, levels, x0, lo, hi)


def _per_stage_search(ev: _TandemObjective, N: int, x0: float, lo: float, hi: float) -> tuple[Rows, float]:
    """Two levels: Nelder–Mead over the per-stage log-thresholds from the common seed ``x0``."""
    def fun(lx: FloatArray) -> float:
        return ev(tuple((float(math.exp(v)),) for v in lx))

    xs, val, _ = _optimise(fun, np.full(N, x0), lo, hi)
    return tuple((float(math.exp(v)),) for v in xs), val


def _common_levels_search(ev: _TandemObjective, N: int, levels: int, x0: float, lo: float,
                          hi: float) -> tuple[Rows, float]:
    """More levels: one set of increasing thresholds common to all stages (the exact analysis
    needs equal middle-level widths), seeded at ``x0`` with levels spaced by 3; coinciding
    thresholds are infeasible."""
    def fun(lx: FloatArray) -> float:
        th = np.exp(np.sort(lx))
        if np.any(np.diff(th) <= 1e-9 * th[:-1]):
            return math.inf
        return ev((tuple(float(v) for v in th),) * N)

    xs, val, _ = _optimise(fun, np.log(np.exp(x0) * 3.0 ** np.arange(levels - 1)), lo, hi)
    return (tuple(float(v) for v in np.exp(np.sort(xs))),) * N, val
