"""The iterative exact evaluations renew their preconditioner once it has drifted, with the same
answers; and a factor's work count holds for fills beyond 32-bit products."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.mdp import factor, observation_exact
from overtake.mdp.observation import ObservationSpace
from overtake.mdp.observed_tables import starting_tables
from overtake.mdp.statespace import Layout, Truncation


def _case2(cap: int) -> ObservationSpace:
    model = tandem(0.6, exp_stage("s1", 1.0), h2_stage("s2", 0.91, 0.55, 5.45))  # Table 1, case 2
    return ObservationSpace(model, Truncation(cap), Layout.build(model, "none"))


def test_a_drifted_preconditioner_is_renewed_by_the_next_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """An iterative evaluation that took more than REFRESH_ITERATIONS marks the preconditioner
    stale: the next table is factored instead of iterated, its factor preconditions the tables
    after it, and every answer agrees with a space that factors every table (1e-9 relative)."""
    monkeypatch.setattr(observation_exact, "DIRECT_STATES", 0)  # the iterative path on this small chain
    monkeypatch.setattr(observation_exact, "REFRESH_ITERATIONS", 0)  # any iteration counts as drift
    osp, ref = _case2(7), _case2(7)
    start = starting_tables(osp, ["pi(inf)", "pi(2)"], False, {})
    A, B = start["pi(inf)"], start["pi(2)"]
    assert np.any(A != B)
    ev = osp.evaluate(A)
    first = osp.exact.preconditioner
    assert first is ev.factor and not osp.exact.stale
    iterated = osp.evaluate(B, near=ev)
    assert not iterated.refactored and osp.exact.stale  # iterated with the first factor, then marked
    renewed = osp.evaluate(A, near=iterated)
    assert renewed.refactored and not osp.exact.stale
    assert osp.exact.preconditioner is renewed.factor and renewed.factor is not first
    # the search's solver state carries the mark: a search restored from it factors its next table
    marked = osp.exact.state()._replace(stale=True)
    osp.exact.restore(marked)
    assert osp.exact.stale and osp.evaluate(B, near=renewed).refactored
    for T, got in ((B, iterated), (A, renewed)):
        want = ref.evaluate(T)
        assert got.gain == pytest.approx(want.gain, rel=1e-9)
        assert got.metrics.mean_response_time == pytest.approx(want.metrics.mean_response_time, rel=1e-9)
        assert np.abs(got.post - want.post).max() <= 1e-9 * want.post.max()
        assert np.abs(got.bias - want.bias).max() <= 1e-9 * np.abs(want.bias).max()


def test_a_drift_below_the_threshold_keeps_the_preconditioner(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observation_exact, "DIRECT_STATES", 0)
    monkeypatch.setattr(observation_exact, "REFRESH_ITERATIONS", 10**9)
    osp = _case2(7)
    start = starting_tables(osp, ["pi(inf)", "pi(2)"], False, {})
    ev = osp.evaluate(start["pi(inf)"])
    iterated = osp.evaluate(start["pi(2)"], near=ev)
    again = osp.evaluate(start["pi(inf)"], near=iterated)
    assert not iterated.refactored and not again.refactored and not osp.exact.stale
    assert osp.exact.preconditioner is ev.factor
    assert ev.factor.iterations > 0  # the last iterative solve's count is kept


def test_lu_work_counts_past_32_bit_products() -> None:
    """Gilbert and Peierls' count for a factor whose column and row fill exceed 2³¹ products:
    L's first column and U's first row full (int32 index arrays, as SuperLU's factors have)."""
    n = 50_001
    ar = np.arange(n, dtype=np.int32)
    L = sp.csc_matrix((np.ones(2 * n - 1), np.concatenate([ar, ar[1:]]),
                       np.concatenate([[0, n], n + np.arange(1, n, dtype=np.int32)])), shape=(n, n))
    U = sp.csr_matrix((np.ones(2 * n - 1), np.concatenate([ar, ar[1:]]),
                       np.concatenate([[0, n], n + np.arange(1, n, dtype=np.int32)])), shape=(n, n))
    assert L.indptr.dtype == np.int32 and U.indptr.dtype == np.int32
    work = factor._lu_work(L, U)
    assert work == (n - 1) * (n - 1) + L.nnz + U.nnz
    assert work > 2**31
