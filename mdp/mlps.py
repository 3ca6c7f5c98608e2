"""Exact mean response times of one M/G/1 whose CPU is shared by priority levels.

The analysis is for strict priority (the limit of level weights w → 0) and phase-type service.
Multilevel processor sharing (MLPS; Kleinrock, *Queueing Systems* vol. 2, §4.7; Aalto, Ayesta
and Nyberg-Oksanen, *Two-level processor-sharing scheduling disciplines: mean delay analysis*,
SIGMETRICS 2004). Write X_a = min(S, a), ρ_a = λE[X_a], m₂(a) = E[X_a²]. A job of size x in a
level spanning attained service (A, A + B]:

* waits until all work below A is done (priority by attained service makes that work an M/G/1
  with service X_A): the first-service epoch of the level is, in mean,

  .. math:: T_A = \\frac{A + λm₂(A)/(2(1-ρ_A))}{1-ρ_A}   \\quad(= T_{FB}(A)),

* then shares the level with PS while every new arrival interrupts it with a busy period of
  below-A work, so one unit of level time costs 1/(1 − ρ_A) of real time, and
  E[T(x)] = T_A + F(x − A)/(1 − ρ_A) with F(τ) = ∫₀^τ f.

Seen on the level's own clock this is an M^X/G/1-PS queue (jobs cross A in batches), whose
attained-service density f solves the integral equation of Kleinrock, Muntz and Rodemich (*The
processor-sharing queueing model for time-shared systems with bulk arrivals*, Networks 1971):

.. math:: f(τ) = 1 + ν'\\Big[\\int_0^{B-τ} f(y)Ḡ(y+τ)\\,dy + \\int_0^τ f(u)Ḡ(τ-u)\\,du\\Big] + βḠ(τ),

with Ḡ(y) = P(S > A + y | S > A) on [0, B), ν' = λP(S > A)/(1 − ρ_A) the level's arrival rate per
unit of level time, and β = 2λP(S > A)·T_A the mean number of other jobs that start the level
with the tagged one (those already waiting at age A when it arrives plus those reaching A
during its wait, each λP(S > A)·T_A by PASTA). The first level has T_A = β = 0 and the constant
solution f = 1/(1 − ρ_B): E[T(x)] = x/(1 − ρ_{a_1}) (M/G/1-PS with truncated service). With one
level the whole thing is M/G/1-PS, E[T] = E[S]/(1 − ρ); with ever thinner levels it tends to
least-attained-service (FB, Schrage 1967; Kleinrock vol. 2 eq. 4.61):

.. math:: E[T_{FB}(x)] = \\frac{x(1-ρ_x) + λm₂(x)/2}{(1-ρ_x)^2}.

Several job classes (each its own Poisson stream and PH, a starting class and thresholds) follow
the same argument with the level's batch mixing the classes; class priority ("known-phase
short-first": classes by the start phase) is the case without thresholds. :func:`mlps_mean`
solves f by Nyström (trapezoid, FFT convolutions, GMRES) with Richardson extrapolation.

Also here: M/G/1-PS (:func:`ps_mean`), FB (:func:`fb_mean`) and M/M/1 discriminatory processor
sharing at finite weights (:func:`dps_means`), the yardsticks of the threshold search.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from scipy import fft as sp_fft
from scipy.linalg import expm

from .errors import ModelError

__all__ = [
    "EXACT", "SEARCH", "Accuracy", "JobClass", "PHInput", "PHLike", "PHMoments", "as_ph", "dps_means", "fb_mean",
    "fb_response", "mlps_classes_mean", "mlps_mean", "mlps_response", "ps_mean",
]

FloatArray = npt.NDArray[np.float64]


class PHLike(Protocol):
    """Anything with a PH representation: ``alpha`` (row) and ``T`` (sub-generator)."""

    @property
    def alpha(self) -> FloatArray: ...

    @property
    def T(self) -> FloatArray: ...


@dataclass(frozen=True)
class JobClass:
    """One Poisson stream of an M/G/1 with priority levels.

    ``arrival_rate`` λ_c; PH(``alpha``, ``T``) service; ``start_level`` its class floor;
    ``thresholds`` its L − 1 attained-service thresholds (``inf`` = never demoted further).
    """

    arrival_rate: float
    alpha: FloatArray
    T: FloatArray
    start_level: int = 0
    thresholds: tuple[float, ...] = ()


def _expm(T: FloatArray, x: float) -> FloatArray:
    """e^{Tx}; elementwise for a diagonal T (hyperexponential and exponential stages: phases that
    never move), where scipy's Padé approximant would cost a hundred times more for the same matrix."""
    d = np.diag(T)
    if np.count_nonzero(T - np.diag(d)) == 0:
        return np.diag(np.exp(d * x))
    return np.asarray(expm(T * x), dtype=float)


