"""A factor of a chain's equations: one sparse LU answers a table's bias and stationary law.

:class:`Factor` holds the LU of (I − P)_{−0,−0} for the transition matrix P of a table on an
:class:`~overtake.mdp.observation.ObservationSpace` (or any uniformized chain with state 0 as
reference). A complete factor also solves for a table whose decision rows differ in a few states
(a low-rank update), and any factor preconditions the iterative solve of a table far from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from .csr_product import matvec
from .errors import SolverError

__all__ = ["ILU_DROP", "ITER_MIN", "ITER_RTOL", "Factor", "Operator"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

ITER_RTOL = 1e-13  # relative residual of the iterative solves (E[W] then agrees with a direct solve to < 1e-9)
# BiCGSTAB iterations an iterative solve may take at least. A factorization's multiply-adds
# (Factor.work) leave out its ordering and symbolic steps, which dominate on chains of ten
# thousand states, where the work alone would allow a few iterations; the solves of Table 1's
# searches that converge do so in under 120, and one that has not by then costs more than the
# factorization that follows its failure
ITER_MIN = 120
ILU_DROP = 1e-3  # the incomplete factor's drop tolerance (Factor)
# an incomplete factor of a matrix with at least this share of columns of over this many entries
# orders them last (_dense_last)
DENSE_COLUMN = 60
DENSE_SHARE = 0.02
ITER_MAX = 2_000  # BiCGSTAB iterations per column at most (the work budget bounds them first: Factor.iterate)
# solved columns a complete factor keeps for its low-rank updates (Factor.update), in floats: a
# search's trials against one factor change the same states again and again
UPDATE_CACHE_FLOATS = 16_000_000


class Operator(spla.LinearOperator):  # type: ignore[misc]
    """A square float64 linear operator whose ``matvec`` is ``fn`` itself: scipy's Krylov solvers
    call ``matvec`` of their operator and preconditioner a few times per iteration, and
    :class:`~scipy.sparse.linalg.LinearOperator`'s own checks and reshapes on each call cost
    about what the product of a chain of a few thousand states does. ``fn`` must take and return
    vectors of length n."""

    def __init__(self, n: int, fn: Callable[[FloatArray], FloatArray]) -> None:
        super().__init__(np.dtype(np.float64), (n, n))
        self.fn = fn
        self.matvec = fn

    def _matvec(self, x: FloatArray) -> FloatArray:
        return self.fn(np.ravel(x))


class Factor:
    """A sparse LU of (I − P)_{−0,−0}, the matrix of both the bias and the stationary equations.

    With h(0) = 0 the bias is h = u − γv, A u = c_{−0}, A v = 1, γ = (c_0 + P_{0,−0}u)/(1 + P_{0,−0}v);
    the stationary law with π_0 = 1 solves Aᵀ π_{−0} = P_{0,−0}ᵀ. One factorization answers all
    three; a complete one also solves for a table that differs in a few states' decision rows
    (:meth:`update`), and any stays a good preconditioner for one that differs in many (BiCGSTAB,
    :meth:`iterate`). ``seconds`` is what the factorization took (reported only:
    nothing is decided on it, so that the answer does not depend on the machine's load); ``nnz``
    its fill and ``work`` its multiply-adds as counted from the fill (:func:`_lu_work`).

    ``complete`` False: an incomplete LU (drop tolerance 1e-3). The complete LU of a large
    table's system fills in (millions of entries from tens of thousands of states) and costs
    many times what the incomplete one does, while GMRES preconditioned by the incomplete one
    meets a relative residual of 1e-13 in a few dozen steps; :meth:`solve` then iterates.
    """

    def __init__(self, A: sp.csc_matrix, actions: IntArray, *, complete: bool = True) -> None:
        t = time.perf_counter()
        self.complete = complete
        self.lu = _factored(A, complete)
        self.seconds = time.perf_counter() - t
        L, U = self.lu.L.tocsc(), self.lu.U.tocsr()
        self.nnz = int(L.nnz + U.nnz)
        self.work = _lu_work(L, U)
        self.shape = A.shape
        self.actions = np.array(actions, dtype=np.int64, copy=True)
        # the factored table's own (u, v, π_{−0}) as columns: the base of :meth:`update`
        self.base: FloatArray | None = None
        # A⁻¹ U and A⁻ᵀ Vtᵀ by column key (:meth:`update`): a column depends on its key alone
        self._solved: tuple[dict[Hashable, FloatArray], dict[Hashable, FloatArray]] = ({}, {})
        self.iterations = 0  # BiCGSTAB iterations the last :meth:`iterate` took (over its columns)

    def solve(self, A: sp.csc_matrix, B: FloatArray, *, trans: bool = False) -> FloatArray | None:
        """Solve A X = B (Aᵀ X = B with ``trans``) for the factored A: directly, or for an
        incomplete factor by GMRES preconditioned by it (None if it has not converged)."""
        if not self.complete:
            return self._gmres(A, B, trans)
        return np.asarray(self.lu.solve(B, trans="T" if trans else "N"))

    def update(self, U: sp.csc_matrix, Vt: sp.csr_matrix, u0: FloatArray, *,
               keys: tuple[Sequence[Hashable], Sequence[Hashable]] | None = None,
               ) -> tuple[FloatArray, FloatArray] | None:
        """The bias and stationary solves of the factored matrix minus ``U Vt`` (rank r), exactly.

        A trial table changes the decision rows R(z, ·) of the states z of a few classes; with
        ΔR those rows' change, P changes by P_chg(·, z) ΔR(z, ·), so A = (I − P)_{−0,−0} changes
        by −U Vt (U = P_chg(−0, z), Vt = ΔR(z, −0)) and P_{0,−0} by u0 Vt (u0 = P_chg(0, z)).
        The Sherman–Morrison–Woodbury identity (Hager, "Updating the inverse of a matrix", SIAM
        Review 1989) solves both systems from this factor with 2r solves and one r × r system:

            (A − U Vt)⁻¹ b  = y + W (I − Vt W)⁻¹ Vt y,          y = A⁻¹ b,  W = A⁻¹ U,
            (A − U Vt)⁻ᵀ c' = y' + W' (I − Vt W)⁻ᵀ Uᵀ y',     y' = A⁻ᵀ c' = A⁻ᵀ c + W' u0,  W' = A⁻ᵀ Vtᵀ.

        Returns the two solutions ((u, v) and π_{−0}), or None if this factor is incomplete or
        has no base solutions (the caller factors the trial instead).

        ``keys``: one key per column of U and per row of Vt, equal keys meaning equal columns
        (rows); their solves are kept and reused by later updates of this factor, so that a
        column is solved once however many trials change its state.
        """
        if not self.complete or self.base is None:
            return None
        if keys is None:
            W = np.asarray(self.lu.solve(U.toarray()))
            Wt = np.asarray(self.lu.solve(Vt.T.toarray(), trans="T"))
        else:
            W = self._columns(U.tocsc(), keys[0], trans=False)
            Wt = self._columns(Vt.T.tocsc(), keys[1], trans=True)
        cap = np.eye(U.shape[1]) - Vt @ W
        y, yT = self.base[:, :2], self.base[:, 2] + Wt @ u0
        try:
            sol = y + W @ np.linalg.solve(cap, Vt @ y)
            solT = yT + Wt @ np.linalg.solve(cap.T, U.T @ yT)
        except np.linalg.LinAlgError:
            return None
        return sol, solT

    def _columns(self, B: sp.csc_matrix, keys: Sequence[Hashable], *, trans: bool) -> FloatArray:
        """A⁻¹ B (A⁻ᵀ B with ``trans``) column by column, each column solved once per key."""
        cache = self._solved[1 if trans else 0]
        if len(keys) != B.shape[1]:
            raise ValueError(f"Factor.update: {len(keys)} keys for {B.shape[1]} columns")
        missing = [j for j, k in enumerate(keys) if k not in cache]
        if missing:
            if (len(cache) + len(missing)) * B.shape[0] > UPDATE_CACHE_FLOATS:
                cache.clear()
            X = np.asarray(self.lu.solve(B[:, missing].toarray(), trans="T" if trans else "N"))
            for i, j in enumerate(missing):
                cache[keys[j]] = X[:, i].copy()
        return np.column_stack([cache[k] for k in keys]) if keys else np.empty((B.shape[0], 0))

    def _gmres(self, A: sp.csc_matrix, B: FloatArray, trans: bool) -> FloatArray | None:
        """A X = B by GMRES preconditioned by this (incomplete) factor, relative residual 1e-13."""
        t = "T" if trans else "N"
        M = spla.LinearOperator(self.shape, lambda b: self.lu.solve(b, trans=t))
        op = A.T.tocsr() if trans else A
        out = np.empty_like(B)
        for j in range(B.shape[1]):
            x, info = spla.gmres(op, B[:, j], x0=self.lu.solve(B[:, j], trans=t), M=M, rtol=ITER_RTOL, atol=0.0,
                                 restart=80, maxiter=5)
            if info != 0 or not np.all(np.isfinite(x)):
                return None
            out[:, j] = x
        return out

    def iteration_work(self, A: sp.csc_matrix) -> int:
        """Multiply-adds of one BiCGSTAB iteration preconditioned by this factor: two products
        by A and two triangular solve pairs."""
        return 2 * (int(A.nnz) + self.nnz)

    def iterate(self, A: sp.csc_matrix, B: FloatArray, X0: FloatArray, *, budget: int, trans: bool = False,
                rtol: float = ITER_RTOL) -> FloatArray | None:
        """Solve A X = B (Aᵀ X = B with ``trans``) for an A far from the factored matrix: BiCGSTAB
        preconditioned by the factor, started from ``X0`` (a similar table's solution), to relative
        residual ``rtol``; None if a column broke down or has not converged within ``budget``
        BiCGSTAB iterations over all columns (the caller gives it what a new factorization would
        cost). An iteration count, not a clock: the same table takes the same path on any machine.
        :attr:`iterations` is then the iterations this call took.
        """
        t = "T" if trans else "N"
        n = self.shape[0]
        lu = self.lu
        M = Operator(n, lambda b: np.asarray(lu.solve(b, trans=t)))
        op = A.T.tocsr() if trans else A
        product = Operator(n, matvec(op))
        spent = self.iterations = 0

        def check(_: FloatArray) -> None:
            nonlocal spent
            spent += 1
            self.iterations = spent
            if spent > budget:
                raise _OutOfTime

        out = np.empty_like(B)
        for j in range(B.shape[1]):
            try:
                x, info = spla.bicgstab(product, B[:, j], x0=X0[:, j], M=M, rtol=rtol, atol=0.0, maxiter=ITER_MAX,
                                        callback=check)
            except _OutOfTime:
                return None
            if info != 0 or not np.all(np.isfinite(x)):
                return None
            if np.linalg.norm(op @ x - B[:, j]) > 10 * rtol * np.linalg.norm(B[:, j]):
                return None  # the recurrence's residual drifted from the true one
            out[:, j] = x
        return out


def _factored(A: sp.csc_matrix, complete: bool) -> Any:
    """The LU of A, complete or incomplete (drop tolerance :data:`ILU_DROP`), in :func:`_dense_last`
    order where that applies, else in SuperLU's COLAMD order."""
    order = _dense_last(A)

    def lu(M: sp.csc_matrix, spec: str) -> Any:
        return (spla.splu(M, permc_spec=spec) if complete else
                spla.spilu(M, drop_tol=ILU_DROP, fill_factor=15, permc_spec=spec))

    return lu(A, "COLAMD") if order is None else _Reordered(lu(A[:, order].tocsc(), "NATURAL"), order)


def _dense_last(A: sp.csc_matrix) -> IntArray | None:
    """A column order for A with many dense columns: COLAMD's order of the others, the dense ones last.

    A table that starts many threads at once (π(∞)) reaches a post-decision state from hundreds of
    pre-decision states, and SuperLU's COLAMD takes several times the elimination on such
    columns; ordered last they add little fill to an incomplete factor and some to a complete
    one, and the rest orders fast. None where fewer than :data:`DENSE_SHARE` of the columns have over
    :data:`DENSE_COLUMN` entries (COLAMD's own order then), or where the ordering step fails.
    """
    n = A.shape[0]
    dense = np.diff(A.indptr) > DENSE_COLUMN
    if not dense.any() or dense.sum() < DENSE_SHARE * n:
        return None
    # the dense columns reduced to their diagonal, and a unit diagonal added so that an
    # elimination dropping nearly everything (its only use: SuperLU's COLAMD order) stays nonsingular
    C = A.tocoo()
    keep = ~dense[C.col] | (C.row == C.col)
    S = sp.csc_matrix((np.abs(C.data[keep]), (C.row[keep], C.col[keep])), shape=A.shape) + sp.identity(n, format="csc")
    try:
        first = np.argsort(spla.spilu(S.tocsc(), drop_tol=0.99, fill_factor=1, permc_spec="COLAMD").perm_c)
    except RuntimeError:
        return None
    return np.concatenate([first[~dense[first]], np.flatnonzero(dense)]).astype(np.int64)


class _Reordered:
    """A factor of A[:, order] that solves with A (the methods :class:`Factor` uses of SuperLU's)."""

    def __init__(self, lu: Any, order: IntArray) -> None:
        self.lu, self.order = lu, order
        self.L, self.U = lu.L, lu.U

    def solve(self, B: FloatArray, trans: str = "N") -> FloatArray:
        if trans == "N":  # A[:, order] y = B, and x[order] = y
            y = np.asarray(self.lu.solve(B))
            x = np.empty_like(y)
            x[self.order] = y
            return x
        # A[:, order]ᵀ = Aᵀ's rows in ``order``: Aᵀ x = B is A[:, order]ᵀ x = B[order]
        return np.asarray(self.lu.solve(np.ascontiguousarray(B[self.order]), trans="T"))


class _OutOfTime(SolverError):
    """An iterative solve ran past the cost of a new factorization (caught here: the direct solve follows)."""


def _lu_work(L: sp.csc_matrix, U: sp.csr_matrix) -> int:
    """Multiply-adds of the LU elimination that produced L and U: step j updates every pair of
    L's column j below the diagonal and U's row j right of it (Gilbert and Peierls, "Sparse
    partial pivoting in time proportional to arithmetic operations")."""
    # in 64 bits: a large complete factor's count overflows the 32-bit index arrays' type
    below = np.diff(L.indptr).astype(np.int64) - 1
    right = np.diff(U.indptr).astype(np.int64) - 1
    return int(np.dot(np.maximum(below, 0), np.maximum(right, 0)) + L.nnz + U.nnz)
