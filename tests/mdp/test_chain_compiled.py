"""The compiled chain builder (chain.py ``_build_compiled``, _kernels_jit.chain_bfs) and the other
compiled passes give what the numpy code gives.

* A policy table's or a baseline's chain, built by the compiled breadth-first search, has the same
  states in the same order and the same transition matrix, entry by entry, as the level-by-level
  numpy search (to rounding where coinciding transitions are summed in another order), on both
  layouts, with coordinates that move between phases, three stages, several cores with an
  overhead, CPU weights, and buffers grown while the search runs.
* A state space's event matrix built by one compiled pass per row is the numpy construction's
  bit for bit (to rounding with CPU weights).
* evaluate.reachable's compiled pass finds the numpy pass's states; the Bellman step that also
  writes the RVI residual writes numpy's ``TV - TV[0] - V`` bit for bit; the stationary solve's
  diagonal-free sweeps are the sweeps that skip the diagonal.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.mdp import _kernels
from overtake.mdp import chain as chain_mod
from overtake.mdp.average_cost import anderson_rvi
from overtake.mdp.baselines import Baseline
from overtake.mdp.chain import build_chain
from overtake.mdp.errors import TruncationError
from overtake.mdp.evaluate import reachable, stationary_distribution
from overtake.mdp.model import Stage, TandemModel
from overtake.mdp.policy import Policy
from overtake.mdp.rule_evaluation import evaluate_rule
from overtake.mdp.statespace import Layout, StateSpace, Truncation


def erlang_cox(name: str) -> Stage:
    """Three phases that move into each other (a Coxian), so phase-move events are exercised."""
    T = np.array([[-2.0, 1.5, 0.0], [0.0, -1.0, 0.6], [0.0, 0.0, -0.5]])
    return Stage(name, np.array([0.7, 0.3, 0.0]), T)


MODELS = {
    "h2": tandem(0.6, h2_stage("s1", 0.91, 0.55, 5.45), h2_stage("s2", 0.91, 2.75, 27.25)),
    "coxian": tandem(0.55, erlang_cox("s1"), exp_stage("s2", 1.0)),
    "three": tandem(0.5, h2_stage("a", 0.8, 0.5, 3.0), exp_stage("b", 1.0), h2_stage("c", 0.9, 0.4, 4.0)),
    "cores": tandem(0.6, h2_stage("s1", 0.91, 0.55, 5.45), h2_stage("s2", 0.91, 0.55, 5.45), cores=2,
                    overhead=0.05),
}


def same_chain(a: chain_mod.Chain, b: chain_mod.Chain) -> None:
    assert np.array_equal(a.rows, b.rows)
    assert np.array_equal(a.P.indptr, b.P.indptr) and np.array_equal(a.P.indices, b.P.indices)
    np.testing.assert_allclose(b.P.data, a.P.data, rtol=0, atol=1e-15)


def solved_policy(model: TandemModel, tr: Truncation, phase_info: str = "full") -> Policy:
    space = StateSpace(model, tr, phase_info)  # type: ignore[arg-type]
    return Policy.from_decision(space, anderson_rvi(space, tol=1e-6).decision)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_policy_tables_chain_is_the_numpy_searchs_entry_by_entry(name: str) -> None:
    model = MODELS[name]
    pol = solved_policy(model, Truncation(5, 3))
    lay = Layout.build(model, "full")
    for C, K in ((5, 3), (9, 3), (9, 2)):  # beyond the table's caps: its projection
        want = build_chain(model, lay, pol.actions, max_requests=C, max_threads=K, compiled=False)
        got = build_chain(model, lay, pol.actions, max_requests=C, max_threads=K, compiled=True)
        same_chain(want, got)


def test_a_phase_at_start_policys_chain_is_the_numpy_searchs() -> None:
    model = MODELS["h2"]
    pol = solved_policy(model, Truncation(6, 3), "start")
    for C in (6, 10):
        want = build_chain(model, pol.layout, pol.actions, max_requests=C, max_threads=3, compiled=False)
        got = build_chain(model, pol.layout, pol.actions, max_requests=C, max_threads=3, compiled=True)
        same_chain(want, got)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("baseline", ["pi(1)", "pi(2)", "pi(inf)", "ones", "pi(2,1)"])
def test_a_baselines_chain_is_the_numpy_searchs(name: str, baseline: str) -> None:
    model = MODELS[name]
    N = model.n_stages
    if baseline == "ones":
        baseline = "pi(" + ",".join(["1"] * N) + ")"
    if baseline == "pi(2,1)":
        baseline = "pi(" + ",".join(["2"] + ["1"] * (N - 1)) + ")"
    b = Baseline.parse(baseline, N)
    lay = Layout.build(model, "start")
    rule = b.rule(lay.queue_stage, model.coord_stage())
    for C in (6, 14):
        want = build_chain(model, lay, rule, max_requests=C, max_threads=b.max_threads, compiled=False)
        got = build_chain(model, lay, rule, max_requests=C, max_threads=b.max_threads, compiled=True)
        same_chain(want, got)


def test_cpu_weights_give_the_numpy_searchs_chain() -> None:
    """Weighted sharing divides c(K) by Σ k_d w_d (a sum the numpy search takes by a matrix product:
    rates equal to rounding)."""
    base = MODELS["h2"]
    model = TandemModel(base.arrival_rate, base.stages, weights=(1.0, 0.2, 0.7, 0.1))
    lay = Layout.build(model, "start")
    rule = Baseline.parse("pi(inf)", 2).rule(lay.queue_stage, model.coord_stage())
    want = build_chain(model, lay, rule, max_requests=12, compiled=False)
    got = build_chain(model, lay, rule, max_requests=12, compiled=True)
    assert np.array_equal(want.rows, got.rows) and np.array_equal(want.P.indices, got.P.indices)
    np.testing.assert_allclose(got.P.data, want.P.data, rtol=1e-13, atol=1e-15)


def test_buffers_grow_while_the_search_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain far larger than the first buffers (4,096 states) is found whole: the search stops
    where a buffer filled and resumes after the caller enlarged it (several times here)."""
    model = MODELS["h2"]
    lay = Layout.build(model, "start")
    rule = Baseline.parse("pi(inf)", 2).rule(lay.queue_stage, model.coord_stage())
    calls: list[int] = []
    real = _kernels.chain_bfs

    def counting(*args):  # type: ignore[no-untyped-def]
        calls.append(int(args[0][0]))
        return real(*args)

    monkeypatch.setattr(_kernels, "chain_bfs", counting)
    got = build_chain(model, lay, rule, max_requests=24, compiled=True)
    assert got.rows.shape[0] == 20475 and len(calls) >= 3  # C(24 + 4, 4) thread vectors
    monkeypatch.undo()
    same_chain(build_chain(model, lay, rule, max_requests=24, compiled=False), got)