def _row_powers(start: FloatArray, E: FloatArray, K: int) -> FloatArray:
    """The K rows start·E^k, k = 0, …, K − 1, by doubling: log₂K products of blocks instead of K
    products of one row (the sequential loop dominated the level solver's time)."""
    rows = np.empty((K, start.size))
    rows[0] = start
    have, P = 1, E  # rows[:have] are done; P = E^have
    while have < K:
        take = min(have, K - have)
        rows[have:have + take] = rows[:take] @ P
        have += take
        if have < K:
            P = P @ P
    return rows


class PHMoments:
    """Truncated moments and survival function of PH(α, T) (all closed forms, expm)."""

    def __init__(self, alpha: FloatArray, T: FloatArray) -> None:
        self.alpha = np.asarray(alpha, dtype=float)
        self.T = np.asarray(T, dtype=float)
        self.M = self.alpha.size
        self.one = np.ones(self.M)
        self.u1 = np.linalg.solve(-self.T, self.one)  # (−T)⁻¹1
        self.mean = float(self.alpha @ self.u1)
        self.m2 = float(2.0 * self.alpha @ np.linalg.solve(-self.T, self.u1))
        self.rates = -np.diag(self.T)

    def row(self, x: float) -> FloatArray:
        return np.asarray(self.alpha @ _expm(self.T, x), dtype=float) if x > 0 else self.alpha.copy()

    def sf(self, x: float) -> float:
        if math.isinf(x):
            return 0.0
        return float(self.row(x) @ self.one)

    def trunc(self, x: float) -> tuple[float, float]:
        """(E[min(S, x)], E[min(S, x)²])."""
        if math.isinf(x):
            return self.mean, self.m2
        if x <= 0:
            return 0.0, 0.0
        E = _expm(self.T, x)
        I = np.eye(self.M)
        A1 = np.linalg.solve(self.T, E - I)            # ∫₀ˣ e^{Tu} du
        A2 = np.linalg.solve(self.T, x * E - A1)       # ∫₀ˣ u e^{Tu} du
        return float(self.alpha @ A1 @ self.one), float(2.0 * self.alpha @ A2 @ self.one)

    def horizon(self, start: FloatArray, tol: float = 1e-11) -> float:
        """A y with P(S > y | start row) below ``tol`` (doubling search)."""
        row0 = start / max(float(start @ self.one), 1e-300)

        def tail(y: float) -> float:
            return float(row0 @ _expm(self.T, y) @ self.one)

        y = max(1.0 / float(self.rates.max()), 1e-9)
        while tail(y) > tol and y < 1e12:
            y *= 2.0
        lo = y / 2
        for _ in range(6):  # bisection: within 1/64 of the doubling step
            mid = 0.5 * (lo + y)
            if tail(mid) > tol:
                lo = mid
            else:
                y = mid
        return y


PHInput = PHLike | tuple[FloatArray, FloatArray]


def as_ph(ph: PHInput) -> tuple[FloatArray, FloatArray]:
    if isinstance(ph, tuple):
        return np.asarray(ph[0], dtype=float), np.asarray(ph[1], dtype=float)
    return np.asarray(ph.alpha, dtype=float), np.asarray(ph.T, dtype=float)


def ps_mean(ph: PHInput, arrival_rate: float) -> float:
    """M/G/1-PS: E[T] = E[S]/(1 − ρ)."""
    p = PHMoments(*as_ph(ph))
    rho = arrival_rate * p.mean
    _stable(rho, "PS")
    return p.mean / (1.0 - rho)


def _stable(rho: float, what: str) -> None:
    if not rho < 1.0:
        raise ModelError(f"{what}: load {rho:.4g} >= 1, the queue is unstable")


