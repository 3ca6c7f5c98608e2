"""Exact policy evaluation: the stationary law of the chain a policy induces.

Every policy — π*, a baseline, or a loaded artifact — is evaluated the same way: build the chain
of post-decision states reachable from the empty system, solve πQ = 0 (sparse LU for small chains,
ILU-preconditioned GMRES for large ones, both checked by their residual), and read off

    E[N] = Σ π(x) n(x),   E[W] = E[N] / (λ (1 − P_block))   (Little's law; PASTA for blocking),

per-stage mean sojourn E[N_i]/λ_eff, mean active threads and their distribution.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from .anderson import AndersonMixer, StallRestart
from .csr_product import matvec
from .errors import SolverError
from .lock import Locks
from .model import TandemModel

if TYPE_CHECKING:
    from .chain import Chain

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

_DIRECT_LIMIT = 4_000
_DENSE_LIMIT = 1_500
#: once the kernels are loaded, Gauss–Seidel from this many states on: a dense LU is O(n³) and
#: loses to it on the baselines' chains from a few hundred states (E[W] the same within 1e-8)
_GS_FROM = 250
_GS_ROUNDS = 2_500  # accelerated steps of _GS_SWEEPS sweeps each
#: Gauss–Seidel sweeps between two residual tests and Anderson steps: four rather than two halve
#: the steps on large π* chains and cost no more on the baselines'; the law meets the same test.
_GS_SWEEPS = 4
_AA_MEMORY = 10


@dataclass(frozen=True)
class PolicyMetrics:
    """Stationary performance of one policy on one truncation (times in the model's unit)."""

    mean_response_time: float
    mean_in_system: float
    mean_threads: float
    blocking_probability: float
    arrival_rate: float
    stage_sojourn: tuple[float, ...]
    thread_distribution: tuple[float, ...]
    states: int
    max_requests: int

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stage_sojourn"] = list(self.stage_sojourn)
        d["thread_distribution"] = list(self.thread_distribution)
        return d


def start_vector_pays(states: int) -> bool:
    """Whether a start vector for :func:`stationary_distribution` on a chain of ``states`` states is
    worth mapping: not where a dense LU solves the chain, which takes no start."""
    return states > _DENSE_LIMIT


def solve_sparse(A: sp.csc_matrix, b: FloatArray, x0: FloatArray | None = None) -> FloatArray:
    """Solve A x = b: SuperLU for small systems, ILU-preconditioned GMRES for large lattices."""
    return sparse_solver(A)(b, x0)


def sparse_solver(A: sp.csc_matrix) -> Callable[[FloatArray, FloatArray | None], FloatArray]:
    """Factor A once; the returned ``solve(b, x0)`` reuses the factor for every right-hand side.

    SuperLU up to ``_DIRECT_LIMIT`` unknowns; above, an incomplete LU preconditions GMRES (a
    complete LU of these lattices fills in badly, BENCHMARKS.md ``mdp-peer``), warm-started from
    ``x0`` when given.
    """
    import scipy.sparse.linalg as spla  # slow to import: only where a system is solved

    n = A.shape[0]
    if n <= _DIRECT_LIMIT:
        lu = spla.splu(A, permc_spec="COLAMD")

        def direct(b: FloatArray, x0: FloatArray | None = None) -> FloatArray:
            return np.asarray(lu.solve(b))

        return direct
    ilu = spla.spilu(A, drop_tol=1e-5, fill_factor=15)
    M = spla.LinearOperator(A.shape, ilu.solve)

    def solve(b: FloatArray, x0: FloatArray | None = None) -> FloatArray:
        x, info = spla.gmres(A, b, x0=ilu.solve(b) if x0 is None else x0, M=M, rtol=1e-13, atol=0.0,
                             restart=80, maxiter=300)
        if info != 0:
            raise SolverError(f"sparse solve did not converge (gmres info {info}) on {n} states")
        return np.asarray(x)

    return solve


def reachable(P: sp.csr_matrix, start: int = 0) -> IntArray:
    """Sorted indices of the states reachable from ``start`` along positive entries of P.

    Breadth-first, compiled once the solver kernels are loaded, else one vectorised step per level
    (scipy.sparse.csgraph would do the same but imports scipy.sparse.linalg, slow to load).
    """
    P = sp.csr_matrix(P)
    n = P.shape[0]
    seen = np.zeros(n, dtype=bool)
    if "overtake.mdp._kernels" in sys.modules:  # loaded by a large solve: one compiled pass
        from . import _kernels

        _kernels.reach_mark(P.indptr, P.indices, np.ascontiguousarray(P.data, dtype=np.float64), start, seen)
        return np.flatnonzero(seen)
    seen[start] = True
    frontier = np.array([start], dtype=np.int64)
    indptr, indices, positive = P.indptr, P.indices, P.data > 0
    while frontier.size:
        first = indptr[frontier].astype(np.int64)
        counts = indptr[frontier + 1] - first
        # positions first[i] .. first[i] + counts[i] − 1 of every frontier row, concatenated
        pos = np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        nbrs = indices[pos[positive[pos]]]
        new = np.unique(nbrs[~seen[nbrs]])
        seen[new] = True
        frontier = new
    return np.flatnonzero(seen)


def stationary_distribution(
    P: sp.csr_matrix, start: int = 0, x0: FloatArray | None = None
) -> tuple[IntArray, FloatArray]:
    """Stationary law of the uniformized chain P on the states reachable from ``start``.

    Returns (indices of the reachable states, their probabilities). ``x0`` (over all states of
    P, any scale) starts the iterative solve of large chains, e.g. a similar policy's law mapped
    onto these states; the answer meets the same residual test either way.
    """
    reach, Psub = _closed_subchain(P, start)
    n = reach.size
    # Gauss–Seidel (below) needs the compiled kernels; once a large solve has loaded them it beats
    # a sparse LU (which fills in on these chains) and a dense one from _GS_FROM states on, while a
    # small scenario keeps numba unloaded.
    direct_limit = min(_GS_FROM, _DENSE_LIMIT) if "overtake.mdp._kernels" in sys.modules else _DIRECT_LIMIT
    if n <= direct_limit and (p := _direct_law(Psub)) is not None:
        return reach, p
    Pc = Psub.tocsc()
    guess = None if x0 is None else np.asarray(x0, dtype=np.float64)[reach]
    off_ptr, off_idx, off_val = _off_diagonal(Pc)
    pi, converged = _gauss_seidel_law(off_ptr, off_idx, off_val, Pc.diagonal(), _start_law(n, guess))
    if not converged:
        pi = _krylov_law(Psub, pi)
    pi = np.clip(pi, 0.0, None)
    return reach, pi / pi.sum()


def chain_law(chain: Chain, x0: FloatArray | None = None) -> tuple[IntArray, FloatArray]:
    """:func:`stationary_distribution` of a chain built from the empty system (state 0): from the
    columns of its matrix where the compiled search gave them (:func:`stationary_columns`)."""
    c = chain.columns
    if c is None:
        return stationary_distribution(chain.P, 0, x0)
    return stationary_columns(c.ptr, c.idx, c.val, c.diag, lambda: chain.P, x0)


def stationary_columns(ptr: npt.NDArray[Any], idx: npt.NDArray[Any], val: FloatArray, diag: FloatArray,
                       P: Callable[[], sp.csr_matrix], x0: FloatArray | None = None) -> tuple[IntArray, FloatArray]:
    """:func:`stationary_distribution` of a chain every state of which the empty system (state 0)
    reaches, given as the compiled search assembles it: P's off-diagonal entries by column
    (``ptr``, ``idx``, ``val``) and its diagonal; ``P()`` builds the whole matrix where the
    iteration needs the Krylov solve or the general one. Returns (indices of the reachable states,
    their probabilities) as :func:`stationary_distribution` does."""
    n = diag.size
    # every state is reached when every entry is positive: the search adds a state on a transition
    # into it (else, and on a small chain, the general solve, which also finds the reachable states)
    if n <= min(_GS_FROM, _DENSE_LIMIT) or (val.size and not val.min() > 0) or not np.all(diag >= -1e-9):
        return stationary_distribution(P(), 0, x0)
    guess = None if x0 is None else np.asarray(x0, dtype=np.float64)
    pi, converged = _gauss_seidel_law(ptr, idx, val, diag, _start_law(n, guess))
    if not converged:
        pi = _krylov_law(P(), pi)
    pi = np.clip(pi, 0.0, None)
    return np.arange(n), pi / pi.sum()


def _closed_subchain(P: sp.csr_matrix, start: int) -> tuple[IntArray, sp.csr_matrix]:
    """The states reachable from ``start`` and P restricted to them, checked to be stochastic: a
    policy whose reachable states leak probability has no stationary law there."""
    reach = reachable(P, start)
    # a chain built breadth-first from the empty system is reachable as a whole: no copy then
    Psub = P.tocsr() if reach.size == P.shape[0] else P[reach][:, reach].tocsr()
    if np.any(np.abs(np.asarray(Psub.sum(axis=1)).ravel() - 1.0) > 1e-9):
        raise SolverError("the states reachable from the empty system are not closed under the policy")
    return reach, Psub


def _reduced_system(Psub: sp.csr_matrix) -> tuple[sp.csr_matrix, FloatArray]:
    """π₋₀(I − P)₋₀ = P(0, ·)₋₀ with π(0) = 1, transposed: the matrix and the right-hand side."""
    n = Psub.shape[0]
    A = (sp.identity(n, format="csr") - Psub).T.tocsr()
    return A[1:, 1:], Psub[0, 1:].toarray().ravel()


def _direct_law(Psub: sp.csr_matrix) -> FloatArray | None:
    """The law by one LU of the reduced system, dense (LAPACK, no solver imports) up to
    ``_DENSE_LIMIT`` states, sparse (SuperLU) above; None when its residual fails the test (the
    iterative solve takes over)."""
    A, rhs = _reduced_system(Psub)
    if Psub.shape[0] <= _DENSE_LIMIT:
        rest = np.linalg.solve(A.toarray(), rhs)
    else:
        rest = solve_sparse(A.tocsc(), rhs)
    pi = np.concatenate([[1.0], rest])
    p = pi / pi.sum()
    resid = float(np.abs(Psub.T @ p - p).max() / p.max())
    if resid >= 1e-12:
        return None
    clipped = np.clip(p, 0.0, None)
    law: FloatArray = clipped / clipped.sum()
    return law


def _start_law(n: int, guess: FloatArray | None) -> FloatArray:
    """The iteration's start, scaled to π(0) = 1: ``guess`` when it is usable, else uniform."""
    pi = np.full(n, 1.0 / n)
    if guess is not None and guess[0] > 0 and np.all(np.isfinite(guess)):
        pi = np.maximum(guess / guess[0], 0.0)
    pi[0] = 1.0
    return pi


def _off_diagonal(Pc: sp.csc_matrix) -> tuple[IntArray, IntArray, FloatArray]:
    """P's columns without their diagonal entries (indptr, indices, data): the sweeps skip the
    diagonal, and without its entries they read a sixth less for the same sums."""
    n = Pc.shape[0]
    col = np.repeat(np.arange(n, dtype=Pc.indices.dtype), np.diff(Pc.indptr))
    keep = Pc.indices != col
    off_ptr = np.zeros(n + 1, dtype=Pc.indptr.dtype)
    np.cumsum(np.bincount(col[keep], minlength=n), out=off_ptr[1:])
    return off_ptr, Pc.indices[keep], Pc.data[keep]


def _gauss_seidel_law(off_ptr: npt.NDArray[Any], off_idx: npt.NDArray[Any], off_val: FloatArray, diag: FloatArray,
                      pi: FloatArray) -> tuple[FloatArray, bool]:
    """Gauss–Seidel on π_j(1 − P_jj) = Σ_{i≠j} π_i P_ij with π(0) held at 1, ``_GS_SWEEPS`` sweeps a
    step, Anderson-accelerated (anderson.py): level-ordered states make plain Gauss–Seidel
    converge in a few hundred sweeps, long phases in thousands; sparse LU fills in badly on these
    lattices. P is given by its off-diagonal columns and its diagonal. Returns the last iterate
    (unnormalised) and whether it met the residual test."""
    from . import _kernels  # numba: imported (and its cache loaded) only for large chains

    n = diag.size
    off_T = matvec(sp.csr_matrix((off_val, off_idx, off_ptr), shape=(n, n)))  # P's transpose less its diagonal
    # the kernels are loaded for the sweeps: the mixing runs compiled at any size (on the search's
    # chains of a few thousand states numpy's temporaries cost more than the four sweeps)
    mixer = AndersonMixer(n, _AA_MEMORY, compiled=True)
    stall = StallRestart(mixer, 4 * _AA_MEMORY)
    for _ in range(_GS_ROUNDS):
        y = _kernels.gauss_seidel(off_ptr, off_idx, off_val, diag, pi.copy(), _GS_SWEEPS)
        p = y / y.sum()
        resid = float(np.abs(off_T(p) + (diag - 1.0) * p).max() / p.max())
        if resid < 1e-12:
            return y, True
        stall.observe(resid)
        pi = mixer.step(pi, y - pi)
        pi /= pi[0]
    return pi, False


def _krylov_law(Psub: sp.csr_matrix, pi: FloatArray) -> FloatArray:
    """A chain slow to mix for Gauss–Seidel: a Krylov solve of the reduced system from ``pi``,
    checked by its residual."""
    A, rhs = _reduced_system(Psub)
    rest = solve_sparse(A.tocsc(), rhs, x0=pi[1:])
    pi = np.concatenate([[1.0], rest])
    p = pi / pi.sum()
    resid = float(np.abs(Psub.T @ p - p).max() / p.max())
    if resid > 1e-9:
        raise SolverError(f"stationary solve inaccurate: residual {resid:.2e} on {Psub.shape[0]} states")
    return pi


def metrics(
    model: TandemModel,
    rows: IntArray,
    queue_stage: IntArray,
    pi: FloatArray,
    max_requests: int,
) -> PolicyMetrics:
    """Performance measures from a stationary law over (w, k) state rows, or (w, k, b) with blocked
    threads b of a model with locks (threads all the same)."""
    Q = queue_stage.size
    n_tot = rows.sum(axis=1)
    K = rows[:, Q:].sum(axis=1)
    blocking = float(pi[n_tot >= max_requests].sum())
    lam_eff = model.arrival_rate * (1.0 - blocking)
    EN = float(pi @ n_tot)
    per_stage = np.zeros(model.n_stages)
    for q in range(Q):
        per_stage[queue_stage[q]] += float(pi @ rows[:, q])
    cs = model.coord_stage()
    for d in range(model.n_coords):
        per_stage[cs[d]] += float(pi @ rows[:, Q + d])
    if rows.shape[1] > Q + model.n_coords:  # blocked threads, a column per coordinate of a locked stage
        for t, d in enumerate(Locks.build(model, Q).twin_coord):
            per_stage[cs[d]] += float(pi @ rows[:, Q + model.n_coords + t])
    dist = np.bincount(K, weights=pi)
    return PolicyMetrics(
        mean_response_time=EN / lam_eff,
        mean_in_system=EN,
        mean_threads=float(pi @ K),
        blocking_probability=blocking,
        arrival_rate=model.arrival_rate,
        stage_sojourn=tuple(float(x) for x in per_stage / lam_eff),
        thread_distribution=tuple(float(x) for x in dist),
        states=int(rows.shape[0]),
        max_requests=max_requests,
    )
