"""The compiled search of an observation table's chain (observed_chain.py ``_compiled_chain``,
_observed_jit.observed_bfs) gives what the level-by-level numpy search gives.

* The same states in the same order and the same transition matrix, entry by entry (to rounding
  where coinciding transitions are summed in another order), for tables over counts (``none``)
  and over routes (``route``), on caps beyond the table's own (its projection) and with a thread
  cap below the request cap, with coordinates that move between phases, three stages, several
  cores with an overhead, CPU weights, and buffers grown while the search runs.
* Rules it does not run (a plain function, a model with a lock) take the numpy search.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.mdp import _kernels
from overtake.mdp import observed_chain as oc
from overtake.mdp.chain import Chain
from overtake.mdp.errors import TruncationError
from overtake.mdp.model import Stage, TandemModel
from overtake.mdp.observation import ObservationSpace
from overtake.mdp.observed_chain import observed_chain, observed_law
from overtake.mdp.observed_tables import starting_tables
from overtake.mdp.policy import Policy
from overtake.mdp.routes import RouteSplit
from overtake.mdp.statespace import Layout, Truncation


def erlang_cox(name: str) -> Stage:
    """Three phases that move into each other (a Coxian), so phase-move events are exercised."""
    T = np.array([[-2.0, 1.5, 0.0], [0.0, -1.0, 0.6], [0.0, 0.0, -0.5]])
    return Stage(name, np.array([0.7, 0.3, 0.0]), T)


_H2 = tandem(0.6, h2_stage("s1", 0.91, 0.55, 5.45), h2_stage("s2", 0.91, 2.75, 27.25))
MODELS = {
    "h2": _H2,
    "coxian": tandem(0.55, erlang_cox("s1"), exp_stage("s2", 1.0)),
    "three": tandem(0.5, h2_stage("a", 0.8, 0.5, 3.0), exp_stage("b", 1.0), h2_stage("c", 0.9, 0.4, 4.0)),
    "cores": tandem(0.6, h2_stage("s1", 0.91, 0.55, 5.45), erlang_cox("s2"), cores=2, overhead=0.05),
    "weights": TandemModel(_H2.arrival_rate, _H2.stages, weights=(1.0, 0.2, 0.7, 0.1)),
}


def same_chain(a: Chain, b: Chain) -> None:
    assert np.array_equal(a.rows, b.rows)
    assert np.array_equal(a.P.indptr, b.P.indptr) and np.array_equal(a.P.indices, b.P.indices)
    np.testing.assert_allclose(b.P.data, a.P.data, rtol=1e-13, atol=1e-15)


def tables(model: TandemModel, layout: Layout, tr: Truncation, routes: RouteSplit | None = None) -> list[Policy]:
    """The observation tables of a few rules on ``tr`` (π(2), π(∞), the restricted heuristic) and
    a random feasible table, as policies."""
    osp = ObservationSpace(model, tr, layout)
    names = ["pi(2)", "pi(inf)"]
    found = starting_tables(osp, names, True, {})
    rng = np.random.default_rng(7)
    found["random"] = osp.repair(rng.integers(0, 3, size=(osp.n_classes, osp.Q)))
    return [osp.policy(A, routes=routes) for A in found.values()]


def check_all(model: TandemModel, layout: Layout, pols: list[Policy], caps: tuple[tuple[int, int | None], ...]) -> None:
    for pol in pols:
        for C, K in caps:
            want = observed_chain(model, layout, pol.actions, max_requests=C, max_threads=K, compiled=False)
            got = observed_chain(model, layout, pol.actions, max_requests=C, max_threads=K, compiled=True)
            same_chain(want, got)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_count_tables_chain_is_the_numpy_searchs_entry_by_entry(name: str) -> None:
    model = MODELS[name]
    layout = Layout.build(model, "none")
    # the table's own cap, beyond it (its projection), and a thread cap below the request cap
    check_all(model, layout, tables(model, layout, Truncation(5, 4)), ((5, None), (9, None), (9, 3)))


def test_a_route_tables_chain_is_the_numpy_searchs() -> None:
    model = MODELS["h2"]
    a = model.stages[-1].alpha[0]
    p = (a - 0.1) / (0.99 - 0.1)
    routes = RouteSplit.build(model, [None, [("light", p, [0.99, 0.01]), ("heavy", 1 - p, [0.1, 0.9])]])
    layout = routes.layout(model)
    check_all(model, layout, tables(model, layout, Truncation(5), routes), ((5, None), (8, None)))


def test_buffers_grow_while_the_search_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain far larger than the first buffers (4,096 states) is found whole: the search stops
    where a buffer filled and resumes after the caller enlarged it."""
    model = MODELS["h2"]
    layout = Layout.build(model, "none")
    pol = tables(model, layout, Truncation(6))[1]  # π(∞)'s table: every request started
    calls: list[int] = []
    real = _kernels.observed_bfs

    def counting(*args):  # type: ignore[no-untyped-def]
        calls.append(int(args[0][0]))
        return real(*args)

    monkeypatch.setattr(_kernels, "observed_bfs", counting)
    got = observed_chain(model, layout, pol.actions, max_requests=30, compiled=True)
    assert got.rows.shape[0] > 4 * 4096 and len(calls) >= 3
    monkeypatch.undo()
    same_chain(observed_chain(model, layout, pol.actions, max_requests=30, compiled=False), got)