def fb_response(ph: PHInput, arrival_rate: float, x: npt.ArrayLike) -> FloatArray:
    """E[T(x)] under least-attained-service (FB): (x(1−ρ_x) + λm₂(x)/2)/(1−ρ_x)²."""
    p = PHMoments(*as_ph(ph))
    xs = np.atleast_1d(np.asarray(x, dtype=float))
    out = np.empty(xs.size)
    for i, xi in enumerate(xs):
        m1, m2 = p.trunc(float(xi))
        r = arrival_rate * m1
        _stable(r, "FB")
        out[i] = (xi * (1 - r) + arrival_rate * m2 / 2) / (1 - r) ** 2
    return out


def fb_mean(ph: PHInput, arrival_rate: float) -> float:
    """E[T] under FB: ∫ E[T_FB(x)] dF(x) (Gauss–Legendre panels on the PH's scales)."""
    a, T = as_ph(ph)
    p = PHMoments(a, T)
    _stable(arrival_rate * p.mean, "FB")
    hi = p.horizon(a, 1e-13)
    # panels on a log-spaced partition so every phase's scale is resolved
    lo = 0.01 / p.rates.max()
    edges = np.concatenate([[0.0], np.geomspace(lo, hi, 200)])
    xg, wg = np.polynomial.legendre.leggauss(8)
    total = 0.0
    t = -T.sum(axis=1)
    for x0, x1 in itertools.pairwise(edges):
        xs = 0.5 * (x1 - x0) * xg + 0.5 * (x1 + x0)
        dens = np.array([float(p.row(xi) @ t) for xi in xs])
        total += 0.5 * (x1 - x0) * float(np.sum(wg * dens * fb_response((a, T), arrival_rate, xs)))
    return total


@dataclass(frozen=True)
class Accuracy:
    """How finely the level equations are solved: the grid step is at most the fastest phase's
    mean over ``per_mean``; the top level's grid reaches where P(S > y | S > A) falls below
    ``tail`` (the rest of the tail's integral is added in closed form); the fixed-point iteration
    stops at relative change ``tol``."""

    per_mean: float = 4.0
    tail: float = 1e-11
    tol: float = 1e-12


#: The default: the reference answers.
EXACT = Accuracy()
#: For searches over thresholds, which only compare candidates: after Richardson extrapolation
#: two steps per fastest mean still agree with EXACT to about 1e-4 relative on hyperexponential
#: stages, at a tenth of its cost or less.
SEARCH = Accuracy(per_mean=0.5, tail=1e-8, tol=1e-9)


# ---- the level solver --------------------------------------------------------------------------


@dataclass
class _LevelClass:
    c: int                 # class index
    nu: float              # rate of entering the level, λ_c P(S_c > A_c)
    A: float               # attained service at entry
    B: float               # width (inf for the top level)
    TA: float              # mean first-service epoch of the level
    start_row: FloatArray  # α e^{T A}/P(S > A)


def _solve_level(parts: list[_LevelClass], phs: list[PHMoments], rho_below: float, n_target: int,
                 h_max: float, refine: int, accuracy: Accuracy) -> list[tuple[float, FloatArray, FloatArray, float]]:
    """Nyström solution of the coupled KMR equations of one level on a grid of step h.

    Trapezoid rule on a uniform grid; the step is h₀/``refine`` (h₀ from ``n_target`` and
    ``h_max``, so refine = 1, 2 are exactly a factor 2 apart for Richardson extrapolation). The
    Volterra kernel of every class is Σ_j ν'_j Ḡ_j and the Fredholm (Hankel) term is common to
    all classes, so one iteration costs a few real FFTs. The operator is a contraction (norm
    (ρ_{level} − ρ_below)/(1 − ρ_below) < 1), so plain iteration converges geometrically.
    Returns per class (h, f, Ḡ on the grid, ∫ beyond the grid's end of Ḡ).
    """
    h, n = _level_steps(parts, phs, n_target, h_max, refine, accuracy)
    nmax = max(n)
    Lg = 2 * nmax + 1
    G, tail = _survival_grid(parts, phs, n, h, Lg)
    mask = np.zeros((len(parts), nmax + 1), dtype=bool)
    for i in range(len(parts)):
        mask[i, : n[i] + 1] = True
    rhs = np.where(mask, _level_rhs(parts, G, nmax), 0.0)
    apply_K = _level_operator(parts, G, tail, n, h, 1.0 / (1.0 - rho_below), mask)
    f = _fixed_point(rhs, apply_K, accuracy.tol)
    return [(h, f[i, : n[i] + 1], G[i, : n[i] + 1], float(tail[i, n[i]])) for i in range(len(parts))]


