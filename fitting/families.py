"""Constructors of the named phase-type families (rates per second).

Each returns a :class:`overtake.fitting.PhaseType` whose ``structure`` label records the family, so the
JSON says what was fitted and AIC/BIC count the right number of parameters.

* ``exponential(rate)``, ``erlang(k, rate)``;
* ``hyperexponential(probs, rates)``, ``hyper_erlang(probs, shapes, rates)`` (the G-FIT family,
  Thümmler, Buchholz & Telek 2006);
* ``coxian(rates, cont)``: phase i continues to i+1 with probability ``cont[i]``;
* ``cf1(alpha, rates)``: acyclic canonical form 1 (Cumani 1982): phase i moves to i+1 at rate
  ``rates[i]``, the last phase exits, rates ascending. Every acyclic PH of order p has a CF1
  representation of order p; :func:`to_cf1` computes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from .errors import InvalidParameterError
from .phase_type import PhaseType

__all__ = ["cf1", "coxian", "erlang", "exponential", "hyper_erlang", "hyperexponential", "to_cf1"]


def _rates(name: str, rates: npt.ArrayLike) -> npt.NDArray[np.float64]:
    r = np.atleast_1d(np.asarray(rates, dtype=np.float64))
    if r.ndim != 1 or r.size == 0:
        raise InvalidParameterError(f"{name} must be a non-empty 1-D sequence, got shape {r.shape}")
    for i, v in enumerate(r):
        if not (np.isfinite(v) and v > 0):
            raise InvalidParameterError(f"{name}[{i}] must be a finite rate > 0 (per second), got {v}")
    return r


def _probs(name: str, probs: npt.ArrayLike, size: int) -> npt.NDArray[np.float64]:
    p = np.atleast_1d(np.asarray(probs, dtype=np.float64))
    if p.shape != (size,):
        raise InvalidParameterError(f"{name} must have length {size}, got shape {p.shape}")
    for i, v in enumerate(p):
        if not (np.isfinite(v) and 0 <= v <= 1):
            raise InvalidParameterError(f"{name}[{i}] must be a probability in [0, 1], got {v}")
    return p


def exponential(rate: float) -> PhaseType:
    """Exponential distribution with ``rate`` per second (mean ``1/rate``)."""
    r = _rates("rate", rate)
    return PhaseType([1.0], [[-r[0]]], structure="exponential")


def erlang(k: int, rate: float) -> PhaseType:
    """Erlang distribution: ``k`` exponential phases in series, each with ``rate`` (mean ``k/rate``)."""
    if int(k) != k or k < 1:
        raise InvalidParameterError(f"k must be an integer >= 1, got {k!r}")
    r = _rates("rate", rate)[0]
    k = int(k)
    T = np.diag(np.full(k, -r)) + np.diag(np.full(k - 1, r), 1)
    alpha = np.zeros(k)
    alpha[0] = 1.0
    return PhaseType(alpha, T, structure="erlang")


def hyperexponential(probs: npt.ArrayLike, rates: npt.ArrayLike) -> PhaseType:
    """Mixture of exponentials: with probability ``probs[i]`` an Exp(``rates[i]``)."""
    r = _rates("rates", rates)
    p = _probs("probs", probs, r.size)
    return PhaseType(p, np.diag(-r), structure="hyperexponential")


def hyper_erlang(probs: npt.ArrayLike, shapes: Sequence[int], rates: npt.ArrayLike) -> PhaseType:
    """Mixture of Erlangs: with probability ``probs[m]`` an Erlang(``shapes[m]``, ``rates[m]``).

    Phases are laid out branch after branch; branch m enters at its first phase.
    """
    r = _rates("rates", rates)
    p = _probs("probs", probs, r.size)
    sh = np.asarray(shapes)
    if sh.shape != r.shape:
        raise InvalidParameterError(f"shapes must have length {r.size}, got shape {sh.shape}")
    for i, v in enumerate(sh):
        if int(v) != v or v < 1:
            raise InvalidParameterError(f"shapes[{i}] must be an integer >= 1, got {v!r}")
    order = int(sh.sum())
    T = np.zeros((order, order))
    alpha = np.zeros(order)
    start = 0
    for m, (k, lam) in enumerate(zip(sh.astype(int), r)):
        alpha[start] = p[m]
        for i in range(start, start + k):
            T[i, i] = -lam
            if i + 1 < start + k:
                T[i, i + 1] = lam
        start += k
    return PhaseType(alpha, T, structure="hypererlang")


def coxian(rates: npt.ArrayLike, cont: npt.ArrayLike) -> PhaseType:
    """Coxian distribution: start in phase 0; phase i (rate ``rates[i]``) continues to i+1
    with probability ``cont[i]`` and exits otherwise; the last phase always exits."""
    r = _rates("rates", rates)
    c = _probs("cont", cont, r.size - 1)
    p = r.size
    T = np.diag(-r)
    for i in range(p - 1):
        T[i, i + 1] = r[i] * c[i]
    alpha = np.zeros(p)
    alpha[0] = 1.0
    return PhaseType(alpha, T, structure="coxian")


def cf1(alpha: npt.ArrayLike, rates: npt.ArrayLike) -> PhaseType:
    """Acyclic canonical form 1 (Cumani 1982).

    Parameters
    ----------
    alpha : array_like, shape (p,)
        Entry probabilities; entering phase i means passing phases i..p-1 in series.
    rates : array_like, shape (p,)
        Phase rates per second, ascending (the canonical order).
    """
    r = _rates("rates", rates)
    a = _probs("alpha", alpha, r.size)
    if np.any(np.diff(r) < -1e-12 * r[1:]):
        raise InvalidParameterError(f"rates must be ascending in CF1, got {r.tolist()}")
    return PhaseType(a, _bidiag(r), structure="cf1")


def _bidiag(rates: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    return np.diag(-rates) + np.diag(rates[:-1], 1)


def sort_cf1(
    alpha: npt.NDArray[np.float64], rates: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Reorder a bidiagonal chain to ascending rates without changing the distribution.

    Swapping adjacent phases with rates ``a > b`` (a first) uses
    ``Exp(b) = (b/a) Exp(a) - ((b-a)/a) Exp(a)*Exp(b)`` (Cumani 1982; mapfit's ``cf1.sort``):
    the entry probabilities become ``x' = x + y (a-b)/a``, ``y' = y b/a``, both non-negative.
    """
    a = alpha.astype(np.float64).copy()
    r = rates.astype(np.float64).copy()
    p = r.size
    for _ in range(p):
        swapped = False
        for i in range(p - 1):
            if r[i] > r[i + 1]:
                ra, rb = r[i], r[i + 1]
                x, y = a[i], a[i + 1]
                a[i] = x + y * (ra - rb) / ra
                a[i + 1] = y * rb / ra
                r[i], r[i + 1] = rb, ra
                swapped = True
        if not swapped:
            break
    return a, r


