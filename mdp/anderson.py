"""Anderson acceleration of a fixed-point iteration x ← G(x) (Walker and Ni 2011, type II).

The solvers iterate maps whose slow modes come from long service phases: relative value iteration
(solve.py) and Gauss–Seidel for stationary laws (evaluate.py). Given the residual f = G(x) − x and
the last ``memory`` differences ΔX, ΔF of iterates and residuals, the accelerated step is

    x⁺ = x + f − (ΔX + ΔF)·γ,    γ = argmin ‖f − ΔF·γ‖₂          (Walker and Ni 2011, eq. 2.1, β = 1),

which on a linear map is GMRES on (I − G)x = b (their §2.2). The least-squares problem is solved by
its normal equations on an incrementally updated Gram matrix (one pass over the m stored Δf for
the new Gram row and Δfᵀf, one over the stored Δx + Δf for the step), with
a tiny Tikhonov term; callers check their own convergence test on every iterate, so a poor step
only costs time, and :meth:`AndersonMixer.reset` drops a history that has stopped helping.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

__all__ = ["AndersonMixer"]


class AndersonMixer:
    """Ring buffer of the last ``memory`` (Δx, Δf) pairs and the mixing step.

    Parameters
    ----------
    size
        Length of the iterate.
    memory
        m, the number of differences kept (≥ 1).
    """

    def __init__(self, size: int, memory: int) -> None:
        if isinstance(memory, bool) or not isinstance(memory, (int, np.integer)) or memory < 1:
            raise ValueError(f"memory must be an integer >= 1, got {memory!r}")
        self.memory = int(memory)
        # rows: Δf_i and Δx_i + Δf_i — all the step needs, two passes over m·n numbers a step
        self._df = np.zeros((self.memory, size))
        self._dxf = np.zeros((self.memory, size))
        self._gram = np.zeros((self.memory, self.memory))
        self._pair = np.zeros((size, 2))
        self._x: FloatArray | None = None
        self._f: FloatArray | None = None
        self._count = 0
        self._head = 0

    def reset(self) -> None:
        """Forget the history: the next :meth:`step` is a plain fixed-point step."""
        self._x = self._f = None
        self._count = self._head = 0

    def step(self, x: FloatArray, f: FloatArray) -> FloatArray:
        """The accelerated next iterate from x and its residual f = G(x) − x (a new array).

        ``x`` and ``f`` are kept by reference until the next call: do not change them in place.
        """
        k = 0  # a history exists only when the previous call left one (see reset)
        rhs = np.zeros(0)
        if self._x is not None and self._f is not None:
            h = self._head
            df, dxf = self._df[h], self._dxf[h]
            np.subtract(f, self._f, out=df)
            np.subtract(x, self._x, out=dxf)
            dxf += df
            k = self._count = min(self._count + 1, self.memory)
            self._head = (h + 1) % self.memory
            # one pass over the history for the Gram row of the new Δf and for Δfᵀf
            self._pair[:, 0] = df
            self._pair[:, 1] = f
            both = self._df[:k] @ self._pair
            self._gram[h, :k] = both[:, 0]
            self._gram[:k, h] = both[:, 0]
            rhs = both[:, 1]
        self._x, self._f = x, f
        out = x + f
        if k:
            g = self._gram[:k, :k]
            reg = 1e-13 * float(np.trace(g)) + 1e-300
            try:
                gamma = np.linalg.solve(g + reg * np.eye(k), rhs)
            except np.linalg.LinAlgError:
                self.reset()
                return out
            out -= gamma @ self._dxf[:k]
        return out