def _level_steps(parts: list[_LevelClass], phs: list[PHMoments], n_target: int, h_max: float, refine: int,
                 accuracy: Accuracy) -> tuple[float, list[int]]:
    """The grid step and each class's points in the level: a finite level's width must be a whole
    number of steps (one width for all: the classes share one grid), the top level reaches each
    class's horizon (where its survival falls below ``accuracy.tail``)."""
    finite = sorted({p.B for p in parts if math.isfinite(p.B)})
    if len(finite) > 1 and any(abs(b - finite[0]) > 1e-9 * finite[0] for b in finite):
        raise ModelError("exact analysis: classes sharing a middle level must have equal level widths "
                         f"(got {finite}); use the simulator")
    hor = [p.B if math.isfinite(p.B) else phs[p.c].horizon(p.start_row, accuracy.tail) for p in parts]
    span = max(hor)
    h0 = min(span / n_target, h_max)
    if finite:
        h0 = finite[0] / max(1, math.ceil(finite[0] / h0))
    return h0 / refine, [max(1, round(x / h0)) * refine for x in hor]


def _level_rhs(parts: list[_LevelClass], G: FloatArray, nmax: int) -> FloatArray:
    """The equations' free term per class: 1 plus the jobs that start the level with the tagged one,
    β_ij = ν_j (T_A,i + T_A,j), each served through Ḡ_j."""
    TA = np.array([p.TA for p in parts])
    nu = np.array([p.nu for p in parts])
    rhs = np.zeros((len(parts), nmax + 1))
    for i in range(len(parts)):
        rhs[i] = 1.0 + ((nu * (TA[i] + TA)) @ G)[: nmax + 1]
    return rhs


def _level_operator(parts: list[_LevelClass], G: FloatArray, tail: FloatArray, n: list[int], h: float,
                    one_m: float, mask: npt.NDArray[np.bool_]) -> Callable[[FloatArray], FloatArray]:
    """The level equations' integral operator K (f = rhs + K f) on the grid, by real FFTs: a
    Volterra part per class and a Hankel part common to all, the trapezoid's end corrections and,
    for the top level, the tail beyond the grid in closed form."""
    nmax = max(n)
    Lg = 2 * nmax + 1
    mu = np.array([p.nu * one_m for p in parts])
    # circular convolutions of length Lg = 2·nmax + 1 are free of wrap-around on every index used:
    # the Volterra sum needs f ∗ Σ_j ν'_j Ḡ_j only up to nmax (the kernel cut there), the Hankel
    # sum reads the correlation at nmax..2·nmax, out of reach of the aliased tail (beyond 3·nmax)
    nfft = sp_fft.next_fast_len(Lg, real=True)
    # Volterra: class i sees new arrivals of every class j, kernel Σ_j ν'_j Ḡ_j
    gsum = mu @ G
    F_vol = sp_fft.rfft(gsum[: nmax + 1], nfft)
    # Hankel: Σ_m f_j[m] Ḡ_j[i + m]; correlation via the reversed kernel
    F_han = sp_fft.rfft(G[:, ::-1], nfft, axis=1)
    idx = np.arange(nmax + 1)

    def apply_K(f: FloatArray) -> FloatArray:
        # Hankel part, common to all classes: Σ_j ν'_j ∫ f_j(y) Ḡ_j(y + τ) dy
        Ff = sp_fft.rfft(f, nfft, axis=1)
        corr = sp_fft.irfft(Ff * F_han, nfft, axis=1)  # corr[j, k] = Σ_m f_j[m] Ḡ_j[Lg − 1 − k + m]
        han = np.zeros(nmax + 1)
        for j, p in enumerate(parts):
            nj = n[j]
            hj = corr[j, Lg - 1 - idx] - 0.5 * f[j, 0] * G[j, idx]
            if math.isfinite(p.B):
                last = np.clip(nj - idx, 0, nj)
                hj = np.where(idx <= nj, hj - 0.5 * f[j, last] * G[j, nj], 0.0)
            else:
                hj = hj - 0.5 * f[j, nj] * G[j, idx + nj] + f[j, nj] * tail[j, idx + nj] / h
            han += mu[j] * hj
        # Volterra part per class: ∫₀^τ f_i(u) Σ_j ν'_j Ḡ_j(τ − u) du
        vol = sp_fft.irfft(Ff * F_vol, nfft, axis=1)[:, : nmax + 1]
        vol = vol - 0.5 * f[:, :1] * gsum[None, : nmax + 1] - 0.5 * f * gsum[0]
        vol[:, 0] = 0.0
        return np.where(mask, h * (vol + han[None, :]), 0.0)

    return apply_K


