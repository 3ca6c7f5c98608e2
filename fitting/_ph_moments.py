"""Moments of a phase-type distribution, ``E[X^k] = k! alpha (-T)^{-k} 1``."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from overtake.phases import phase_means

from .errors import InvalidParameterError

__all__ = ["Moments"]

FloatArray = npt.NDArray[np.float64]


class Moments:
    """Moments and phase means of :class:`overtake.fitting.PhaseType` (a base class of it)."""

    __slots__ = ()
    _alpha: FloatArray
    _T: FloatArray
    _t: FloatArray

    @property
    def atom(self) -> float:
        """Probability mass at zero, ``1 - sum(alpha)``."""
        return float(max(0.0, 1.0 - self._alpha.sum()))

    @property
    def order(self) -> int:
        """Number of transient phases p."""
        return int(self._alpha.shape[0])

    def moment(self, k: int) -> float:
        """Raw moment ``E[X^k] = k! alpha (-T)^{-k} 1``."""
        if int(k) != k or k < 0:
            raise InvalidParameterError(f"k must be a non-negative integer, got {k!r}")
        k = int(k)
        if k == 0:
            return 1.0
        v: FloatArray = np.ones(self.order)
        for _ in range(k):
            v = np.asarray(np.linalg.solve(-self._T, v), dtype=np.float64)
        return float(math.factorial(k) * self._alpha @ v)

    def mean(self) -> float:
        """Mean, seconds."""
        return self.moment(1)

    def var(self) -> float:
        """Variance, seconds squared."""
        m1 = self.moment(1)
        return self.moment(2) - m1 * m1

    def std(self) -> float:
        """Standard deviation, seconds."""
        return math.sqrt(max(self.var(), 0.0))

    def scv(self) -> float:
        """Squared coefficient of variation ``var / mean**2``."""
        m1 = self.moment(1)
        return self.var() / (m1 * m1)

    def phase_means(self) -> FloatArray:
        """Expected time to absorption from each phase, ``(-T)^{-1} 1``, seconds."""
        return phase_means(self._T)
