"""The exact rank of a state: an integer vector's lexicographic rank among all vectors of its
length with sum ≤ C, the collision-free int64 key every state lookup uses.
"""

from __future__ import annotations

import sys
from math import comb

import numpy as np
import numpy.typing as npt

from .errors import TruncationError

__all__ = ["Ranker"]

IntArray = npt.NDArray[np.int64]

_RANK_KERNEL_ROWS = 20_000


class Ranker:
    """Exact rank of an integer vector of length L with sum ≤ C in lexicographic order."""

    def __init__(self, length: int, cap: int) -> None:
        self.length = length
        self.cap = cap
        total = comb(cap + length, length)
        if total >= 2**62:
            raise TruncationError(
                f"truncation.max_requests = {cap} with {length} state components is too large "
                f"to index ({total:.3g} vectors); lower max_requests or max_threads"
            )
        # N[r, b] = #vectors of length r with sum <= b = C(b + r, r)
        n = np.zeros((length + 2, cap + 1), dtype=np.int64)
        for r in range(length + 2):
            for b in range(cap + 1):
                n[r, b] = comb(b + r, r)
        self.counts = n
        self._n_list = [[int(x) for x in r] for r in n]

    def rank_one(self, row: list[int]) -> int:
        """:meth:`rank` of one vector in plain Python: a few µs, for per-request lookups."""
        n = self._n_list
        L = self.length
        budget = self.cap
        key = 0
        for col, v in enumerate(row):
            if v > 0:
                r = L - col
                key += n[r][budget] - n[r][budget - v]
            budget -= v
        if budget < 0:
            raise IndexError("a row exceeds the truncation's request cap")
        return key

    def rank(self, rows: IntArray) -> IntArray:
        """Ranks of many rows; IndexError if a row exceeds the cap.

        One compiled pass for many rows or once the kernels are loaded anyway (by a large solve);
        column-by-column numpy otherwise, so small scenarios start without loading them.
        """
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if rows.ndim == 1:
            rows = rows[None, :]
        if rows.shape[0] >= _RANK_KERNEL_ROWS or "numba" in sys.modules or "overtake.mdp._kernels" in sys.modules:
            from . import _kernels

            key = np.empty(rows.shape[0], dtype=np.int64)
            if not _kernels.rank_rows(rows, self.counts, self.cap, key):
                raise IndexError("a row exceeds the truncation's request cap")
            return key
        budget = np.full(rows.shape[0], self.cap, dtype=np.int64)
        key = np.zeros(rows.shape[0], dtype=np.int64)
        L = self.length
        for col in range(L):
            v = rows[:, col]
            r = L - col - 1
            # vectors sharing the prefix with a smaller value here: N[r+1][b] - N[r+1][b-v]
            b = np.maximum(budget, 0)
            key += np.where(v > 0, self.counts[r + 1, b] - self.counts[r + 1, np.maximum(b - v, 0)], 0)
            budget = budget - v
        if np.any(budget < 0):
            raise IndexError("a row exceeds the truncation's request cap")
        return key