def _survival_grid(parts: list[_LevelClass], phs: list[PHMoments], n: list[int], h: float,
                   Lg: int) -> tuple[FloatArray, FloatArray]:
    """Per class on the grid of step h: Ḡ, the survival in the level from its entry, and for the
    top level the integral beyond each grid point (zero elsewhere)."""
    C = len(parts)
    G = np.zeros((C, Lg))
    tail = np.zeros((C, Lg))
    for c, p in enumerate(parts):
        ph = phs[p.c]
        K = (n[c] + 1) if math.isfinite(p.B) else Lg
        rows = _row_powers(np.asarray(p.start_row, dtype=float), _expm(ph.T, h), K)
        G[c, :K] = rows @ ph.one
        if not math.isfinite(p.B):
            tail[c] = rows @ ph.u1
    return G, tail


def _fixed_point(rhs: FloatArray, apply_K: Callable[[FloatArray], FloatArray], tol: float) -> FloatArray:
    """f = rhs + K f by plain iteration (K is a contraction), to a relative change of ``tol``."""
    f = rhs.copy()
    for _ in range(100_000):
        new = rhs + apply_K(f)
        if np.max(np.abs(new - f)) <= tol * np.max(np.abs(new)):
            return new
        f = new
    raise ModelError("exact analysis: the level equation did not converge")  # pragma: no cover - a contraction


def _level_entry(jc: JobClass, level: int) -> tuple[float, float] | None:
    """(A, B) of class jc in ``level``, or None if it never visits it."""
    if level < jc.start_level:
        return None
    A = 0.0 if level == jc.start_level else jc.thresholds[level - 1]
    if math.isinf(A):
        return None
    top = jc.thresholds[level] if level < len(jc.thresholds) else math.inf
    return A, top - A


def _class_means(classes: Sequence[JobClass], n_grid: int, refine: int,
                 accuracy: Accuracy = EXACT) -> tuple[list[float], list[list[Any]]]:
    """Per-class E[T] (and the per-level pieces) for one grid resolution."""
    cls, phs = _padded_classes(classes)
    means = [0.0] * len(cls)
    pieces: list[list[Any]] = [[] for _ in cls]
    h_max = min(1.0 / p.rates.max() for p in phs) / accuracy.per_mean
    for level in range(len(cls[0].thresholds) + 1):
        parts, rho_b = _level_parts(cls, phs, level)
        if not parts:
            continue
        if rho_b == 0.0 and all(p.TA == 0.0 for p in parts):
            for c, val in _ps_level(parts, phs):
                means[c] += val
                pieces[c].append(("ps", level, val))
            continue
        sols = _solve_level(parts, phs, rho_b, n_grid, h_max, refine, accuracy)
        for pt, sol in zip(parts, sols):
            means[pt.c] += _level_mean(pt, phs[pt.c], sol, rho_b)
            pieces[pt.c].append((level, pt.TA, sol[0], sol[1]))
    return means, pieces


