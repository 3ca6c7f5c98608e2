"""The overtaking heuristic (van der Weij et al., "Dynamic thread assignment", Theorem 3.1) against known answers.

* Exponential and Erlang stages: the heuristic is π(1) (van der Weij et al., §3) — decision by decision
  on a truncated lattice, and in exact E[W] (= Pollaczek–Khinchine with the summed service).
* Its building blocks: E R_d and E min(R_c, R_d) against closed forms.
* On a truncated MDP it cannot beat π* of that MDP (optimality), and on Table 1 case 2 it is
  within 2% of π* in exact E[W].
"""

from __future__ import annotations

import numpy as np
import pytest
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.mdp import solve
from overtake.mdp.baselines import Baseline
from overtake.mdp.errors import ModelError
from overtake.mdp.heuristic import evaluate_heuristic, overtaking_heuristic, remaining_work
from overtake.mdp.model import Stage
from overtake.mdp.rule_evaluation import evaluate_baseline, evaluate_rule
from overtake.mdp.statespace import Layout, StateSpace, Truncation


def erlang_stage(name: str, k: int, mean: float) -> Stage:
    rate = k / mean
    T = -rate * np.eye(k) + rate * np.eye(k, k=1)
    a = np.zeros(k)
    a[0] = 1.0
    return Stage(name, a, T)


def pollaczek_khinchine(model):  # type: ignore[no-untyped-def]
    s = model.stages
    ES = sum(x.mean() for x in s)
    ES2 = sum(x.second_moment() for x in s) + sum(
        2 * s[i].mean() * s[j].mean() for i in range(len(s)) for j in range(i + 1, len(s)))
    lam = model.arrival_rate
    return ES + lam * ES2 / (2 * (1 - lam * ES))


IFR_MODELS = {
    "exp(1), exp(1)": (exp_stage("a", 1.0), exp_stage("b", 1.0)),
    "exp(5), exp(1)": (exp_stage("a", 5.0), exp_stage("b", 1.0)),
    "erlang3(1), erlang2(2)": (erlang_stage("a", 3, 1.0), erlang_stage("b", 2, 2.0)),
    "exp(1), erlang4(3), exp(0.5)": (exp_stage("a", 1.0), erlang_stage("b", 4, 3.0), exp_stage("c", 0.5)),
}


@pytest.mark.parametrize("variant", ["pairwise", "lookahead"])
@pytest.mark.parametrize("name", list(IFR_MODELS))
def test_heuristic_is_pi1_decision_by_decision_on_exponential_and_erlang(name: str, variant: str) -> None:
    model = tandem(0.6, *IFR_MODELS[name])
    h = overtaking_heuristic(model, variant=variant)
    space = StateSpace(model, Truncation(6, 4), "full")
    rows = space.rows
    D = model.n_coords
    # reachable waiting requests sit in each stage's first phase (they have not started)
    first = np.asarray(model.offsets[:-1])
    other = np.setdiff1d(np.arange(D), first)
    rows = rows[rows[:, other].sum(axis=1) == 0]
    # the pre-decision states π(1) reaches: no thread, or one thread at stage i and nobody
    # waiting behind it at a later stage (a finishing request is served on at once)
    K = rows[:, D:].sum(axis=1)
    cs = model.coord_stage()
    active_stage = np.where(K == 1, cs[np.argmax(rows[:, D:], axis=1)], -1)
    later_waiting = np.array([rows[r, first[active_stage[r] + 1:]].sum() if K[r] == 1 else 0
                              for r in range(rows.shape[0])])
    keep = (K == 0) | ((K == 1) & (later_waiting == 0))
    rows, K = rows[keep], K[keep]
    got = h.actions(rows)
    # π(1): one thread at a time, the latest stage with a waiting request first
    want = np.zeros_like(got)
    idle = np.flatnonzero(K == 0)
    for r in idle:
        waiting = [i for i in range(model.n_stages) if rows[r, first[i]] > 0]
        if waiting:
            want[r, first[max(waiting)]] = 1
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", list(IFR_MODELS)[:3])
def test_heuristic_exact_mean_response_equals_pi1_and_pollaczek_khinchine(name: str) -> None:
    model = tandem(0.6, *IFR_MODELS[name])
    ev = evaluate_heuristic(model, tol=1e-5)
    assert ev.metrics.mean_response_time == pytest.approx(pollaczek_khinchine(model), rel=2e-4)
    b = evaluate_baseline(model, "pi(1)", tol=1e-5)
    assert ev.metrics.mean_response_time == pytest.approx(b.metrics.mean_response_time, rel=2e-4)
    assert ev.metrics.mean_threads == pytest.approx(0.6, rel=1e-3)  # never more than one thread