def test_the_state_limit_holds() -> None:
    model = MODELS["h2"]
    layout = Layout.build(model, "none")
    pol = tables(model, layout, Truncation(6))[1]
    with pytest.raises(TruncationError, match="exceeds 1000 states"):
        observed_chain(model, layout, pol.actions, max_requests=30, max_states=1000, compiled=True)


def test_other_rules_take_the_numpy_search() -> None:
    model = MODELS["h2"]
    layout = Layout.build(model, "none")
    pol = tables(model, layout, Truncation(5))[0]

    def plain(rows):  # type: ignore[no-untyped-def]
        return pol.actions(rows)

    assert oc._compiled_chain(model, layout, plain, 8, 8, 10**6, force=True) is None
    same_chain(observed_chain(model, layout, plain, max_requests=8),
               observed_chain(model, layout, pol.actions, max_requests=8, compiled=True))
    locked = TandemModel(model.arrival_rate, model.stages, locks=(None, 2))
    lay = Layout.build(locked, "none")
    held = tables(locked, lay, Truncation(5))[0]
    assert oc._compiled_chain(locked, lay, held.actions, 8, 8, 10**6, force=True) is None


def test_metrics_agree_through_either_search() -> None:
    """What the compiled chain feeds: the same exact metrics (E[W] to 1e-12)."""
    model = MODELS["h2"]
    layout = Layout.build(model, "none")
    pol = tables(model, layout, Truncation(6))[2]  # the restricted heuristic's table
    m_fast, _ = observed_law(model, layout, pol.actions, max_requests=12)
    chain = observed_chain(model, layout, pol.actions, max_requests=12, compiled=False)
    m_slow, _ = observed_law(model, layout, lambda r: pol.actions(r), max_requests=12)
    assert chain.rows.shape[0] == m_fast.states
    assert m_fast.mean_response_time == pytest.approx(m_slow.mean_response_time, rel=1e-12)


def test_a_smaller_caps_law_starts_a_larger_caps_solve() -> None:
    """observed_law's ``warm`` from the same rule on a smaller cap: each of that law's states keeps
    its probability in the start vector (matched by rows across the two caps' ranks), the other
    states start at 0, and the answer is the cold solve's to the residual test's accuracy."""
    model = MODELS["h2"]
    layout = Layout.build(model, "none")
    pol = tables(model, layout, Truncation(6))[2]
    m_small, small = observed_law(model, layout, pol.actions, max_requests=9)
    cold, _ = observed_law(model, layout, pol.actions, max_requests=14)
    warm, law = observed_law(model, layout, pol.actions, max_requests=14, warm=small)
    assert warm.mean_response_time == pytest.approx(cold.mean_response_time, rel=1e-8)  # residual 1e-12 either way
    assert small.rows is not None and law.rows is not None
    from overtake.mdp.statespace import Ranker

    keys = Ranker(law.rows.shape[1], 14).rank(law.rows)
    x0 = small.start(14, keys, law.rows)
    assert x0 is not None
    got = {tuple(r): p for r, p in zip(law.rows.tolist(), x0.tolist(), strict=True) if p > 0}
    want = {tuple(r): p for r, p in zip(small.rows.tolist(), small.probs.tolist(), strict=True) if p > 0}
    assert got == want
    assert law.start(9, small.keys, small.rows) is None  # a larger cap's law does not start a smaller one