def _padded_classes(classes: Sequence[JobClass]) -> tuple[list[JobClass], list[PHMoments]]:
    """The classes with one threshold per level boundary (none given: never demoted, thresholds at
    infinity) and their service laws' moments; the system checked stable."""
    L = max([c.start_level + 1 for c in classes] + [len(c.thresholds) + 1 for c in classes])
    phs = [PHMoments(c.alpha, c.T) for c in classes]
    for c in classes:
        if len(c.thresholds) not in (0, L - 1):
            raise ModelError(f"exact analysis: every class needs {L - 1} thresholds, got {c.thresholds}")
    cls = [JobClass(c.arrival_rate, c.alpha, c.T, c.start_level,
                    tuple(c.thresholds) if c.thresholds else (math.inf,) * (L - 1)) for c in classes]
    total_rho = sum(c.arrival_rate * p.mean for c, p in zip(cls, phs))
    _stable(total_rho, "priority levels")
    return cls, phs


def _level_parts(cls: list[JobClass], phs: list[PHMoments], level: int) -> tuple[list[_LevelClass], float]:
    """The classes that reach ``level`` with their entry into it, and the load of the work below it
    (which preempts the level: its M/G/1 workload delays each entry)."""
    rho_b, m2_b = 0.0, 0.0
    entries: list[tuple[int, float, float]] = []
    for ci, (c, p) in enumerate(zip(cls, phs)):
        below = 0.0 if level <= c.start_level else c.thresholds[level - 1]
        m1, m2 = p.trunc(below)
        rho_b += c.arrival_rate * m1
        m2_b += c.arrival_rate * m2
        e = _level_entry(c, level)
        if e is not None:
            entries.append((ci, e[0], e[1]))
    _stable(rho_b, "priority levels (work below a level)")
    U = m2_b / (2.0 * (1.0 - rho_b))
    parts: list[_LevelClass] = []
    for ci, A, B in entries:
        p = phs[ci]
        sfA = p.sf(A)
        if sfA <= 1e-15:
            continue
        parts.append(_LevelClass(ci, cls[ci].arrival_rate * sfA, A, B, (U + A) / (1.0 - rho_b), p.row(A) / sfA))
    return parts, rho_b


def _ps_level(parts: list[_LevelClass], phs: list[PHMoments]) -> list[tuple[int, float]]:
    """A level with no interrupting work and no batches: M/G/1-PS with truncated service, f
    constant. Each class's mean time in the level, in closed form."""
    rho_l = sum(pt.nu * (phs[pt.c].trunc(pt.A + pt.B)[0] - phs[pt.c].trunc(pt.A)[0]) / 1.0 for pt in parts)
    _stable(rho_l, "priority levels (first level)")
    out = []
    for pt in parts:
        p = phs[pt.c]
        # ∫_A^{A+B} (x − A) dF = E[min(S, A+B)] − A·P(S>A) − B·P(S>A+B) over classes with A = 0
        part = (p.trunc(pt.A + pt.B)[0] - pt.A * p.sf(pt.A) - (pt.B * p.sf(pt.A + pt.B) if math.isfinite(pt.B)
                                                                else 0.0))
        out.append((pt.c, part / (1.0 - rho_l)))
    return out


def _level_mean(pt: _LevelClass, p: PHMoments, sol: tuple[float, FloatArray, FloatArray, float], rho_b: float) -> float:
    """A class's mean time in a level from the level equations' solution (h, f, Ḡ, tail beyond)."""
    h, f, g, beyond = sol
    sfA = p.sf(pt.A)
    sfAB = p.sf(pt.A + pt.B)
    w = np.full(f.size, h)
    w[0] = w[-1] = h / 2
    # ∫₀^B f(τ) (P(S > A+τ) − P(S > A+B)) dτ, plus f(H)∫_H^∞ P(S > A+τ) dτ beyond the horizon
    level_time = float(np.sum(w * f * (g - sfAB / sfA))) * sfA
    if not math.isfinite(pt.B):
        level_time += float(f[-1]) * beyond * sfA
    return pt.TA * (sfA - sfAB) + level_time / (1.0 - rho_b)


