"""The spawn minimisation H (van der Weij et al., "Dynamic thread assignment", §2) against brute-force enumeration of the box."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from overtake.mdp.bellman import ActionIndex, brute_force_minimum
from overtake.mdp.statespace import StateSpace, Truncation


@pytest.mark.parametrize("cap,k_max", [(5, 5), (6, 3)])
def test_box_minimum_equals_brute_force(case4, cap, k_max):
    space = StateSpace(case4, Truncation(cap, k_max))
    ai = ActionIndex(space)
    rng = np.random.default_rng(7)
    for _ in range(3):
        V = rng.normal(size=space.size)
        H, A = ai.box_minimum(V)
        sample = rng.choice(space.size, size=400, replace=False)
        for s in sample:
            assert H[s] == pytest.approx(brute_force_minimum(space, V, int(s)), abs=0)
            if np.isfinite(H[s]):
                assert V[A[s]] == H[s]  # the minimiser attains it


def test_spawn_recursion_equals_box_minimum_when_phases_are_known(case4):
    space = StateSpace(case4, Truncation(6, 4))
    ai = ActionIndex(space)
    V = np.random.default_rng(3).normal(size=space.size)
    H1, _ = ai.box_minimum(V)
    H2, _ = ai.spawn_minimum(V)
    np.testing.assert_array_equal(H1, H2)


def test_spawn_recursion_phase_at_start_matches_expectimin_by_hand(case4):
    """Random phase on spawn: H(y) = min(V(y), Σ_j α_j H(y_j)) computed by explicit recursion."""
    space = StateSpace(case4, Truncation(4, 3), phase_info="start")
    ai = ActionIndex(space)
    V = np.random.default_rng(5).normal(size=space.size)
    H, _ = ai.spawn_minimum(V)
    Q = space.Q

    def rec(row: np.ndarray) -> float:
        i = space.index(row[None, :])[0]
        idle = row[Q:].sum() == 0 and row.sum() > 0
        best = np.inf if idle else V[i]
        if row[Q:].sum() < space.k_max:
            for q in range(Q):
                if row[q] > 0:
                    v = 0.0
                    for d, p in space.layout.spawn[q]:
                        r2 = row.copy()
                        r2[q] -= 1
                        r2[Q + d] += 1
                        v += p * rec(r2)
                    best = min(best, v)
        return best

    for s in range(0, space.size, 7):
        assert H[s] == pytest.approx(rec(space.rows[s].copy()), rel=1e-12, abs=1e-12)


def test_idle_post_states_are_never_chosen(case4):
    space = StateSpace(case4, Truncation(5, 3))
    V = -np.asarray(space.n_total, dtype=float) * 0  # all equal: ties go to fewer threads
    H, A = ActionIndex(space).box_minimum(V)
    post = space.rows[A]
    idle = (post[:, space.Q:].sum(axis=1) == 0) & (post.sum(axis=1) > 0)
    assert not idle.any()
    assert list(itertools.islice(A, 1)) == [0]