def test_the_state_limit_holds() -> None:
    model = MODELS["h2"]
    lay = Layout.build(model, "start")
    rule = Baseline.parse("pi(inf)", 2).rule(lay.queue_stage, model.coord_stage())
    with pytest.raises(TruncationError, match="exceeds 1000 states"):
        build_chain(model, lay, rule, max_requests=30, max_states=1000, compiled=True)


def test_other_rules_take_the_numpy_search() -> None:
    model = MODELS["h2"]
    lay = Layout.build(model, "start")
    rule = Baseline.parse("pi(2)", 2).rule(lay.queue_stage, model.coord_stage())

    def plain(rows):  # type: ignore[no-untyped-def]
        return rule(rows)

    assert chain_mod._build_compiled(model, lay, plain, 8, 2, 10**6, force=True) is None
    same_chain(build_chain(model, lay, plain, max_requests=8, max_threads=2),
               build_chain(model, lay, rule, max_requests=8, max_threads=2, compiled=True))


def test_evaluations_agree_through_either_search() -> None:
    """What the compiled chain feeds: the same exact metrics (E[W] to 1e-12)."""
    model = MODELS["h2"]
    pol = solved_policy(model, Truncation(6, 3))
    lay = Layout.build(model, "full")
    a = evaluate_rule(model, lay, pol.actions, max_requests=12, max_threads=3)
    chain = build_chain(model, lay, pol.actions, max_requests=12, max_threads=3, compiled=False)
    reach, pi = stationary_distribution(chain.P)
    ew = float(pi @ chain.rows[reach].sum(axis=1)) / (model.arrival_rate * (1 - pi[chain.rows[reach].sum(axis=1) >= 12].sum()))
    assert a.mean_response_time == pytest.approx(ew, rel=1e-12)


def test_compiled_reachability_is_the_numpy_passs(monkeypatch: pytest.MonkeyPatch) -> None:
    model = MODELS["h2"]
    space = StateSpace(model, Truncation(7, 3))
    from overtake.mdp.average_cost import induced_matrix

    P = induced_matrix(space, anderson_rvi(space, tol=1e-6).decision)
    fast = reachable(P)
    import sys

    monkeypatch.delitem(sys.modules, "overtake.mdp._kernels")  # the numpy pass runs without the kernels
    slow = reachable(P)
    assert fast.size < space.size and np.array_equal(fast, slow)


def test_the_bellman_step_writes_numpys_residual() -> None:
    model = MODELS["h2"]
    space = StateSpace(model, Truncation(9, 4))
    assert space.size >= 5_000
    from overtake.mdp.bellman import ActionIndex

    ai = ActionIndex(space)
    order, nb = ai.box_order
    PE = space.event_matrix
    V = np.random.default_rng(1).normal(size=space.size)
    G, TV, f = np.empty(space.size), np.empty(space.size), np.empty(space.size)
    lo, hi = _kernels.bellman_residual(PE.indptr, PE.indices, PE.data, space.cost / space.rate, V, ai.idle, order, nb,
                                       G, TV, f)
    H, _ = ai.box_minimum(V)
    np.testing.assert_allclose(TV, space.cost / space.rate + PE @ H, rtol=1e-12, atol=1e-14)
    assert np.array_equal(f, TV - TV[0] - V)
    assert (lo, hi) == (float((TV - V).min()), float((TV - V).max()))