def mlps_classes_mean(classes: Sequence[JobClass], *, grid: int = 256, accuracy: Accuracy = EXACT) -> list[float]:
    """E[T_c] of each class (per job of that class), strict priority, PS in each level.

    Richardson extrapolation of the Nyström solution with ``grid`` and 2·``grid`` points, each
    step at most the fastest phase's mean over ``accuracy.per_mean``.
    """
    if not classes:
        raise ModelError("exact analysis: give at least one job class")
    for c in classes:
        if not c.arrival_rate > 0:
            raise ModelError(f"exact analysis: arrival_rate must be > 0, got {c.arrival_rate}")
    coarse, _ = _class_means(classes, grid, 1, accuracy)
    fine, _ = _class_means(classes, grid, 2, accuracy)
    return [(4.0 * f_m - c_m) / 3.0 for c_m, f_m in zip(coarse, fine)]


def mlps_mean(ph: PHInput, arrival_rate: float, thresholds: Sequence[float], *, grid: int = 256) -> float:
    """E[T] of M/G/1 with PS in each level and strict priority between levels (``thresholds``
    a_1 < a_2 < …; none = PS)."""
    a, T = as_ph(ph)
    th = tuple(float(x) for x in thresholds)
    if any(not x > 0 for x in th) or any(y <= x for x, y in itertools.pairwise(th)):
        raise ModelError(f"thresholds must be > 0 and increasing, got {th}")
    return mlps_classes_mean([JobClass(arrival_rate, a, T, 0, th)], grid=grid)[0]


def mlps_response(ph: PHInput, arrival_rate: float, thresholds: Sequence[float], x: npt.ArrayLike, *,
                  grid: int = 8192) -> FloatArray:
    """E[T(x)] of the same M/G/1 (one grid; linear interpolation of F inside a level)."""
    a, T = as_ph(ph)
    th = tuple(float(v) for v in thresholds)
    jc = JobClass(arrival_rate, a, T, 0, th)
    _, pieces = _class_means([jc], grid, 1)
    p = PHMoments(a, T)
    rho_a = [arrival_rate * p.trunc(v)[0] for v in th]
    xs = np.atleast_1d(np.asarray(x, dtype=float))
    out = np.empty(xs.size)
    edges = (0.0,) + th + (math.inf,)
    lvl_of = np.searchsorted(np.asarray(th), xs, side="left")  # level of a job of size x
    for lvl in range(len(edges) - 1):
        sel = lvl_of == lvl
        if not np.any(sel):
            continue
        if lvl == 0:
            out[sel] = xs[sel] / (1.0 - arrival_rate * p.trunc(edges[1])[0])
            continue
        _, TA, h, f = next(pc for pc in pieces[0] if pc[0] == lvl)
        F = np.concatenate([[0.0], np.cumsum(0.5 * h * (f[1:] + f[:-1]))])
        Fv = np.interp(xs[sel] - edges[lvl], np.arange(f.size) * h, F)
        out[sel] = TA + Fv / (1.0 - rho_a[lvl - 1])
    return out


def dps_means(arrival_rates: Sequence[float], service_rates: Sequence[float],
              weights: Sequence[float]) -> FloatArray:
    r"""Mean response time per class of M/M/1 discriminatory processor sharing (finite weights).

    Class k (Poisson λ_k, Exp(μ_k) service) gets the share g_k/Σ_j n_j g_j of the CPU per job;
    Fayolle, Mitrani and Iasnogorodski (*Sharing a processor among many job classes*, JACM 1980)
    give the linear system

    .. math:: T_k\Big(1-\sum_j \frac{λ_j g_j}{μ_j g_j+μ_k g_k}\Big)
              - \sum_j \frac{λ_j g_j T_j}{μ_j g_j+μ_k g_k} = \frac{1}{μ_k}.

    It is the exact answer for class priority when each class is exponential (an H2 split by
    its start phase) at the levels' real weights.
    """
    lam = np.asarray(arrival_rates, dtype=float)
    mu = np.asarray(service_rates, dtype=float)
    g = np.asarray(weights, dtype=float)
    if not (lam.shape == mu.shape == g.shape) or lam.ndim != 1:
        raise ModelError("dps_means: arrival_rates, service_rates and weights need one entry per class")
    _stable(float(np.sum(lam / mu)), "DPS")
    den = mu[None, :] * g[None, :] + mu[:, None] * g[:, None]  # [k, j] = μ_j g_j + μ_k g_k
    c = lam[None, :] * g[None, :] / den
    A = np.diag(1.0 - c.sum(axis=1)) - c
    return np.asarray(np.linalg.solve(A, 1.0 / mu), dtype=float)
