"""The compiled search's chains by column (chain.Columns, _kernels_jit.transition_columns) and the
stationary solve that reads them (evaluate.stationary_columns, chain_law).

* The columns and the diagonal are those of the matrix the numpy search assembles from its
  transitions (the same entries; values to rounding in sums of coinciding transitions), for an
  observation table's chain and a baseline's.
* The law solved from the columns is a birth-death chain's geometric law; a state reached only
  along a zero entry is left out, as the general solve leaves it out.
* On an observation table's chain the law is a direct sparse solve's, and it balances the
  arrival flow up across every level of the request count against the flow down.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.mdp import evaluate
from overtake.mdp.baselines import Baseline
from overtake.mdp.chain import Chain, build_chain
from overtake.mdp.evaluate import chain_law, stationary_columns
from overtake.mdp.observation import ObservationSpace
from overtake.mdp.observed_chain import observed_chain
from overtake.mdp.observed_tables import starting_tables
from overtake.mdp.statespace import Layout, Truncation, uniformization_rate

MODEL = tandem(0.6, h2_stage("s1", 0.91, 0.55, 5.45), h2_stage("s2", 0.91, 2.75, 27.25))


def table_chain(C: int, compiled: bool) -> Chain:
    """The chain of the restricted heuristic's ``none`` table on cap ``C``."""
    layout = Layout.build(MODEL, "none")
    osp = ObservationSpace(MODEL, Truncation(6), layout)
    pol = osp.policy(starting_tables(osp, [], True, {})["heuristic (restricted)"])
    return observed_chain(MODEL, layout, pol.actions, max_requests=C, compiled=compiled)


def same_columns(fast: Chain, slow: Chain) -> None:
    assert fast.columns is not None and slow.columns is None
    ptr, idx, val = evaluate._off_diagonal(slow.P.tocsc())
    assert np.array_equal(fast.columns.ptr, ptr) and np.array_equal(fast.columns.idx, idx)
    np.testing.assert_allclose(fast.columns.val, val, rtol=1e-13, atol=0)
    np.testing.assert_allclose(fast.columns.diag, slow.P.diagonal(), rtol=0, atol=1e-15)
    assert np.all(fast.columns.val > 0)


def test_a_tables_columns_are_the_assembled_matrixs() -> None:
    same_columns(table_chain(10, True), table_chain(10, False))


def test_a_baselines_columns_are_the_assembled_matrixs() -> None:
    layout = Layout.build(MODEL, "full")
    rule = Baseline.parse("pi(3)", 2).rule(layout.queue_stage, MODEL.coord_stage())
    fast = build_chain(MODEL, layout, rule, max_requests=9, compiled=True)
    slow = build_chain(MODEL, layout, rule, max_requests=9, compiled=False)
    same_columns(fast, slow)
    assert np.array_equal(fast.P.indptr, slow.P.indptr) and np.array_equal(fast.P.indices, slow.P.indices)


def birth_death(n: int, up: float, down: float) -> tuple[np.ndarray, ...]:
    """A uniformized birth-death chain on 0..n−1 by column: P(k, k+1) = up, P(k, k−1) = down."""
    ptr, idx, val = [0], [], []
    for j in range(n):
        if j > 0:
            idx.append(j - 1)
            val.append(up)
        if j < n - 1:
            idx.append(j + 1)
            val.append(down)
        ptr.append(len(idx))
    diag = np.full(n, 1.0 - up - down)
    diag[0], diag[-1] = 1.0 - up, 1.0 - down
    return (np.array(ptr, dtype=np.int32), np.array(idx, dtype=np.int32), np.array(val), diag)


def from_columns(ptr: np.ndarray, idx: np.ndarray, val: np.ndarray, diag: np.ndarray) -> sp.csr_matrix:
    n = diag.size
    off = sp.csc_matrix((val, idx, ptr), shape=(n, n))
    return (off + sp.diags(diag)).tocsr()


