"""π* from relative value iteration and policy iteration: exact checks (van der Weij et al.,
"Dynamic thread assignment", §2–3)."""

from __future__ import annotations

import numpy as np
import pytest
from support.mdp_helpers import exp_stage, tandem

from overtake.mdp import solve
from overtake.mdp.average_cost import induced_matrix, policy_iteration, relative_value_iteration
from overtake.mdp.baselines import Baseline
from overtake.mdp.evaluate import stationary_distribution
from overtake.mdp.policy import Policy
from overtake.mdp.rule_evaluation import evaluate_rule
from overtake.mdp.statespace import Layout, StateSpace, Truncation


@pytest.mark.parametrize("blocking_cost", [False, True])
def test_rvi_and_policy_iteration_agree_and_bracket(case4, blocking_cost):
    space = StateSpace(case4, Truncation(6, 3), blocking_cost=blocking_cost)
    pi = policy_iteration(space)
    rvi = relative_value_iteration(space, tol=1e-9)
    lo, hi = rvi.gain_bounds
    assert lo <= pi.gain * (1 + 1e-9) and pi.gain <= hi * (1 + 1e-9)
    assert pi.gain == pytest.approx(rvi.gain, rel=1e-7)
    # the gain of the PI policy is the stationary mean of its cost rate: E[N] without the
    # blocking charge, E[N] + λ·E[r; blocked] with it
    reach, p = stationary_distribution(induced_matrix(space, pi.decision))
    assert p @ space.cost[reach] == pytest.approx(pi.gain, rel=1e-9)
    assert (p @ space.n_total[reach] == pytest.approx(pi.gain, rel=1e-9)) is not blocking_cost


def test_blocking_cost_removes_the_incentive_to_block():
    """Exponential tandem: π* = π(1) (van der Weij et al. §3). Solved on a small cap and evaluated on a large
    one, the optimum with blocked arrivals charged matches Pollaczek–Khinchine; charging only
    n(x) on the same small cap yields a policy that exploits the cap and is measurably worse."""
    model = tandem(0.6, exp_stage("a", 1.0), exp_stage("b", 5.0))
    ES, ES2 = 6.0, 2 * 1.0 + 2 * 25.0 + 2 * 5.0
    pk = ES + model.arrival_rate * ES2 / (2 * (1 - 0.6))
    lay = Layout.build(model, "full")
    ew = {}
    for charged in (True, False):
        space = StateSpace(model, Truncation(8, 3), blocking_cost=charged)
        res = relative_value_iteration(space, tol=1e-9)
        pol = Policy.from_decision(space, res.decision)
        ew[charged] = evaluate_rule(model, lay, pol.actions, max_requests=80, max_threads=3).mean_response_time
    assert ew[True] == pytest.approx(pk, rel=1e-4)
    assert ew[False] > pk * (1 + 1e-3)


def test_single_exponential_stage_optimum_is_fcfs():
    """N = 1, exponential service: π* = π(1), E[W] = E[S]/(1 − ρ) (M/M/1)."""
    model = tandem(0.7, exp_stage("only", 2.0))
    opt = solve(model, tol=1e-4)
    assert opt.metrics.mean_response_time == pytest.approx(2.0 / 0.3, rel=2e-4)
    assert opt.metrics.thread_distribution[2:] == pytest.approx([0.0] * len(opt.metrics.thread_distribution[2:]), abs=1e-9)


def test_exponential_tandem_optimum_is_pi1():
    """van der Weij et al. §3: with exponential stages the optimal policy is π(1) (= M/G/1-FCFS).

    Near the cap a truncated optimum may exploit blocking, so compare after auto-truncation.
    """
    model = tandem(0.6, exp_stage("a", 1.0), exp_stage("b", 5.0))
    opt = solve(model, tol=1e-4)
    ES, ES2 = 6.0, 2 * 1.0 + 2 * 25.0 + 2 * 5.0
    pk = ES + model.arrival_rate * ES2 / (2 * (1 - 0.6))
    assert opt.metrics.mean_response_time == pytest.approx(pk, rel=3e-4)


@pytest.mark.parametrize("name", ["pi(1)", "pi(2)", "pi(1,1)", "pi(2,1)", "pi(inf)"])
def test_optimum_is_never_worse_than_a_baseline_on_the_same_truncation(case4, name):
    C = 7
    # without the blocking charge, g is E[N] on the truncation itself: comparable to the baselines'
    res = policy_iteration(StateSpace(case4, Truncation(C, C), blocking_cost=False))
    lay = Layout.build(case4, "full")
    b = Baseline.parse(name, 2)
    # evaluate the baseline on the phase-known layout and the same cap: a feasible policy of the MDP
    m = evaluate_rule(case4, lay, b.rule(lay.queue_stage, case4.coord_stage()), max_requests=C, max_threads=C)
    assert res.gain <= m.mean_in_system * (1 + 1e-10)
    assert res.gain < m.mean_in_system * (1 - 1e-3)  # and, with H2 stages, strictly better


def test_phase_at_start_lies_between_full_information_and_pi1(case4):
    tr = Truncation(8, 4)
    full = policy_iteration(StateSpace(case4, tr, blocking_cost=False))
    start = policy_iteration(StateSpace(case4, tr, phase_info="start", blocking_cost=False))
    lay = Layout.build(case4, "start")
    b = Baseline.parse("pi(1)", 2)
    m1 = evaluate_rule(case4, lay, b.rule(lay.queue_stage, case4.coord_stage()), max_requests=8, max_threads=4)
    assert full.gain <= start.gain * (1 + 1e-10)
    assert start.gain <= m1.mean_in_system * (1 + 1e-10)


def test_cores_and_overhead_change_capacity():
    m = tandem(0.6, exp_stage("a", 1.0), cores=2, overhead=0.1)
    assert m.capacity(np.array([0, 1, 2, 3])).tolist() == pytest.approx([0.0, 1 / 1.1, 2 / 1.2, 2 / 1.3])
