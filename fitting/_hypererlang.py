"""Closed-form hyper-Erlang EM (G-FIT; Thümmler, Buchholz & Telek, IEEE TSE 32 (2006), §4).

For branch m with Erlang order ``r_m``, rate ``lam_m`` and weight ``pi_m`` the E-step is the
posterior branch probability ``q_km ∝ pi_m Erlang(x_k; r_m, lam_m)`` (computed in log form,
as the paper stresses) and the M-step is ``pi_m = sum_k w_k q_km / W``,
``lam_m = r_m sum_k w_k q_km / sum_k w_k q_km x_k``.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from overtake.jit import njit


@njit(cache=True)
def her_em(x: npt.NDArray[np.float64], w: npt.NDArray[np.float64], shapes: npt.NDArray[np.int64],
           pi: npt.NDArray[np.float64], lam: npt.NDArray[np.float64], max_iter: int,
           rtol: float) -> tuple[npt.NDArray[np.float64], int, bool]:
    """Run closed-form EM in place on ``pi, lam``; return ``(trace, n_iter, converged)``."""
    n = x.shape[0]
    M = shapes.shape[0]
    logx = np.log(x)
    W = w.sum()
    lg = np.empty(M)
    for m in range(M):
        lg[m] = math.lgamma(shapes[m])
    trace = np.empty(max_iter)
    lp = np.empty(M)
    s0 = np.empty(M)
    s1 = np.empty(M)
    c = np.empty(M)
    converged = False
    it = 0
    for it in range(max_iter):
        for m in range(M):
            s0[m] = 0.0
            s1[m] = 0.0
            if pi[m] > 0:
                c[m] = math.log(pi[m]) + shapes[m] * math.log(lam[m]) - lg[m]
            else:
                c[m] = -np.inf
        ll = 0.0
        for k in range(n):
            mx = -np.inf
            for m in range(M):
                lp[m] = c[m] + (shapes[m] - 1.0) * logx[k] - lam[m] * x[k]
                if lp[m] > mx:
                    mx = lp[m]
            tot = 0.0
            for m in range(M):
                lp[m] = math.exp(lp[m] - mx)
                tot += lp[m]
            ll += w[k] * (mx + math.log(tot))
            f = w[k] / tot
            for m in range(M):
                qm = lp[m] * f
                s0[m] += qm
                s1[m] += qm * x[k]
        trace[it] = ll
        if it > 0 and abs(ll - trace[it - 1]) <= rtol * abs(ll):
            converged = True
            break
        if it == max_iter - 1:
            break
        for m in range(M):
            pi[m] = s0[m] / W
            if s1[m] > 0:
                lam[m] = shapes[m] * s0[m] / s1[m]
    return trace[: it + 1], it + 1, converged