def test_a_birth_death_chains_law_is_geometric() -> None:
    n, up, down = 400, 0.3, 0.45
    ptr, idx, val, diag = birth_death(n, up, down)
    reach, pi = stationary_columns(ptr, idx, val, diag, lambda: from_columns(ptr, idx, val, diag))
    want = (up / down) ** np.arange(n)
    assert np.array_equal(reach, np.arange(n))
    assert pi.sum() == pytest.approx(1.0, rel=1e-14)
    np.testing.assert_allclose(pi, want / want.sum(), rtol=1e-9, atol=1e-11)  # the residual test's 1e-12


def test_a_state_reached_along_a_zero_entry_is_left_out() -> None:
    """State n enters the columns from state 0 with probability 0 (and returns to 0): the general
    solve runs, and its law is the geometric one on 0..n−1."""
    n, up, down = 400, 0.3, 0.45
    ptr, idx, val, diag = birth_death(n, up, down)
    idx = np.concatenate([idx[:ptr[1]], [n], idx[ptr[1]:], [0]]).astype(np.int32)
    val = np.concatenate([val[:ptr[1]], [1.0], val[ptr[1]:], [0.0]])
    ptr = np.concatenate([ptr[:1], ptr[1:] + 1, [ptr[-1] + 2]]).astype(np.int32)
    diag = np.append(diag, 0.0)
    reach, pi = stationary_columns(ptr, idx, val, diag, lambda: from_columns(ptr, idx, val, diag))
    want = (up / down) ** np.arange(n)
    assert np.array_equal(reach, np.arange(n))
    np.testing.assert_allclose(pi, want / want.sum(), rtol=1e-9, atol=1e-11)  # the residual test's 1e-12


def test_a_tables_law_is_a_direct_solves_and_balances_the_flows() -> None:
    C = 14
    ch = table_chain(C, True)
    reach, pi = chain_law(ch)
    n = ch.rows.shape[0]
    assert n > 1000 and np.array_equal(reach, np.arange(n))
    # π₋₀ (I − P)₋₀ = P(0, ·)₋₀ with π(0) = 1, by a complete sparse LU
    P = ch.P
    A = (sp.identity(n, format="csr") - P).T.tocsc()[1:, 1:]
    rest = spla.spsolve(A, np.asarray(P[0, 1:].todense()).ravel())
    direct = np.concatenate([[1.0], rest])
    np.testing.assert_allclose(pi, direct / direct.sum(), rtol=1e-8, atol=1e-11)
    # arrivals lift the request count by one at rate λ below the cap; every other event keeps it or
    # lowers it by one (a completion at the last stage): the flows across each level balance
    total = ch.rows.sum(axis=1)
    lam_u = uniformization_rate(MODEL, C)
    coo = P.tocoo()
    down = total[coo.col] == total[coo.row] - 1
    flow_down = np.bincount(total[coo.row[down]], weights=pi[coo.row[down]] * coo.data[down], minlength=C + 1)
    flow_up = np.bincount(total, weights=pi, minlength=C + 1) * MODEL.arrival_rate / lam_u
    np.testing.assert_allclose(flow_down[1:], flow_up[:-1], rtol=1e-9)
    assert flow_up[C - 1] > 0


def test_a_chain_without_columns_takes_the_general_solve() -> None:
    model = tandem(0.5, exp_stage("a", 1.0), exp_stage("b", 1.0))
    layout = Layout.build(model, "full")
    rule = Baseline.parse("pi(2)", 2).rule(layout.queue_stage, model.coord_stage())
    slow = build_chain(model, layout, rule, max_requests=30, compiled=False)
    fast = build_chain(model, layout, rule, max_requests=30, compiled=True)
    (r1, p1), (r2, p2) = chain_law(slow), chain_law(fast)
    assert np.array_equal(r1, r2)
    np.testing.assert_allclose(p1, p2, rtol=1e-9, atol=1e-15)
