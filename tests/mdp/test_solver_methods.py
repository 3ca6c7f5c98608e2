"""Every solver method against relative value iteration, the reference.

RVI, Anderson-accelerated RVI and policy iteration solve the same truncated MDP: their average
costs must agree to 1e-9 relative on exponential, hyperexponential (H2) and Erlang stages, in both
queue layouts, and the default method must reproduce a van der Weij et al., "Dynamic thread assignment" Table 1 row.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.mdp.anderson import AndersonMixer
from overtake.mdp.average_cost import anderson_rvi, induced_matrix, policy_iteration, relative_value_iteration, solve_space
from overtake.mdp.comparison import compare
from overtake.mdp.evaluate import stationary_distribution
from overtake.mdp.model import Stage
from overtake.mdp.policy import _trim_longest
from overtake.mdp.statespace import Ranker, StateSpace, Truncation


def erlang_stage(name: str, k: int, mean: float) -> Stage:
    rate = k / mean
    T = np.diag(np.full(k, -rate)) + np.diag(np.full(k - 1, rate), 1)
    return Stage(name, np.eye(k)[0], T)


MODELS = {
    "exp-exp": (lambda: tandem(0.6, exp_stage("a", 1.0), exp_stage("b", 5.0)), Truncation(8, 3), "full"),
    "h2-h2": (lambda: tandem(0.6, h2_stage("a", 0.91, 0.55, 5.45), h2_stage("b", 0.91, 2.75, 27.25)),
              Truncation(6, 3), "full"),
    "erlang-h2": (lambda: tandem(0.7, erlang_stage("a", 3, 1.0), h2_stage("b", 0.9, 0.5, 5.5)),
                  Truncation(6, 3), "full"),
    "h2-h2 phase at start": (lambda: tandem(0.6, h2_stage("a", 0.91, 0.55, 5.45), h2_stage("b", 0.91, 0.55, 5.45)),
                             Truncation(7, 3), "start"),
    "three stages": (lambda: tandem(0.5, h2_stage("a", 0.9, 0.5, 5.5), exp_stage("b", 1.0), erlang_stage("c", 2, 1.0)),
                     Truncation(5, 2), "full"),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_method_agrees_with_rvi_to_1e_9(name):
    build, trunc, info = MODELS[name]
    space = StateSpace(build(), trunc, info)
    ref = relative_value_iteration(space, tol=1e-12)
    assert ref.converged
    aa = anderson_rvi(space, tol=1e-12)
    pi = policy_iteration(space)
    assert aa.converged and pi.converged
    g = ref.gain
    for res in (aa, pi):
        assert res.gain == pytest.approx(g, rel=1e-9), res.method
        # the returned policy's exact gain (stationary law of its chain) is the optimum too
        reach, p = stationary_distribution(induced_matrix(space, res.decision))
        assert float(p @ space.cost[reach]) == pytest.approx(g, rel=1e-9), res.method
    # Odoni bounds from the accelerated iterates bracket the reference
    lo, hi = aa.gain_bounds
    assert lo <= g * (1 + 1e-12) and g <= hi * (1 + 1e-12)
    assert solve_space(space, method="anderson", tol=1e-12).gain == pytest.approx(g, rel=1e-9)


def test_anderson_needs_far_fewer_sweeps_on_a_long_phase():
    """Table 1 case 8's chain mixes slowly (long phase mean 27.25): Anderson cuts the sweeps >= 5x."""
    model = tandem(0.6, h2_stage("a", 0.91, 0.55, 5.45), h2_stage("b", 0.91, 2.75, 27.25))
    space = StateSpace(model, Truncation(8, 3))
    ref = relative_value_iteration(space, tol=1e-8)
    aa = anderson_rvi(space, tol=1e-8)
    assert aa.gain == pytest.approx(ref.gain, rel=1e-7)
    assert aa.sweeps * 5 <= ref.sweeps


def test_unknown_method_is_one_line_error():
    space = StateSpace(tandem(0.5, exp_stage("a", 1.0)), Truncation(4, 2))
    with pytest.raises(ValueError, match="method must be"):
        solve_space(space, method="newton")
    with pytest.raises(ValueError, match="memory must be an integer >= 1"):
        anderson_rvi(space, memory=0)


def test_anderson_mixer_solves_a_linear_fixed_point_like_gmres():
    """x = Mx + b, M symmetric with spectrum in [−0.3, 0.999]: plain iteration needs ~23,000 steps
    (0.999ⁿ = 1e-10), Anderson with memory 10 fewer than 1,500."""
    rng = np.random.default_rng(7)
    n = 300
    Q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    M = Q @ np.diag(np.linspace(-0.3, 0.999, n)) @ Q.T
    b = rng.normal(size=n)
    exact = np.linalg.solve(np.eye(n) - M, b)
    x = np.zeros(n)
    mix = AndersonMixer(n, 10)
    for it in range(1, 5000):  # noqa: B007  (the count is checked after the loop)
        f = M @ x + b - x
        if np.linalg.norm(f) < 1e-10 * np.linalg.norm(b):
            break
        x = mix.step(x, f)
    assert it < 1500
    assert np.abs(x - exact).max() < 1e-5 * np.abs(exact).max()


