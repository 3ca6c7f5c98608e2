"""E-step of the Asmussen–Nerman–Olsson EM over :class:`overtake.fitting.data.Observations`.

Sufficient statistics (Asmussen, Nerman & Olsson, Scand. J. Statist. 23 (1996), §3.1; right
and interval censoring as in Olsson (1996)): with ``H = sum_k c_k int_0^{x_k}
e^{T(x_k-u)} v_k alpha e^{Tu} du`` (``v_k = t`` for exact points, ``1`` for survival terms)

* ``B_i = sum_k c_k alpha_i (e^{T x_k} v_k)_i`` (initial phase),
* ``Z_i = H_ii`` (time in phase i), ``N_ij = T_ij H_ji`` (jumps i -> j),
* ``N_i = t_i sum_k c_k (alpha e^{T x_k})_i`` (exits), for exact points.

Survival terms use the full-path statistics ``E[S 1{X > c}]``, which add the expected future
``a(c) (-T)^{-1}`` after the censoring time; an interval ``(l, u]`` is the difference of two
survival terms. Everything is computed by :mod:`overtake.fitting._uniformization` in one forward and
one backward sweep over the sorted grid; :func:`estep_reference` is the slow pure-numpy
(Van Loan matrix exponential) version the tests compare against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from . import _kernels as _u
from .data import Observations

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

TINY = 1e-300


@dataclass(frozen=True)
class Sparse:
    """Sub-generator in edge form: ``T = diag(diag) + sum_e rate_e E_{src_e, dst_e}``."""

    alpha: FloatArray
    diag: FloatArray
    src: IntArray
    dst: IntArray
    rate: FloatArray
    exitv: FloatArray

    @property
    def is_chain(self) -> bool:
        """Bidiagonal T (CF1, Coxian, hyper-Erlang): use the faster chain kernels."""
        return bool(np.all(self.dst == self.src + 1))

    def dense(self) -> FloatArray:
        T = np.diag(self.diag).astype(np.float64)
        np.add.at(T, (self.src, self.dst), self.rate)
        return T


@dataclass(frozen=True)
class Stats:
    """Expected sufficient statistics and the log-likelihood of the current parameters."""

    loglik: float
    B: FloatArray
    Z: FloatArray
    N: FloatArray  # per edge
    E: FloatArray  # exits per phase


def _fit_grid(obs: Observations, q: float) -> Observations:
    if obs.grid.size > 1 and q * float(np.max(obs.dt)) > _u.MAX_STEP:
        return obs.refined(2.0 ** math.floor(math.log2(_u.MAX_STEP / q)))
    return obs


def loglik_only(s: Sparse, obs: Observations) -> float:
    """Log-likelihood of ``obs`` (forward sweep only)."""
    q = float(np.max(-s.diag))
    obs = _fit_grid(obs, q)
    A, logs, _ = _u.forward(s.alpha, s.diag, s.src, s.dst, s.rate, s.exitv, q, obs.dt, False, _u.EM_POISSON_EPS)
    ll, _, _ = _coefficients(A, logs, s.exitv, obs)
    return ll


def _coefficients(A: FloatArray, logs: FloatArray, exitv: FloatArray, obs: Observations) -> tuple[float, FloatArray, FloatArray]:
    G = logs.size
    coef_p = np.zeros(G)
    coef_s = np.zeros(G)
    ll = 0.0
    if obs.point_idx.size:
        f = np.maximum(A[obs.point_idx] @ exitv, TINY)
        ll += float(obs.point_w @ (logs[obs.point_idx] + np.log(f)))
        coef_p[obs.point_idx] = obs.point_w / f
    if obs.cens_idx.size:
        ll += float(obs.cens_w @ logs[obs.cens_idx])
        coef_s[obs.cens_idx] += obs.cens_w
    if obs.int_w.size:
        lo, hi, w = obs.lo_idx, obs.hi_idx, obs.int_w
        r = np.where(hi >= 0, np.exp(np.minimum(logs[hi] - logs[lo], 0.0)), 0.0)
        d = np.maximum(1.0 - r, TINY)
        ll += float(w @ (logs[lo] + np.log(d)))
        np.add.at(coef_s, lo, w / d)
        fin = hi >= 0
        np.add.at(coef_s, hi[fin], -(w * r / d)[fin])
    return ll, coef_p, coef_s


def squaring_from(p: int) -> float:
    """The ``q dt`` above which a chain's gap is done by squaring rather than by its Poisson series.

    Per Poisson term the series costs a few vector steps (``~8 p`` flops over both sweeps); the
    squaring path ``~3 p^3`` flops per squaring, ``log2(2 q dt)`` of them: they break even near
    ``q dt ~ 2 p^2``."""
    return min(max(16.0, 2.0 * p * p), _u.MAX_STEP)


def estep(s: Sparse, obs: Observations, q_factor: float = 1.01, squaring: bool = True) -> Stats:
    """Sufficient statistics by uniformization over the sorted grid (numba). ``squaring=False``: every
    gap of a chain by its Poisson series (the tests' cross-check of the squaring path)."""
    q = float(np.max(-s.diag)) * q_factor
    eps = _u.EM_POISSON_EPS
    if not (s.is_chain and squaring):
        obs = _fit_grid(obs, q)  # a chain's long gaps are squared on a shifted generator: no refinement
    if s.is_chain:
        u = np.zeros(max(s.alpha.size - 1, 0))
        u[s.src] = s.rate
        big = squaring_from(s.alpha.size) if squaring else math.inf
        A, logs = _u.forward_chain(s.alpha, s.diag, u, q, obs.dt, eps, big)
        ll, coef_p, coef_s = _coefficients(A, logs, s.exitv, obs)
        beta0, Z, Nc = _u.backward_chain(s.alpha, s.diag, u, s.exitv, q, obs.dt, A, logs, coef_p, coef_s, eps, big)
        Nh = Nc[s.src]
    else:
        A, logs, _ = _u.forward(s.alpha, s.diag, s.src, s.dst, s.rate, s.exitv, q, obs.dt, False, eps)
        ll, coef_p, coef_s = _coefficients(A, logs, s.exitv, obs)
        beta0, Z, Nh = _u.backward(s.alpha, s.diag, s.src, s.dst, s.rate, s.exitv, q, obs.dt, A, logs, coef_p, coef_s, eps)
    B = A[0] * beta0
    exits = coef_p @ A
    if np.any(coef_s != 0):
        gamma = coef_s @ A
        post = np.linalg.solve(-s.dense().T, gamma)  # a(c) (-T)^{-1}, summed over survival terms
        Z = Z + post
        Nh = Nh + post[s.src]
        exits = exits + post
    return Stats(ll, B, Z, s.rate * Nh, s.exitv * exits)


def estep_reference(
    alpha: FloatArray, T: FloatArray, obs: Observations
) -> tuple[float, FloatArray, FloatArray, FloatArray, FloatArray]:
    """Pure numpy/scipy E-step, one Van Loan block exponential per record (slow; for tests).

    Returns ``(loglik, B, Z, N (dense p x p), E)``.
    """
    from scipy.linalg import expm  # here only: a fit does not pay for scipy's import

    p = alpha.size
    t = -T.sum(axis=1)
    one = np.ones(p)
    acc = _ReferenceSums(p)
    inv = np.linalg.inv(-T)

    def block(x: float, v: FloatArray) -> tuple[FloatArray, FloatArray, FloatArray]:
        # Van Loan: the upper right block of exp([[T, v α], [0, T]] x) is ∫₀ˣ e^{Ts} v α e^{T(x−s)} ds
        M = np.zeros((2 * p, 2 * p))
        M[:p, :p] = T
        M[:p, p:] = np.outer(v, alpha)
        M[p:, p:] = T
        E = expm(M * x)
        eT = E[:p, :p]
        return eT, E[:p, p:], alpha @ eT

    g = obs.grid
    for i, w in zip(obs.point_idx, obs.point_w):  # exact: the density α e^{Tx} t
        eT, H, a = block(g[i], t)
        acc.add(w, float(a @ t), alpha, eT @ t, H)
        acc.Es += w / (a @ t) * t * a
    for i, w in zip(obs.cens_idx, obs.cens_w):  # censored: the survival α e^{Tx} 1
        eT, H, a = block(g[i], one)
        acc.add(w, float(a @ one), alpha, eT @ one, H)
        acc.futures += w / (a @ one) * (a @ inv)
    for lo, hi, w in zip(obs.lo_idx, obs.hi_idx, obs.int_w):  # binned: the survivals' difference
        eTl, Hl, al = block(g[lo], one)
        eTu, Hu, au = block(g[hi], one) if hi >= 0 else (np.zeros((p, p)), np.zeros((p, p)), np.zeros(p))
        P = al @ one - au @ one
        acc.add(w, float(P), alpha, (eTl - eTu) @ one, Hl - Hu)
        acc.futures += w / P * ((al - au) @ inv)
    return acc.result(T, t)


class _ReferenceSums:
    """The reference E-step's sums over the records: log-likelihood, initial-phase weights B, the
    Van Loan blocks' sum H, exit weights E and the expected time still to come (censored and
    binned records)."""

    def __init__(self, p: int) -> None:
        self.ll = 0.0
        self.Bs = np.zeros(p)
        self.Hs = np.zeros((p, p))
        self.Es = np.zeros(p)
        self.futures = np.zeros(p)

    def add(self, w: float, like: float, alpha: FloatArray, surv: FloatArray, H: FloatArray) -> None:
        """One record of weight ``w`` and likelihood ``like``: its terms, each over ``like``
        (``surv``: e^{Tx} applied to the record's end vector)."""
        self.ll += w * np.log(like)
        self.Bs += w / like * alpha * surv
        self.Hs += w / like * H

    def result(self, T: FloatArray, t: FloatArray) -> tuple[float, FloatArray, FloatArray, FloatArray, FloatArray]:
        """``(loglik, B, Z, N, E)`` from the sums."""
        Z = np.diag(self.Hs) + self.futures
        N = T * (self.Hs.T + self.futures[:, None])
        np.fill_diagonal(N, 0.0)
        E = self.Es + t * self.futures
        return self.ll, self.Bs, Z, N, E
