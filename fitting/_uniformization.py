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
series per interval serves all samples. In the bidiagonal (chain) kernels a long interval, where
the series would need many terms, is done instead by a short series and squarings (see
:func:`chain_conv`).  Forward vectors are renormalised at every grid point
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

__all__ = ["EM_POISSON_EPS", "MAX_STEP", "POISSON_EPS", "backward", "backward_chain", "chain_conv", "chain_expm",
           "forward", "forward_chain", "poisson_capacity", "poisson_weights"]


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
def forward_chain(alpha: F, d: F, u: F, q: float, dt: F, eps: float, big: float) -> tuple[F, F]:
    """:func:`forward` for bidiagonal T (no cdf); a gap with ``q dt > big`` by squaring (:func:`chain_expm`)."""
    n = dt.shape[0]
    p = alpha.shape[0]
    A = np.empty((n + 1, p))
    logs = np.empty(n + 1)
    s0 = alpha.sum()
    for i in range(p):
        A[0, i] = alpha[i] / s0
    logs[0] = math.log(s0)
    pd = 1.0 + d / q
    c = _slowest(d)
    pu = np.zeros(p)
    for i in range(p - 1):
        pu[i + 1] = u[i] / q  # pu[i] multiplies v[i-1] in the row step
    lam_max = 0.0
    for j in range(n):
        if lam_max < q * dt[j] <= big:
            lam_max = q * dt[j]
    buf = np.empty(poisson_capacity(lam_max) + 2)
    v = np.empty(p)
    w = np.empty(p)
    acc = np.empty(p)
    pu_col = np.zeros(p)  # pu_col[i] couples i -> i+1 (the squaring helpers' convention)
    for i in range(p - 1):
        pu_col[i] = u[i] / q
    E = np.empty((p, p))
    M = np.empty((p, p))
    W = np.empty((p, p))
    for j in range(1, n + 1):
        lam = q * dt[j - 1]
        if lam > big:
            chain_expm(pd, pu_col, lam, c / q, buf, E, M, W)
            for k in range(p):
                x = 0.0
                for i in range(k + 1):
                    x += A[j - 1, i] * E[i, k]
                acc[k] = x
        else:
            R = poisson_weights(lam, eps, buf)
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
        logs[j] = logs[j - 1] + math.log(s) - (c * dt[j - 1] if lam > big else 0.0)
    return A, logs


@njit(cache=True, fastmath=True)
def backward_chain(alpha: F, d: F, u: F, exitv: F, q: float, dt: F, A: F, logs: F, coef_p: F, coef_s: F,
                   eps: float, big: float) -> tuple[F, F, F]:
    """:func:`backward` for bidiagonal T; ``Nedge[i]`` is ``H[i+1, i]`` for the edge i -> i+1. A gap with
    ``q dt > big`` by block squaring (:func:`chain_conv`)."""
    n = dt.shape[0]
    p = alpha.shape[0]
    pd = 1.0 + d / q
    c = _slowest(d)
    pu = np.zeros(p)  # pu[i] = u[i]/q, couples i -> i+1 (pu[p-1] = 0)
    for i in range(p - 1):
        pu[i] = u[i] / q
    lam_max = 0.0
    for j in range(n):
        if lam_max < q * dt[j] <= big:
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
    E = np.empty((p, p))
    Fm = np.empty((p, p))
    M = np.empty((p, p))
    W = np.empty((p, p))
    G = np.empty((p, p))
    ap = np.empty(p)
    aw = np.empty(p)
    a = np.empty(p)
    for i in range(p):
        beta[i] = coef_p[n] * exitv[i] + coef_s[n]
    for j in range(n, 0, -1):
        lam = q * dt[j - 1]
        sig_inv = math.exp(logs[j - 1] - logs[j])
        if lam > big:
            sig_inv = math.exp(logs[j - 1] - logs[j] - c * dt[j - 1])  # E and Fm are shifted by c
            for i in range(p):
                a[i] = A[j - 1, i]
            chain_conv(pd, pu, q, lam, c / q, beta, a, buf, E, Fm, M, W, G, ap, aw)
            for i in range(p):
                x = 0.0
                for k in range(i, p):
                    x += E[i, k] * beta[k]
                w[i] = x
            for i in range(p):
                Z[i] += sig_inv * Fm[i, i]
                if i + 1 < p:
                    Ne[i] += sig_inv * Fm[i + 1, i]
            cp = coef_p[j - 1]
            cs = coef_s[j - 1]
            for i in range(p):
                beta[i] = sig_inv * w[i] + cp * exitv[i] + cs
            continue
        R = poisson_weights(lam, eps, buf)
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


# -------------------------------------------------------------------- long gaps: squaring
# A gap with q*dt Poisson terms costs q*dt vector steps by the series above; in a stiff model (fast
# and slow phases together, heavy-tailed samples) the few long gaps of the tail hold almost all of
# q * (largest sample). For those, e^{T dt} and the convolution integral come from a short series
# on dt / 2^s and s block squarings (Van Loan, "Computing integrals involving the matrix
# exponential", IEEE TAC 23 (1978)): for M = [[T, beta a], [0, T]], e^{M h} = [[E_h, F_h], [0, E_h]]
# with F_h the integral, and F_{2h} = E_h F_h + F_h E_h. P, beta, a and the Poisson weights are
# non-negative, so every sum and product adds non-negative terms: no cancellation.

SQUARE_STEP = 0.5  # q * h of the series the squarings start from