def test_stationary_distribution_matches_a_dense_solve():
    model = tandem(0.6, h2_stage("a", 0.91, 0.55, 5.45), h2_stage("b", 0.91, 2.75, 27.25))
    space = StateSpace(model, Truncation(6, 3))
    res = anderson_rvi(space, tol=1e-9)
    P = induced_matrix(space, res.decision)
    reach, p = stationary_distribution(P)
    Pd = P[reach][:, reach].toarray()
    n = reach.size
    A = np.vstack([(np.eye(n) - Pd).T, np.ones(n)])
    ref = np.linalg.lstsq(A, np.concatenate([np.zeros(n), [1.0]]), rcond=None)[0]
    assert np.abs(p - ref).max() < 1e-11
    assert isinstance(P, sp.csr_matrix)


def test_compiled_rank_equals_the_scalar_rank():
    rng = np.random.default_rng(3)
    r = Ranker(7, 12)
    rows = rng.integers(0, 4, size=(500, 7))
    rows = rows[rows.sum(axis=1) <= 12]
    keys = r.rank(rows)
    assert [r.rank_one(x.tolist()) for x in rows] == keys.tolist()
    with pytest.raises(IndexError):
        r.rank(np.array([[13, 0, 0, 0, 0, 0, 0]]))


@pytest.mark.parametrize("compiled", [False, True])
def test_trim_longest_equals_removing_one_at_a_time(compiled, monkeypatch):
    """Both paths: the closed form (numba not loaded) and the compiled loop (loaded by a large solve)."""
    import sys

    import overtake.mdp._kernels  # noqa: F401

    if not compiled:
        monkeypatch.delitem(sys.modules, "overtake.mdp._kernels")
    rng = np.random.default_rng(11)
    for Q in (1, 2, 4, 6):
        w = rng.integers(0, 9, size=(400, Q))
        e = np.array([rng.integers(0, x.sum() + 1) for x in w])
        ref, before = w.copy(), w.copy()
        for i in range(w.shape[0]):
            for _ in range(e[i]):
                ref[i, np.argmax(ref[i])] -= 1
        assert np.array_equal(_trim_longest(w, e), ref)
        assert np.array_equal(w, before)  # the input is not changed


def test_table1_case1_with_the_default_method_matches_the_paper():
    """van der Weij et al. Table 1, case 1 (two exp(1) stages, ρ = 0.6): gains 0.00, 13.82, 17.63, 16.92 % over
    π(1), π(4), π(∞), π(1,1); π* = π(1) with E[W] = 4.25 (Pollaczek–Khinchine, E S = 2, E S² = 6)."""
    model = tandem(0.6, exp_stage("s1", 1.0), exp_stage("s2", 1.0))
    doc = compare(model, tol=1e-3)
    assert doc["method"] == "anderson"
    assert doc["policies"]["pi*"]["mean_response_time"] == pytest.approx(4.25, rel=1e-3)
    paper = {"pi(1)": 0.00, "pi(4)": 13.82, "pi(inf)": 17.63, "pi(1,1)": 16.92}
    for k, v in paper.items():
        assert 100 * doc["gains"][k] == pytest.approx(v, abs=0.1), k


def test_compiled_anderson_step_equals_the_numpy_step(monkeypatch):
    """The compiled two-pass mixer (large iterates) and the numpy one (small) give the same iterates."""
    import overtake.mdp.anderson as aa

    rng = np.random.default_rng(5)
    n = 400
    Q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    M = Q @ np.diag(np.linspace(-0.3, 0.99, n)) @ Q.T
    b = rng.normal(size=n)
    runs = {}
    for kernel_min in (10**9, 1):  # numpy everywhere, then compiled everywhere
        monkeypatch.setattr(aa, "KERNEL_MIN", kernel_min)
        mix = AndersonMixer(n, 4)
        x, xs = np.zeros(n), []
        for i in range(60):
            if i == 30:
                mix.reset()
            x = mix.step(x, M @ x + b - x)
            xs.append(x)
        runs[kernel_min] = np.array(xs)
    assert np.allclose(runs[1], runs[10**9], rtol=1e-9, atol=1e-9 * np.abs(runs[1]).max())


