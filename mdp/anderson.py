"""Anderson acceleration of a fixed-point iteration x ← G(x) (Walker and Ni 2011, type II).

The solvers iterate maps whose slow modes come from long service phases: relative value iteration
(average_cost.py) and Gauss–Seidel for stationary laws (evaluate.py). Given the residual f = G(x) − x and
the last ``memory`` differences ΔX, ΔF of iterates and residuals, the accelerated step is

    x⁺ = x + f − (ΔX + ΔF)·γ,    γ = argmin ‖f − ΔF·γ‖₂          (Walker and Ni 2011, eq. 2.1, β = 1),

which on a linear map is GMRES on (I − G)x = b (their §2.2). The least-squares problem is solved by
its normal equations on an incrementally updated Gram matrix (one pass over the m stored Δf for
the new Gram row and Δfᵀf, one over the stored Δx + Δf for the step; compiled, _kernels.py, from
``KERNEL_MIN`` entries on, where numpy's temporaries made the mixing cost more than the sweep), with
a tiny Tikhonov term; callers check their own convergence test on every iterate, so a poor step
only costs time, and :meth:`AndersonMixer.reset` drops a history that has stopped helping.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

__all__ = ["AndersonMixer", "StallRestart"]

#: From this size on the two passes run compiled (numba is imported then; smaller problems stay
#: numpy so a small scenario never loads it — bellman.KERNEL_MIN_STATES, the same threshold).
KERNEL_MIN = 5_000


class AndersonMixer:
    """Ring buffer of the last ``memory`` (Δx, Δf) pairs and the mixing step.

    Parameters
    ----------
    size
        Length of the iterate.
    memory
        m, the number of differences kept (≥ 1).
    compiled
        Whether the two passes run compiled: by default from ``KERNEL_MIN`` entries on; True where
        the caller has the kernels loaded anyway (Gauss–Seidel's sweeps are compiled), so that a
        short iterate's mixing costs no more than its sweeps.
    """

    def __init__(self, size: int, memory: int, *, compiled: bool | None = None) -> None:
        if isinstance(memory, bool) or not isinstance(memory, (int, np.integer)) or memory < 1:
            raise ValueError(f"memory must be an integer >= 1, got {memory!r}")
        self.memory = int(memory)
        # rows: Δf_i and Δx_i + Δf_i — all the step needs, two passes over m·n numbers a step
        self._df = np.zeros((self.memory, size))
        self._dxf = np.zeros((self.memory, size))
        self._gram = np.zeros((self.memory, self.memory))
        self.compiled = size >= KERNEL_MIN if compiled is None else bool(compiled)
        self._pair = np.zeros((0 if self.compiled else size, 2))  # the numpy path's buffer
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
        if self.compiled:
            return self._step_compiled(x, f)
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
        gamma = self._mix(k, rhs) if k else None
        if gamma is not None:
            out -= gamma @ self._dxf[:k]
        return out

    def _mix(self, k: int, rhs: FloatArray) -> FloatArray | None:
        """γ from the normal equations, or None (history reset) when they are singular."""
        g = self._gram[:k, :k]
        reg = 1e-13 * float(np.trace(g)) + 1e-300
        try:
            gamma = np.asarray(np.linalg.solve(g + reg * np.eye(k), rhs), dtype=np.float64)
        except np.linalg.LinAlgError:
            self.reset()
            return None
        return gamma

    def _step_compiled(self, x: FloatArray, f: FloatArray) -> FloatArray:
        """:meth:`step` in two compiled passes over the history (same arithmetic, no temporaries)."""
        from . import _kernels

        x = np.ascontiguousarray(x, dtype=np.float64)
        f = np.ascontiguousarray(f, dtype=np.float64)
        out = np.empty_like(x)
        gamma = None
        if self._x is not None and self._f is not None:
            h = self._head
            k = self._count = min(self._count + 1, self.memory)
            self._head = (h + 1) % self.memory
            both = np.empty((k, 2))
            _kernels.anderson_history(x, f, self._x, self._f, self._df, self._dxf, h, k, both)
            self._gram[h, :k] = both[:, 0]
            self._gram[:k, h] = both[:, 0]
            gamma = np.empty(k)
            if not _kernels.anderson_gamma(self._gram, k, both, gamma):  # _mix's system, compiled
                self.reset()
                gamma = None
        self._x, self._f = x, f
        if gamma is None:
            np.add(x, f, out=out)
        else:
            _kernels.anderson_mix(x, f, self._dxf, gamma, out)
        return out


class StallRestart:
    """Drops a mixer's history once the iteration's error has not improved for more than
    ``patience`` steps: old differences can mislead (after a policy switch in value iteration, or
    a slow mode the history no longer describes), and a fresh history recovers the speed."""

    def __init__(self, mixer: AndersonMixer, patience: int) -> None:
        self.mixer, self.patience = mixer, patience
        self.best, self.stale = np.inf, 0

    def observe(self, error: float) -> None:
        """The error of the latest iterate; restarts the history after ``patience`` steps without
        a new best."""
        if error < self.best:
            self.best, self.stale = error, 0
        else:
            self.stale += 1
        if self.stale > self.patience:
            self.mixer.reset()
            self.best, self.stale = error, 0

    def restart(self) -> None:
        """Drop the history now and forget the best error (the iteration resumes from an earlier
        iterate)."""
        self.mixer.reset()
        self.best, self.stale = np.inf, 0
