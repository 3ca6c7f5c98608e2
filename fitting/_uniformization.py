"""Uniformization kernels over a sorted time grid (numba).

A phase-type representation is passed in sparse form so one kernel serves every structure:
``diag`` (the diagonal of T), edges ``src -> dst`` with ``rate`` (the non-zero off-diagonal
entries of T) and ``exitv`` (t = -T 1).  With ``q >= max(-diag)`` and ``P = I + T/q``,

.. math:: e^{T\\Delta} = \\sum_{m \\ge 0} \\mathrm{Pois}(m; q\\Delta) P^m ,

and, for the convolution integral needed by the EM E-step (Okamura, Dohi & Trivedi,
"A refined EM algorithm for PH distributions", Perform. Eval. 68 (2011), §3; the engine of
mapfit),

.. math:: \\int_0^\\Delta e^{T(\\Delta-s)} \\beta a e^{Ts} ds
          = \\frac1q \\sum_{l \\ge 0} \\mathrm{Pois}(l+1; q\\Delta)
            \\sum_{m+n=l} (P^m\\beta)(aP^n).

Samples are sorted so each interval between consecutive grid times is short and one Poisson
series per interval serves all samples.  Forward vectors are renormalised at every grid point
(log scale kept in ``logs``) so nothing underflows on long or stiff traces.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from overtake.jit import njit

from ._poisson import EM_POISSON_EPS, MAX_STEP, POISSON_EPS

# Annotations only (numba compiles from the arguments' types): float64 and int64 arrays.
F = npt.NDArray[np.float64]
I = npt.NDArray[np.int64]

__all__ = ["EM_POISSON_EPS", "MAX_STEP", "POISSON_EPS", "backward", "backward_chain", "forward", "forward_chain",
           "poisson_capacity", "poisson_weights"]


@njit(cache=True)
def poisson_capacity(lam_max: float) -> int:
    """Buffer length that holds the truncated Poisson series for any ``lam <= lam_max``."""
    return int(lam_max + 10.0 * math.sqrt(lam_max) + 60.0)


@njit(cache=True)
def poisson_weights(lam: float, eps: float, buf: np.ndarray) -> int:
    """Fill ``buf[0..R]`` with normalised Poisson(lam) weights; return R.

    Weights are built outwards from the mode in relative scale, so ``exp(-lam)`` does not
    underflow for ``lam <= MAX_STEP``; right-tail terms below ``eps`` times the total are dropped
    and the kept ones renormalised to sum to one.
    """
    if lam <= 0.0:
        buf[0] = 1.0
        return 0
    mode = int(lam)
    buf[mode] = 1.0
    total = 1.0
    w = 1.0
    k = mode
    while True:
        k += 1
        w *= lam / k
        buf[k] = w
        total += w
        if w < eps * total:
            break
    right = k
    # no left truncation: the propagated vector may decay faster than the weights grow, so
    # every term down to m = 0 is kept (callers cap lam at MAX_STEP so nothing underflows badly)
    w = 1.0
    for k in range(mode - 1, -1, -1):
        w *= (k + 1) / lam
        buf[k] = w
        total += w
    for i in range(right + 1):
        buf[i] /= total
    return right


@njit(cache=True)
def _row_step(v: F, out: F, pdiag: F, src: I, dst: I, prate: F) -> None:
    # out = v P for a row vector
    for i in range(v.shape[0]):
        out[i] = v[i] * pdiag[i]
    for e in range(src.shape[0]):
        out[dst[e]] += v[src[e]] * prate[e]


@njit(cache=True)
def _col_step(v: F, out: F, pdiag: F, src: I, dst: I, prate: F) -> None:
    # out = P v for a column vector
    for i in range(v.shape[0]):
        out[i] = v[i] * pdiag[i]
    for e in range(src.shape[0]):
        out[src[e]] += prate[e] * v[dst[e]]


@njit(cache=True)
def forward(alpha: F, diag: F, src: I, dst: I, rate: F, exitv: F, q: float, dt: F, with_cdf: bool,
            eps: float) -> tuple[F, F, F]:
    """Normalised forward vectors ``A[j] ~ alpha exp(T x_j)`` at grid times ``x_j``.

    ``x_0 = 0`` and ``x_j = x_{j-1} + dt[j-1]``.  Returns ``(A, logs, cdf)`` with
    ``alpha exp(T x_j) = exp(logs[j]) A[j]`` and, if ``with_cdf``, ``cdf[j] = P(X <= x_j)``
    accumulated from positive absorption increments (accurate for tiny ``x``).
    """
    n = dt.shape[0]
    p = alpha.shape[0]
    A = np.empty((n + 1, p))
    logs = np.empty(n + 1)
    cdf = np.zeros(n + 1)
    s0 = alpha.sum()
    for i in range(p):
        A[0, i] = alpha[i] / s0
    logs[0] = math.log(s0)
    pdiag = 1.0 + diag / q
    prate = rate / q
    lam_max = 0.0
    for j in range(n):
        if q * dt[j] > lam_max:
            lam_max = q * dt[j]
    buf = np.empty(poisson_capacity(lam_max) + 2)
    tail = np.empty(buf.shape[0])
    v = np.empty(p)
    w = np.empty(p)
    acc = np.empty(p)
    for j in range(1, n + 1):
        R = poisson_weights(q * dt[j - 1], eps, buf)
        if with_cdf:
            t = 0.0
            for m in range(R, -1, -1):
                tail[m] = t  # P(N > m)
                t += buf[m]
        for i in range(p):
            v[i] = A[j - 1, i]
            acc[i] = buf[0] * v[i]
        absorbed = 0.0
        for m in range(1, R + 1):
            if with_cdf:
                ex = 0.0
                for i in range(p):
                    ex += v[i] * exitv[i]
                absorbed += ex / q * tail[m - 1]
            _row_step(v, w, pdiag, src, dst, prate)
            for i in range(p):
                v[i] = w[i]
                acc[i] += buf[m] * w[i]
        s = 0.0
        for i in range(p):
            s += acc[i]
        if s <= 0.0 or not math.isfinite(s):
            s = 1e-300
        for i in range(p):
            A[j, i] = acc[i] / s
        logs[j] = logs[j - 1] + math.log(s)
        if with_cdf:
            cdf[j] = cdf[j - 1] + math.exp(logs[j - 1]) * absorbed
    return A, logs, cdf


@njit(cache=True)
def backward(alpha: F, diag: F, src: I, dst: I, rate: F, exitv: F, q: float, dt: F, A: F, logs: F,
             coef_p: F, coef_s: F, eps: float) -> tuple[F, F, F]:
    """E-step sums of the EM over the grid (Asmussen, Nerman & Olsson 1996, §3).

    ``coef_p[j]`` weights the density term ``exp(T(x_k-x_j)) t`` and ``coef_s[j]`` the
    survival term ``exp(T(x_k-x_j)) 1``; both already multiplied by the forward scale
    ``exp(logs[j])``.  Returns ``(beta0, Z, Nedge)``: the scaled backward vector at time 0
    (``B = A[0] * beta0``), the diagonal of the convolution matrix H and ``H[dst, src]`` per
    edge (multiply by ``rate`` for the expected jump counts).
    """
    n = dt.shape[0]
    p = alpha.shape[0]
    ne = src.shape[0]
    pdiag = 1.0 + diag / q
    prate = rate / q
    lam_max = 0.0
    for j in range(n):
        if q * dt[j] > lam_max:
            lam_max = q * dt[j]
    cap = poisson_capacity(lam_max) + 2
    buf = np.empty(cap)
    U = np.empty(cap * p)  # U[m*p + i] = (P^m beta)_i
    r = np.empty(p)
    w = np.empty(p)
    beta = np.empty(p)
    Z = np.zeros(p)
    Ne = np.zeros(ne)
    zl = np.empty(p)
    nl = np.empty(ne)
    for i in range(p):
        beta[i] = coef_p[n] * exitv[i] + coef_s[n]
    for j in range(n, 0, -1):
        R = poisson_weights(q * dt[j - 1], eps, buf)
        sig_inv = math.exp(logs[j - 1] - logs[j])
        b0 = buf[0]
        for i in range(p):
            U[i] = beta[i]
            w[i] = b0 * beta[i]  # w accumulates exp(T dt) beta
        for m in range(1, R + 1):
            base = m * p
            prev = base - p
            for i in range(p):
                U[base + i] = U[prev + i] * pdiag[i]
            for e in range(ne):
                U[base + src[e]] += prate[e] * U[prev + dst[e]]
            bm = buf[m]
            for i in range(p):
                w[i] += bm * U[base + i]
        for i in range(p):
            beta[i] = sig_inv * w[i] + coef_p[j - 1] * exitv[i] + coef_s[j - 1]
        if R > 0:
            for i in range(p):
                zl[i] = 0.0
            for e in range(ne):
                nl[e] = 0.0
            # r_m = Pois(m+1) a + r_{m+1} P, accumulated against u_m = P^m beta
            bR = buf[R]
            for i in range(p):
                r[i] = bR * A[j - 1, i]
            for m in range(R - 1, -1, -1):
                base = m * p
                if m < R - 1:
                    bm1 = buf[m + 1]
                    for i in range(p):
                        w[i] = r[i] * pdiag[i] + bm1 * A[j - 1, i]
                    for e in range(ne):
                        w[dst[e]] += r[src[e]] * prate[e]
                    for i in range(p):
                        r[i] = w[i]
                for i in range(p):
                    zl[i] += U[base + i] * r[i]
                for e in range(ne):
                    nl[e] += U[base + dst[e]] * r[src[e]]
            scale = sig_inv / q
            for i in range(p):
                Z[i] += scale * zl[i]
            for e in range(ne):
                Ne[e] += scale * nl[e]
    return beta, Z, Ne


# ----------------------------------------------------------------------------- bidiagonal
# CF1, Coxian and hyper-Erlang sub-generators are bidiagonal (T = diag(d) + superdiag(u));
# direct indexing lets the compiler vectorise, which the edge-list kernels above cannot.


@njit(cache=True, fastmath=True)
def forward_chain(alpha: F, d: F, u: F, q: float, dt: F, eps: float) -> tuple[F, F]:
    """:func:`forward` for bidiagonal T (no cdf)."""
    n = dt.shape[0]
    p = alpha.shape[0]
    A = np.empty((n + 1, p))
    logs = np.empty(n + 1)
    s0 = alpha.sum()
    for i in range(p):
        A[0, i] = alpha[i] / s0
    logs[0] = math.log(s0)
    pd = 1.0 + d / q
    pu = np.zeros(p)
    for i in range(p - 1):
        pu[i + 1] = u[i] / q  # pu[i] multiplies v[i-1] in the row step
    lam_max = 0.0
    for j in range(n):
        if q * dt[j] > lam_max:
            lam_max = q * dt[j]
    buf = np.empty(poisson_capacity(lam_max) + 2)
    v = np.empty(p)
    w = np.empty(p)
    acc = np.empty(p)
    for j in range(1, n + 1):
        R = poisson_weights(q * dt[j - 1], eps, buf)
        b0 = buf[0]
        for i in range(p):
            v[i] = A[j - 1, i]
            acc[i] = b0 * v[i]
        for m in range(1, R + 1):
            w[0] = v[0] * pd[0]
            for i in range(1, p):
                w[i] = v[i] * pd[i] + v[i - 1] * pu[i]
            bm = buf[m]
            for i in range(p):
                v[i] = w[i]
                acc[i] += bm * w[i]
        s = 0.0
        for i in range(p):
            s += acc[i]
        if s <= 0.0 or not math.isfinite(s):
            s = 1e-300
        inv = 1.0 / s
        for i in range(p):
            A[j, i] = acc[i] * inv
        logs[j] = logs[j - 1] + math.log(s)
    return A, logs


@njit(cache=True, fastmath=True)
def backward_chain(alpha: F, d: F, u: F, exitv: F, q: float, dt: F, A: F, logs: F, coef_p: F, coef_s: F,
                   eps: float) -> tuple[F, F, F]:
    """:func:`backward` for bidiagonal T; ``Nedge[i]`` is ``H[i+1, i]`` for the edge i -> i+1."""
    n = dt.shape[0]
    p = alpha.shape[0]
    pd = 1.0 + d / q
    pu = np.zeros(p)  # pu[i] = u[i]/q, couples i -> i+1 (pu[p-1] = 0)
    for i in range(p - 1):
        pu[i] = u[i] / q
    lam_max = 0.0
    for j in range(n):
        if q * dt[j] > lam_max:
            lam_max = q * dt[j]
    cap = poisson_capacity(lam_max) + 2
    buf = np.empty(cap)
    U = np.empty((cap, p + 1))  # column p stays 0 so U[m, i+1] is valid for i = p-1
    r = np.empty(p)
    w = np.empty(p)
    beta = np.empty(p)
    Z = np.zeros(p)
    Ne = np.zeros(p)
    zl = np.empty(p)
    nl = np.empty(p)
    for m in range(cap):
        U[m, p] = 0.0
    for i in range(p):
        beta[i] = coef_p[n] * exitv[i] + coef_s[n]
    for j in range(n, 0, -1):
        R = poisson_weights(q * dt[j - 1], eps, buf)
        sig_inv = math.exp(logs[j - 1] - logs[j])
        b0 = buf[0]
        for i in range(p):
            U[0, i] = beta[i]
            w[i] = b0 * beta[i]
        for m in range(1, R + 1):
            bm = buf[m]
            for i in range(p):
                x = U[m - 1, i] * pd[i] + pu[i] * U[m - 1, i + 1]
                U[m, i] = x
                w[i] += bm * x
        cp = coef_p[j - 1]
        cs = coef_s[j - 1]
        for i in range(p):
            beta[i] = sig_inv * w[i] + cp * exitv[i] + cs
        if R > 0:
            for i in range(p):
                zl[i] = 0.0
                nl[i] = 0.0
            bR = buf[R]
            for i in range(p):
                r[i] = bR * A[j - 1, i]
            for m in range(R - 1, -1, -1):
                if m < R - 1:
                    bm1 = buf[m + 1]
                    w[0] = r[0] * pd[0] + bm1 * A[j - 1, 0]
                    for i in range(1, p):
                        w[i] = r[i] * pd[i] + r[i - 1] * pu[i - 1] + bm1 * A[j - 1, i]
                    for i in range(p):
                        r[i] = w[i]
                for i in range(p):
                    zl[i] += U[m, i] * r[i]
                    nl[i] += U[m, i + 1] * r[i]
            scale = sig_inv / q
            for i in range(p):
                Z[i] += scale * zl[i]
                Ne[i] += scale * nl[i]
    return beta, Z, Ne