@pytest.mark.parametrize("k", [1, 2, 6, 10])
def test_compiled_mixing_coefficients_equal_numpys_solve(k):
    """The compiled normal-equation solve (the large mixer's) against np.linalg.solve of the same
    regularised Gram system, as AndersonMixer._mix (the small mixer's) sets it up."""
    from overtake.mdp import _kernels

    rng = np.random.default_rng(k)
    m = 10
    for _ in range(20):
        F = rng.normal(size=(m, 50)) * np.logspace(0, -6, m)[:, None]  # ill-conditioned like late Δf rows
        gram = np.ascontiguousarray(F @ F.T)
        both = np.ascontiguousarray(rng.normal(size=(m, 2)))
        gamma = np.full(k, np.nan)
        assert _kernels.anderson_gamma(gram, k, both, gamma)
        g = gram[:k, :k]
        want = np.linalg.solve(g + (1e-13 * np.trace(g) + 1e-300) * np.eye(k), both[:k, 1])
        assert np.allclose(gamma, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())
    # a zero history: the 1e-300 floor keeps the system regular, γ = 0 (as numpy's)
    gamma = np.full(k, 7.0)
    assert _kernels.anderson_gamma(np.zeros((m, m)), k, np.zeros((m, 2)), gamma)
    assert np.all(gamma == 0.0)
    # a non-finite history is reported (the mixer then drops it), γ untouched
    gamma = np.full(k, 7.0)
    assert not _kernels.anderson_gamma(np.full((m, m), np.nan), k, np.zeros((m, 2)), gamma)
    assert np.all(gamma == 7.0)


@pytest.mark.parametrize("case", [2, 3, 7, 10, 12])
def test_policy_iteration_matches_rvi_on_table1_cases(case):
    """van der Weij et al. Table 1 scenarios on a small cap: PI's g equals RVI's to 1e-9 relative, and the two
    returned policies are equal-valued (their exact gains agree to 1e-9), ties aside."""
    from overtake.api.scenario import load_scenario

    _, model = load_scenario(Path(__file__).resolve().parents[2] / "examples" / "table1" / f"case{case:02d}.yaml")
    space = StateSpace(model, Truncation(6, 3))
    ref = relative_value_iteration(space, tol=1e-12)
    pi = policy_iteration(space)
    assert ref.converged and pi.converged
    assert pi.gain == pytest.approx(ref.gain, rel=1e-9)
    exact = {}
    for res in (ref, pi):
        reach, p = stationary_distribution(induced_matrix(space, res.decision))
        exact[res.method] = float(p @ space.cost[reach])
    assert exact["pi"] == pytest.approx(exact["rvi"], rel=1e-9)
    assert exact["pi"] == pytest.approx(ref.gain, rel=1e-9)


def test_stationary_law_by_gauss_seidel_equals_the_direct_solve(monkeypatch):
    """Mid-size chains go to Gauss–Seidel once the kernels are loaded, to an LU otherwise: the two
    laws agree (Table 1 case 8's stages, π* of cap 8)."""
    import overtake.mdp.evaluate as ev

    model = tandem(0.6, h2_stage("a", 0.91, 0.55, 5.45), h2_stage("b", 0.91, 2.75, 27.25))
    space = StateSpace(model, Truncation(8, 3))
    P = induced_matrix(space, anderson_rvi(space, tol=1e-9).decision)
    monkeypatch.setattr(ev, "_DENSE_LIMIT", 10**6)
    monkeypatch.setattr(ev, "_DIRECT_LIMIT", 10**6)
    reach, direct = stationary_distribution(P)  # one dense LU, whatever is loaded
    assert reach.size > 1_000
    monkeypatch.setattr(ev, "_DENSE_LIMIT", 0)
    monkeypatch.setattr(ev, "_DIRECT_LIMIT", 0)
    reach2, gs = stationary_distribution(P)  # Gauss–Seidel
    assert np.array_equal(reach, reach2)
    assert np.abs(gs - direct).max() < 1e-10 * direct.max()