def test_gauss_seidel_on_the_matrix_without_its_diagonal_is_the_sweep_that_skips_it() -> None:
    """evaluate.stationary_distribution sweeps the matrix without its diagonal: bit for bit the
    sweeps over the whole matrix, which skip the diagonal entries."""
    model = MODELS["h2"]
    space = StateSpace(model, Truncation(8, 3))
    from overtake.mdp.average_cost import induced_matrix

    P = induced_matrix(space, anderson_rvi(space, tol=1e-6).decision)
    Pc = P.tocsc()
    y = np.random.default_rng(2).random(P.shape[0])
    off = Pc.copy()
    off.setdiag(0.0)
    off.eliminate_zeros()
    a = _kernels.gauss_seidel(Pc.indptr, Pc.indices, Pc.data, Pc.diagonal(), y.copy(), 3)
    b = _kernels.gauss_seidel(off.indptr, off.indices, off.data, Pc.diagonal(), y.copy(), 3)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("phase_info", ["full", "start"])
def test_the_compiled_event_matrix_is_the_numpy_one_bit_for_bit(name: str, phase_info: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    model = MODELS[name]
    space = StateSpace(model, Truncation(6, 3), phase_info)  # type: ignore[arg-type]
    fast = space.compiled_event_matrix(force=True)
    assert fast is not None
    monkeypatch.setattr(StateSpace, "compiled_event_matrix", lambda self, force=False: None)
    slow = StateSpace(model, Truncation(6, 3), phase_info).event_matrix  # type: ignore[arg-type]
    for attr in ("indptr", "indices", "data"):
        assert np.array_equal(getattr(fast, attr), getattr(slow, attr)), attr


def test_the_compiled_event_matrix_with_weights_and_a_binary_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU weights (Σ k_d w_d summed in another order: equal to rounding), and destinations found by
    a binary search of the keys where a position per rank would be too large."""
    base = MODELS["h2"]
    model = TandemModel(base.arrival_rate, base.stages, weights=(1.0, 0.2, 0.7, 0.1))
    space = StateSpace(model, Truncation(7, 3))
    from overtake.mdp import statespace

    monkeypatch.setattr(statespace, "_DENSE_RANKS", 0)
    fast = space.compiled_event_matrix(force=True)
    monkeypatch.setattr(StateSpace, "compiled_event_matrix", lambda self, force=False: None)
    slow = StateSpace(model, Truncation(7, 3)).event_matrix
    assert fast is not None and np.array_equal(fast.indptr, slow.indptr) and np.array_equal(fast.indices, slow.indices)
    np.testing.assert_allclose(fast.data, slow.data, rtol=1e-13, atol=1e-16)


def test_anderson_steps_through_scipys_product_equal_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """solve.anderson_rvi's Bellman step through scipy's CSR product (box minimum, product, residual
    pass) gives the fused kernel's iterates bit for bit: the same sums in the same order."""
    import importlib

    solve_mod = importlib.import_module("overtake.mdp.average_cost")
    model = MODELS["h2"]
    space = StateSpace(model, Truncation(9, 4))
    assert space.size >= 5_000 and solve_mod._scipy_matvec(space.event_matrix) is not None
    a = anderson_rvi(space, tol=1e-7)
    monkeypatch.setattr(solve_mod, "_scipy_matvec", lambda PE: None)
    b = anderson_rvi(space, tol=1e-7)
    assert a.sweeps == b.sweeps and np.array_equal(a.bias, b.bias) and np.array_equal(a.decision, b.decision)
    assert a.gain_bounds == b.gain_bounds


@pytest.mark.parametrize("k", [1, 2, 3, 5, 6])
def test_the_anderson_history_pass_sums_each_row_in_index_order(k: int) -> None:
    """_kernels_jit.anderson_history reads stored rows in pairs; each dot product still adds its
    terms in index order: equal, bit for bit, to a plain left-to-right sum."""
    rng = np.random.default_rng(k)
    n, m, head = 257, 6, k - 1
    x, f, xo, fo = (rng.normal(size=n) for _ in range(4))
    df, dxf = rng.normal(size=(m, n)), rng.normal(size=(m, n))
    both = np.empty((k, 2))
    _kernels.anderson_history(x, f, xo, fo, df, dxf, head, k, both)
    assert np.array_equal(df[head], f - fo) and np.array_equal(dxf[head], x - xo + (f - fo))
    for j in range(k):
        s0 = s1 = 0.0
        for i in range(n):
            s0 += df[j, i] * df[head, i]
            s1 += df[j, i] * f[i]
        assert (both[j, 0], both[j, 1]) == (s0, s1)
