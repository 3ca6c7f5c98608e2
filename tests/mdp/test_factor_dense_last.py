"""The incomplete factor of a table with many dense columns (π(∞)), ordered with those columns last
(factor._dense_last), against plain direct solves of the same system.

* the ordering is a permutation of the columns, with every dense column after every other;
* the reordered factor's solves (A x = b and Aᵀ x = b) are those of A itself: preconditioned by it,
  GMRES and BiCGSTAB meet the residual of a complete LU's answer, with and without the transpose;
* a table without dense columns keeps SuperLU's own ordering (no reordering);
* the exact evaluation of π(∞)'s table on a space above the direct limit, whose factor is the
  reordered incomplete one, has the gain and stationary law of a complete factorization.
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


def test_evaluation_by_the_reordered_factor_is_the_complete_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    osp = _space()
    actions = osp.table(stage_rule(osp.model, "pi(inf)"))
    complete = osp.evaluate(actions, complete=True)
    monkeypatch.setattr(observation_exact, "DIRECT_STATES", 10)  # this space is "large": an incomplete factor
    osp2 = _space()
    ev = osp2.evaluate(actions)
    assert not ev.factor.complete and isinstance(ev.factor.lu, factor_mod._Reordered)
    assert ev.gain == pytest.approx(complete.gain, rel=1e-10)
    assert ev.metrics.mean_response_time == pytest.approx(complete.metrics.mean_response_time, rel=1e-10)
    assert np.abs(ev.post - complete.post).max() <= 1e-10 * complete.post.max()
    assert np.abs(ev.bias - complete.bias).max() <= 1e-9 * np.abs(complete.bias).max()