@pytest.mark.parametrize("name, cap", [("pi(4)", 30), ("pi(1,1)", 20)])
def test_baseline_chains_go_to_gauss_seidel_and_match_the_dense_solve(monkeypatch, name, cap):
    """With the kernels loaded, chains from evaluate._GS_FROM states on (here Table 1 case 8's
    baselines, 980 and 841 states) are solved by Gauss–Seidel, not a dense LU: the same law."""
    import overtake.mdp.evaluate as ev
    from overtake.mdp import _kernels  # noqa: F401  (loaded, as after a large solve)
    from overtake.mdp.baselines import Baseline
    from overtake.mdp.chain import build_chain
    from overtake.mdp.statespace import Layout

    model = tandem(0.6, h2_stage("a", 0.91, 0.55, 5.45), h2_stage("b", 0.91, 2.75, 27.25))
    lay = Layout.build(model, "start")
    b = Baseline.parse(name, 2)
    P = build_chain(model, lay, b.rule(lay.queue_stage, model.coord_stage()), max_requests=cap,
                    max_threads=b.max_threads).P
    assert ev._GS_FROM < P.shape[0] <= ev._DENSE_LIMIT
    calls = []
    real = _kernels.gauss_seidel
    monkeypatch.setattr(_kernels, "gauss_seidel", lambda *a: calls.append(1) or real(*a))
    reach, gs = stationary_distribution(P)
    assert calls  # Gauss–Seidel ran
    monkeypatch.setattr(ev, "_GS_FROM", 10**6)
    calls.clear()
    reach2, dense = stationary_distribution(P)
    assert not calls and np.array_equal(reach, reach2)
    # both meet the same residual test (1e-12); on these slowly mixing chains that is 1e-9 on the law
    assert np.abs(gs - dense).max() < 1e-8 * dense.max()
    n = np.asarray(build_chain(model, lay, b.rule(lay.queue_stage, model.coord_stage()), max_requests=cap,
                               max_threads=b.max_threads).rows.sum(axis=1))[reach]
    assert float(gs @ n) == pytest.approx(float(dense @ n), rel=1e-8)


def test_warm_started_stationary_law_equals_the_direct_solve(monkeypatch):
    """Auto-truncation's warm starts (truncation.Laws): a policy's law on cap 8, mapped onto the chain
    a second, differently solved policy induces on cap 10, starts Gauss–Seidel; the law equals that
    chain's dense LU solve, and E[W] evaluated with and without the warm start agrees to 1e-9."""
    import overtake.mdp.evaluate as ev
    from overtake.mdp.chain import build_chain
    from overtake.mdp.policy import Policy
    from overtake.mdp.rule_evaluation import WarmStarts, evaluate_rule
    from overtake.mdp.statespace import Layout

    model = tandem(0.6, h2_stage("a", 0.91, 0.55, 5.45), h2_stage("b", 0.91, 2.75, 27.25))
    lay = Layout.build(model, "full")
    pols = []
    for cap in (6, 7):
        space = StateSpace(model, Truncation(cap, 3))
        pols.append(Policy.from_decision(space, anderson_rvi(space, tol=1e-9).decision))
    laws = WarmStarts()
    evaluate_rule(model, lay, pols[0].actions, max_requests=8, max_threads=3, warm=laws)
    chain = build_chain(model, lay, pols[1].actions, max_requests=10, max_threads=3)
    x0 = laws.guess(10, chain.rows)
    assert x0 is not None and x0.shape == (chain.rows.shape[0],)
    assert np.all(x0[chain.rows.sum(axis=1) > 8] == 0) and x0.max() > 0  # states beyond cap 8: no guess
    monkeypatch.setattr(ev, "_DENSE_LIMIT", 10**6)
    monkeypatch.setattr(ev, "_DIRECT_LIMIT", 10**6)
    reach, direct = stationary_distribution(chain.P)
    cold = evaluate_rule(model, lay, pols[1].actions, max_requests=10, max_threads=3)
    assert reach.size > 1_000
    monkeypatch.setattr(ev, "_DENSE_LIMIT", 0)
    monkeypatch.setattr(ev, "_DIRECT_LIMIT", 0)
    reach2, warm = stationary_distribution(chain.P, x0=x0)
    assert np.array_equal(reach, reach2)
    assert np.abs(warm - direct).max() < 1e-10 * direct.max()
    warm_m = evaluate_rule(model, lay, pols[1].actions, max_requests=10, max_threads=3, warm=laws)
    assert warm_m.mean_response_time == pytest.approx(cold.mean_response_time, rel=1e-9)


def test_anderson_recovers_from_a_non_finite_mixed_iterate(monkeypatch):
    """A NaN from the mixing step must not pass the span test (the compiled step's min/max of NaN is
    (inf, -inf)): the solver drops the history and still reaches RVI's gain."""
    model = tandem(0.6, h2_stage("a", 0.91, 0.55, 5.45), h2_stage("b", 0.91, 2.75, 27.25))
    space = StateSpace(model, Truncation(12, 4))
    assert space.size >= 5_000  # the compiled Bellman step
    ref = relative_value_iteration(space, tol=1e-9)
    real = AndersonMixer.step
    calls = {"n": 0}

    def flaky(self, x, f):
        calls["n"] += 1
        out = real(self, x, f)
        return out * np.nan if calls["n"] == 5 else out

    monkeypatch.setattr(AndersonMixer, "step", flaky)
    res = anderson_rvi(space, tol=1e-9)
    assert res.converged and np.isfinite(res.gain)
    assert res.gain == pytest.approx(ref.gain, rel=1e-8)