@njit(cache=True, fastmath=True)
def _slowest(d: F) -> float:
    """The smallest total rate ``min(-d)``: the squarings run on ``T + c I`` with it, whose entries
    neither underflow nor grow exponentially over a long gap (the scale goes into ``logs``)."""
    c = -float(d[0])
    for i in range(1, d.shape[0]):
        c = min(c, -float(d[i]))
    return c


@njit(cache=True, fastmath=True)
def _scale(X: F, f: float) -> None:
    for i in range(X.shape[0]):
        for k in range(X.shape[1]):
            X[i, k] *= f


@njit(cache=True, fastmath=True)
def _squarings(lam: float) -> int:
    s = 0
    h = lam
    while h > SQUARE_STEP:
        h *= 0.5
        s += 1
    return s


@njit(cache=True, fastmath=True)
def _series_term(pd: F, pu: F, bm: float, E: F, M: F, W: F) -> None:
    """``M <- M P`` (``P = diag(pd) + superdiag(pu[0..p-2])``, upper triangular) and ``E += bm M``."""
    p = pd.shape[0]
    for i in range(p):
        W[i, i] = M[i, i] * pd[i]
        for k in range(i + 1, p):
            W[i, k] = M[i, k] * pd[k] + M[i, k - 1] * pu[k - 1]
    for i in range(p):
        for k in range(i, p):
            M[i, k] = W[i, k]
            E[i, k] += bm * W[i, k]


@njit(cache=True, fastmath=True)
def _chain_power_series(pd: F, pu: F, lam: float, buf: F, E: F, M: F, W: F) -> None:
    """``E = sum_m Pois(m; lam) P^m`` (``= e^{T lam / q}``) for a small ``lam``; ``M``, ``W`` scratch."""
    p = pd.shape[0]
    R = poisson_weights(lam, 1e-17, buf)
    for i in range(p):
        for k in range(p):
            M[i, k] = 0.0
            E[i, k] = 0.0
        M[i, i] = 1.0
        E[i, i] = buf[0]
    for m in range(1, R + 1):
        _series_term(pd, pu, buf[m], E, M, W)


@njit(cache=True, fastmath=True)
def _upper_square(E: F, W: F) -> None:
    """``E <- E E`` for upper-triangular E (``W`` scratch)."""
    p = E.shape[0]
    for i in range(p):
        for k in range(i, p):
            acc = 0.0
            for m in range(i, k + 1):
                acc += E[i, m] * E[m, k]
            W[i, k] = acc
    for i in range(p):
        for k in range(i, p):
            E[i, k] = W[i, k]


@njit(cache=True, fastmath=True)
def chain_expm(pd: F, pu: F, lam: float, cq: float, buf: F, E: F, M: F, W: F) -> None:
    """``E = e^{(T + c I) dt}`` for ``lam = q dt``, ``cq = c / q``, by a short series and squarings
    (upper triangular)."""
    s = _squarings(lam)
    lh = lam / 2.0**s
    _chain_power_series(pd, pu, lh, buf, E, M, W)
    _scale(E, math.exp(cq * lh))
    for _ in range(s):
        _upper_square(E, W)


@njit(cache=True, fastmath=True)
def chain_conv(pd: F, pu: F, q: float, lam: float, cq: float, beta: F, a: F, buf: F, E: F, Fm: F, M: F,
               W: F, G: F, ap: F, aw: F) -> None:
    """``E = e^{T dt}`` and ``Fm = int_0^dt e^{T(dt-s)} beta a e^{Ts} ds`` for ``lam = q dt``, both
    times ``e^{c dt}`` (``cq = c / q``)."""
    p = pd.shape[0]
    s = _squarings(lam)
    lh = lam / 2.0**s
    R = poisson_weights(lh, 1e-17, buf)
    # E_h as in chain_power_series; F_h = (1/q) sum_l Pois(l+1) G_l with
    # G_l = sum_{m+n=l} P^m beta a P^n = P G_{l-1} + beta (a P^l)
    for i in range(p):
        for k in range(p):
            M[i, k] = 0.0
            E[i, k] = 0.0
            G[i, k] = beta[i] * a[k]
            Fm[i, k] = buf[1] * G[i, k] if R >= 1 else 0.0
        M[i, i] = 1.0
        E[i, i] = buf[0]
        ap[i] = a[i]
    for m in range(1, R + 1):
        _series_term(pd, pu, buf[m], E, M, W)
        if m < R:
            # ap <- ap P; G <- P G + beta ap
            aw[0] = ap[0] * pd[0]
            for k in range(1, p):
                aw[k] = ap[k] * pd[k] + ap[k - 1] * pu[k - 1]
            for k in range(p):
                ap[k] = aw[k]
            b1 = buf[m + 1]
            for i in range(p):
                for k in range(p):
                    g = pd[i] * G[i, k] + beta[i] * ap[k]
                    if i + 1 < p:
                        g += pu[i] * G[i + 1, k]
                    G[i, k] = g
                    Fm[i, k] += b1 * g
    _scale(Fm, math.exp(cq * lh) / q)
    _scale(E, math.exp(cq * lh))
    for _ in range(s):
        # F <- E F + F E (E upper triangular), then E <- E E
        for i in range(p):
            for k in range(p):
                acc = 0.0
                for m in range(i, p):
                    acc += E[i, m] * Fm[m, k]
                for m in range(0, k + 1):
                    acc += Fm[i, m] * E[m, k]
                W[i, k] = acc
        for i in range(p):
            for k in range(p):
                Fm[i, k] = W[i, k]
        _upper_square(E, W)