def to_cf1(ph: PhaseType) -> PhaseType:
    """CF1 representation of an acyclic phase-type distribution (same order, same law).

    The rates are the (sorted) diagonal of T; the entry vector solves the Markov-parameter
    equations ``alpha' B^k b = alpha T^k t`` for ``k = 0..p-1``. Tiny negative entries from
    round-off are clipped.

    Raises
    ------
    InvalidParameterError
        If ``ph`` is not acyclic (T not permutable to upper triangular).
    """
    T = ph.T
    p = ph.order
    order = _topological(T)
    if order is None:
        raise InvalidParameterError("to_cf1 needs an acyclic PH (T permutable to upper triangular)")
    rates = np.sort(-np.diag(T))
    B = _bidiag(rates)
    b = np.zeros(p)
    b[-1] = rates[-1]
    scale = rates.max()
    # scaled Markov parameters keep the system well conditioned for moderate p
    KB = np.empty((p, p))
    KT = np.empty(p)
    vb = b / scale
    vt = ph.exit_rates / scale
    for k in range(p):
        KB[:, k] = vb
        KT[k] = ph.alpha @ vt
        vb = B @ vb / scale
        vt = T @ vt / scale
    a = np.linalg.solve(KB.T, KT)
    a = np.clip(a, 0.0, None)
    if a.sum() > 0:
        a *= ph.alpha.sum() / a.sum()
    return PhaseType(a, B, structure="cf1")


def _topological(T: npt.NDArray[np.float64]) -> list[int] | None:
    p = T.shape[0]
    off = (T > 0) & ~np.eye(p, dtype=bool)
    indeg = off.sum(axis=0)
    ready = [i for i in range(p) if indeg[i] == 0]
    out: list[int] = []
    while ready:
        i = ready.pop()
        out.append(i)
        for j in np.flatnonzero(off[i]):
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.append(int(j))
    return out if len(out) == p else None
