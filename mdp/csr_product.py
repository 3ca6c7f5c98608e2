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

__all__ = ["kernel", "matvec"]

FloatArray = npt.NDArray[np.float64]


def kernel(A: sp.spmatrix) -> Callable[..., None] | None:
    """scipy's compiled ``y += A·x`` for a float64 CSR or CSC matrix: its sparsetools
    ``csr_matvec`` or ``csc_matvec`` (what ``A @ x`` runs, adding each row's terms in stored order),
    called as ``kernel(M, N, indptr, indices, data, x, y)``; None where that private module or
    function is missing or A is not such a matrix."""
    try:
        from scipy.sparse import _sparsetools
    except ImportError:
        return None
    fmt = getattr(A, "format", None)
    if not sp.issparse(A) or fmt not in ("csr", "csc") or A.data.dtype != np.float64 or A.indices.dtype != A.indptr.dtype:
        return None
    fn: Callable[..., None] | None = getattr(_sparsetools, f"{fmt}_matvec", None)
    return fn


def matvec(A: sp.csr_matrix | sp.csc_matrix) -> Callable[[FloatArray], FloatArray]:
    """``x ↦ A @ x`` for float64 vectors: :func:`kernel` called without scipy's checks, or ``A @ x``
    itself where there is no such kernel (or it takes other arguments: another scipy). Do not
    change A afterwards."""
    fn = kernel(A)
    if fn is None:
        return lambda x: np.asarray(A @ x)
    M, N = A.shape
    indptr, indices, data = A.indptr, A.indices, A.data
    direct = True

    def product(x: FloatArray) -> FloatArray:
        nonlocal direct
        x = np.ascontiguousarray(x, dtype=np.float64)
        if x.shape != (N,) or not direct:
            return np.asarray(A @ x)
        out = np.zeros(M)
        try:
            fn(M, N, indptr, indices, data, x, out)
        except (TypeError, ValueError):  # a scipy whose private kernel takes other arguments
            direct = False
            return np.asarray(A @ x)
        return out

    return product