def test_remaining_work_closed_forms() -> None:
    # exponential stages: R from stage 2 is Exp(1/m2); E min of two exponentials = ab/(a+b)
    model = tandem(0.5, exp_stage("a", 2.0), exp_stage("b", 3.0))
    mean, mins = remaining_work(model)
    np.testing.assert_allclose(mean, [5.0, 3.0])
    assert mins[1, 1] == pytest.approx(3.0 * 3.0 / 6.0)
    # min(Exp(mean 2) + Exp(mean 3), Exp(mean 3)) = ∫ P(R0 > t) e^{-t/3} dt, R0 hypoexponential
    a, b = 0.5, 1.0 / 3.0
    # P(R0 > t) = (b e^{-at} − a e^{-bt}) / (b − a)
    want = (b / (a + b) - a / (2 * b)) / (b - a)
    assert mins[0, 1] == pytest.approx(want, rel=1e-10)
    # H2 stage followed by exp: E R for the phases = phase mean + downstream mean
    model = tandem(0.5, h2_stage("a", 0.9, 0.5, 5.5), exp_stage("b", 1.0))
    mean, mins = remaining_work(model)
    np.testing.assert_allclose(mean, [1.5, 6.5, 1.0])
    assert np.allclose(mins, mins.T)


def test_lookahead_waits_no_longer_than_the_drain() -> None:
    """Waiting for a's next phase change can only be cheaper than waiting for a to leave, and
    the two agree when a's remaining path has no decision epoch left (last stage, one phase)."""
    model = tandem(0.6, h2_stage("s1", 0.91, 0.55, 5.45), h2_stage("s2", 0.91, 0.55, 5.45))
    pw = overtaking_heuristic(model)
    la = overtaking_heuristic(model, variant="lookahead")
    assert np.all(la.wait <= pw.wait + 1e-12)
    np.testing.assert_allclose(la.wait[:, 2:], pw.wait[:, 2:], rtol=1e-12)
    # case 4's stage-1 short request next to a stage-1 short thread: pairwise starts it, the
    # lookahead waits for the thread's stage-2 phase (π*'s choice in its overtaking rules)
    state = [1, 0, 0, 0, 1, 0, 0, 0]
    np.testing.assert_array_equal(pw.action(state), [1, 0, 0, 0])
    np.testing.assert_array_equal(la.action(state), [0, 0, 0, 0])


def test_heuristic_overtakes_only_with_high_variability() -> None:
    """Case 4 of Table 1: a short-phase request is started next to a long-phase thread, not vice versa."""
    model = tandem(0.6, h2_stage("s1", 0.91, 0.55, 5.45), h2_stage("s2", 0.91, 0.55, 5.45))
    h = overtaking_heuristic(model)
    # coordinates: s1/short, s1/long, s2/short, s2/long; state = waiting(4) + threads(4)
    short_behind_long = [1, 0, 0, 0, 0, 1, 0, 0]
    long_behind_short = [0, 1, 0, 0, 1, 0, 0, 0]
    np.testing.assert_array_equal(h.action(short_behind_long), [1, 0, 0, 0])
    np.testing.assert_array_equal(h.action(long_behind_short), [0, 0, 0, 0])
    # the literal variant starts a stage-1 short request next to a stage-2 long thread too
    lit = overtaking_heuristic(model, variant="literal")
    np.testing.assert_array_equal(lit.action([1, 0, 0, 0, 0, 0, 0, 1]), [1, 0, 0, 0])


def test_heuristic_never_beats_pi_star_on_the_same_truncated_mdp() -> None:
    model = tandem(0.6, h2_stage("s1", 0.91, 0.55, 5.45), exp_stage("s2", 1.0))
    opt = solve(model, truncation=Truncation(12, 3))
    h = overtaking_heuristic(model)
    m = evaluate_rule(model, Layout.build(model, "full"), h.actions, max_requests=12, max_threads=3)
    g_star = opt.solve.gain_bounds[0]
    assert m.mean_in_system >= g_star * (1 - 1e-6)
    assert m.mean_in_system <= 1.05 * g_star


def test_heuristic_within_two_percent_of_pi_star_on_table1_case2() -> None:
    model = tandem(0.6, exp_stage("s1", 1.0), h2_stage("s2", 0.91, 0.55, 5.45))
    opt = solve(model, tol=1e-3)
    ev = evaluate_heuristic(model, tol=1e-3)
    gap = ev.metrics.mean_response_time / opt.metrics.mean_response_time - 1
    assert -2e-3 < gap < 0.02
    # and it keeps most of π*'s gain over π(1) and π(∞)
    for name in ("pi(1)", "pi(inf)"):
        b = evaluate_baseline(model, Baseline.parse(name, 2).name, tol=1e-3).metrics.mean_response_time
        assert ev.metrics.mean_response_time < b


def test_unknown_variant_is_an_input_error() -> None:
    model = tandem(0.6, exp_stage("a", 1.0))
    with pytest.raises(ModelError, match="variant"):
        overtaking_heuristic(model, variant="greedy")
    with pytest.raises(ModelError, match="columns"):
        overtaking_heuristic(model).actions(np.zeros((1, 3), dtype=np.int64))
