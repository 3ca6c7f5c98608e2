"""A CSR matrix's product with vectors without scipy's per-call checks, the same to the last bit.

``A @ x`` on a scipy sparse matrix checks shapes, types and formats on every call before it runs
its compiled kernel; the searches of :mod:`overtake.mdp.observed` multiply the same few matrices
by tens of thousands of short vectors, and on chains of a few thousand states those checks cost
several times the product itself. :func:`matvec` checks once and then calls that kernel directly.
(Imports no solver: the CLI's start loads this module; the Krylov solvers' operator is
:class:`overtake.mdp.factor.Operator`.)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

__all__ = ["matvec"]

FloatArray = npt.NDArray[np.float64]


def matvec(A: sp.csr_matrix | sp.csc_matrix) -> Callable[[FloatArray], FloatArray]:
    """``x ↦ A @ x`` for a float64 CSR or CSC matrix and float64 vectors: scipy's own kernel (its
    sparsetools ``csr_matvec`` or ``csc_matvec``, what ``A @ x`` runs, adding the terms in stored
    order) called without its checks, or ``A @ x`` itself where that private module is missing or
    A is not such a matrix. Do not change A afterwards."""
    try:
        from scipy.sparse import _sparsetools
    except ImportError:
        _sparsetools = None
    fmt = getattr(A, "format", None)
    if (_sparsetools is None or not sp.issparse(A) or fmt not in ("csr", "csc") or A.data.dtype != np.float64
            or A.indices.dtype != A.indptr.dtype):
        return lambda x: np.asarray(A @ x)
    kernel = getattr(_sparsetools, f"{fmt}_matvec", None)
    if kernel is None:
        return lambda x: np.asarray(A @ x)
    M, N = A.shape
    indptr, indices, data = A.indptr, A.indices, A.data
    direct = [True]

    def product(x: FloatArray) -> FloatArray:
        x = np.ascontiguousarray(x, dtype=np.float64)
        if x.shape != (N,) or not direct[0]:
            return np.asarray(A @ x)
        out = np.zeros(M)
        try:
            kernel(M, N, indptr, indices, data, x, out)
        except (TypeError, ValueError):  # a scipy whose private kernel takes other arguments
            direct[0] = False
            return np.asarray(A @ x)
        return out

    return product
