"""The factors of a table with many dense columns (π(∞)), ordered with those columns last
(factor._dense_last), against plain direct solves of the same system.

* the ordering is a permutation of the columns, with every dense column after every other;
* the reordered factor's solves (A x = b and Aᵀ x = b) are those of A itself: preconditioned by it,
  GMRES and BiCGSTAB meet the residual of a complete LU's answer, with and without the transpose;
* a table without dense columns keeps SuperLU's own ordering (no reordering);
* a reordered complete factor solves as SuperLU's own LU does (to rounding);
* the exact evaluation of π(∞)'s table through a reordered factor, complete or incomplete (on a
  space above the direct limit), has the gain, law and bias of independent solves.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse.linalg as spla
from support.mdp_helpers import h2_stage, tandem

from overtake.mdp import factor as factor_mod
from overtake.mdp import observation_exact
from overtake.mdp.factor import Factor
from overtake.mdp.observation import ObservationSpace
from overtake.mdp.observed_tables import stage_rule
from overtake.mdp.statespace import Layout, Truncation


def _space() -> ObservationSpace:
    model = tandem(0.6, h2_stage("s1", 0.91, 0.55, 5.45), h2_stage("s2", 0.91, 2.75, 27.25))  # Table 1, case 8
    return ObservationSpace(model, Truncation(8), Layout.build(model, "none"))


def _system(osp: ObservationSpace, rule: str):  # type: ignore[no-untyped-def]
    A = osp.table(stage_rule(osp.model, rule))
    return A, osp.exact.system(A)


def test_dense_columns_go_last_in_a_permutation() -> None:
    osp = _space()
    _, eq = _system(osp, "pi(inf)")
    order = factor_mod._dense_last(eq.A)
    assert order is not None
    n = eq.A.shape[0]
    assert np.array_equal(np.sort(order), np.arange(n))
    dense = np.diff(eq.A.indptr) > factor_mod.DENSE_COLUMN
    assert dense.sum() >= factor_mod.DENSE_SHARE * n
    placed = dense[order]
    first_dense = int(np.argmax(placed))
    assert placed[first_dense:].all() and not placed[:first_dense].any()


def test_a_table_without_dense_columns_keeps_superlus_order() -> None:
    osp = _space()
    _, eq = _system(osp, "pi(1)")
    assert factor_mod._dense_last(eq.A) is None
    assert not isinstance(Factor(eq.A, np.zeros((1, 1), dtype=np.int64), complete=False).lu, factor_mod._Reordered)


@pytest.mark.parametrize("trans", [False, True])
def test_reordered_incomplete_factor_solves_for_a_itself(trans: bool) -> None:
    osp = _space()
    actions, eq = _system(osp, "pi(inf)")
    f = Factor(eq.A, actions, complete=False)
    assert isinstance(f.lu, factor_mod._Reordered)
    B = eq.rhs if not trans else eq.p0[:, None]
    exact = spla.splu(eq.A.tocsc()).solve(B, trans="T" if trans else "N")
    op = eq.A.T.tocsr() if trans else eq.A
    for x in (f.solve(eq.A, B, trans=trans), f.iterate(eq.A, B, np.zeros_like(B), budget=500, trans=trans)):
        assert x is not None
        assert np.linalg.norm(op @ x - B) <= 1e-11 * np.linalg.norm(B)
        assert np.abs(x - exact).max() <= 1e-8 * np.abs(exact).max()
    # one preconditioner application is close to A⁻¹ (an incomplete factor in the right order)
    y = f.lu.solve(B[:, 0], trans="T" if trans else "N")
    assert np.linalg.norm(op @ y - B[:, 0]) <= 0.1 * np.linalg.norm(B[:, 0])


@pytest.mark.parametrize("trans", [False, True])
def test_reordered_complete_factor_is_a_direct_solve(trans: bool) -> None:
    osp = _space()
    actions, eq = _system(osp, "pi(inf)")
    f = Factor(eq.A, actions)
    assert f.complete and isinstance(f.lu, factor_mod._Reordered)
    B = eq.rhs if not trans else eq.p0[:, None]
    exact = spla.splu(eq.A.tocsc(), permc_spec="COLAMD").solve(B, trans="T" if trans else "N")
    x = f.solve(eq.A, B, trans=trans)
    assert x is not None
    assert np.abs(x - exact).max() <= 1e-11 * np.abs(exact).max()


@pytest.mark.parametrize("large", [False, True])
def test_evaluation_by_a_reordered_factor_is_exact(monkeypatch: pytest.MonkeyPatch, large: bool) -> None:
    """π(∞)'s evaluation through a reordered factor (complete; incomplete on a space made "large")
    against a plain sparse LU's (and its law against Gauss–Seidel's)."""
    osp = _space()
    actions, eq = _system(osp, "pi(inf)")
    plain = spla.splu(eq.A.tocsc(), permc_spec="COLAMD")
    u = plain.solve(eq.rhs)
    gamma = (eq.cost[0] + eq.p0 @ u[:, 0]) / (1.0 + eq.p0 @ u[:, 1])
    g_ref = gamma * osp.space.rate
    h_ref = np.concatenate([[0.0], u[:, 0] - gamma * u[:, 1]])
    law_ref = np.concatenate([[1.0], plain.solve(eq.p0, trans="T")])
    law_ref /= law_ref.sum()
    assert np.abs(osp.stationary_gain(actions)[1] - law_ref).max() <= 1e-8 * law_ref.max()  # a third method
    if large:
        monkeypatch.setattr(observation_exact, "DIRECT_STATES", 10)
    ev = _space().evaluate(actions)
    assert ev.factor.complete is not large and isinstance(ev.factor.lu, factor_mod._Reordered)
    assert ev.gain == pytest.approx(g_ref, rel=1e-10)
    assert np.abs(ev.post - law_ref).max() <= 1e-9 * law_ref.max()
    assert np.abs(ev.bias - h_ref).max() <= 1e-9 * np.abs(h_ref).max()
