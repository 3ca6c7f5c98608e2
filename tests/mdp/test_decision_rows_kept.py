"""The decision rows a search's tables share, built once per class and action (DecisionMatrix.rows),
against rows built afresh from the multinomial draws.

* the rows of any states (whole classes, or a few states of a class, as the low-rank update asks)
  are exactly those built afresh, entry for entry;
* a sequence of tables on one space gives the decision matrices and transitions, bit for bit, of
  a fresh space built for each table;
* a class's rows under an action are built once: asking again builds nothing, and a cache emptied
  at its bound gives the same rows.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
import scipy.sparse as sp
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.mdp import observation_actions
from overtake.mdp.observation import ObservationSpace
from overtake.mdp.observed_tables import starting_tables
from overtake.mdp.statespace import Layout, Truncation

IntArray = npt.NDArray[np.int64]


def _space() -> ObservationSpace:
    model = tandem(0.6, h2_stage("s1", 0.91, 0.55, 5.45), exp_stage("s2", 5.0))  # Table 1, case 7
    return ObservationSpace(model, Truncation(7), Layout.build(model, "none"))


def _tables(osp: ObservationSpace, n: int) -> list[IntArray]:
    tables = list(starting_tables(osp, ["pi(1)", "pi(2)", "pi(inf)"], True, {}).values())
    rng = np.random.default_rng(11)
    for _ in range(n):  # one class to nearly all classes changed, as the search's trials
        A = tables[int(rng.integers(len(tables)))].copy()
        other = tables[int(rng.integers(len(tables)))]
        sel = rng.choice(osp.n_classes, size=int(rng.integers(1, osp.n_classes)), replace=False)
        A[sel] = other[sel]
        tables.append(osp.repair(A))
    return tables


def _entries(src: IntArray, idx: IntArray, prob: npt.NDArray[np.float64]) -> tuple[IntArray, IntArray, npt.NDArray[np.float64]]:
    order = np.lexsort((idx, src))
    return src[order], idx[order], prob[order]


def _same_csr(a: sp.csr_matrix, b: sp.csr_matrix) -> None:
    a, b = a.tocsr(), b.tocsr()
    a.sort_indices()
    b.sort_indices()
    assert np.array_equal(a.indptr, b.indptr) and np.array_equal(a.indices, b.indices)
    assert np.array_equal(a.data, b.data)  # bit for bit


def test_rows_of_any_states_are_the_fresh_rows() -> None:
    osp = _space()
    dm = osp.decisions
    rng = np.random.default_rng(3)
    for A in _tables(osp, 6):
        counts = np.asarray(A, dtype=np.int64)[osp.class_of]
        for states in (np.flatnonzero(np.isin(osp.class_of, rng.choice(osp.n_classes, 40, replace=False))),
                       np.sort(rng.choice(osp.size, 25, replace=False))):  # whole classes; a few states of many
            got = _entries(*dm.rows(states, counts))
            want = _entries(*dm._built(states, counts))
            assert got[0].size == want[0].size and set(got[0].tolist()) <= set(states.tolist())
            for x, y in zip(got, want):
                assert np.array_equal(x, y)


def test_decision_matrices_and_transitions_are_bit_for_bit_the_fresh_ones() -> None:
    osp = _space()
    for A in _tables(osp, 8):
        fresh = ObservationSpace(osp.model, osp.space.trunc, osp.layout)
        _same_csr(osp.decision_matrix(A), fresh.decision_matrix(A))
        _same_csr(osp.transition(A), fresh.transition(A))


def test_a_class_and_action_is_built_once(monkeypatch: pytest.MonkeyPatch) -> None:
    osp = _space()
    dm = osp.decisions
    built: list[int] = []
    plain = observation_actions.DecisionMatrix._built

    def counting(self, states, counts):  # type: ignore[no-untyped-def]
        built.append(states.size)
        return plain(self, states, counts)

    monkeypatch.setattr(observation_actions.DecisionMatrix, "_built", counting)
    A = _tables(osp, 0)[0]
    counts = np.asarray(A, dtype=np.int64)[osp.class_of]
    everything = np.arange(osp.size)
    first = _entries(*dm.rows(everything, counts))
    assert built == [osp.size]
    again = _entries(*dm.rows(everything, counts))
    assert built == [osp.size]  # nothing built the second time
    for x, y in zip(first, again):
        assert np.array_equal(x, y)
    monkeypatch.setattr(observation_actions, "ROWS_KEPT", 0)  # over the bound: emptied, built again
    third = _entries(*dm.rows(everything, counts))
    assert built == [osp.size, osp.size]
    for x, y in zip(first, third):
        assert np.array_equal(x, y)
