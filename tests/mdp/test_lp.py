"""Occupation-measure LP and constrained policies (mdp.lp, mdp.constrained) against value iteration,
exact policy evaluation and LP duality."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp

pytest.importorskip("cvxpy")

from overtake.mdp.average_cost import induced_matrix, relative_value_iteration
from overtake.mdp.constrained import ConstraintError, Constraints, RandomizedPolicy, solve_constrained
from overtake.mdp.evaluate import stationary_distribution
from overtake.mdp.lp import NodePolicy, cost_rate, occupation_lp, threads_constraint
from overtake.mdp.policy import Policy
from overtake.mdp.statespace import StateSpace, Truncation

TR = Truncation(6, 3)


@pytest.mark.parametrize("phase_info", ["full", "start"])
def test_lp_gain_equals_value_iteration(case4, phase_info):
    space = StateSpace(case4, TR, phase_info)
    rvi = relative_value_iteration(space, tol=1e-11)
    lp = occupation_lp(space)
    lo, hi = rvi.gain_bounds
    assert lp.objective == pytest.approx(rvi.gain, rel=1e-6)
    assert lo * (1 - 1e-9) <= lp.objective <= hi * (1 + 1e-9)
    # the LP's policy, evaluated exactly (stationary law of P_E·R), has the same cost ...
    assert lp.stationary @ cost_rate(space) == pytest.approx(rvi.gain, rel=1e-6)
    # ... and so does its deterministic decision through the solver's own chain construction
    reach, p = stationary_distribution(induced_matrix(space, lp.policy.deterministic_decision()))
    assert p @ cost_rate(space)[reach] == pytest.approx(rvi.gain, rel=1e-6)
    # the LP's z is that stationary law
    assert np.abs(lp.z - lp.stationary).max() < 1e-8
    assert lp.policy.randomised_nodes.size == 0


def _pure_at(pol, node):
    """``pol`` with the mixture at ``node`` replaced by each of its actions in turn: the exact metrics
    and the LP's cost rate of each."""
    mix = np.column_stack([pol.stop, pol.spawn])[node]
    out = []
    for a in np.flatnonzero(mix > 0):
        stop, spawn = pol.stop.copy(), pol.spawn.copy()
        stop[node], spawn[node] = float(a == 0), np.arange(1, mix.size) == a
        m, pi = NodePolicy(pol.space, stop, spawn).evaluate()
        out.append((m, float(pi @ cost_rate(pol.space))))
    return out


def _budget(case4, T, phase_info="start"):
    space = StateSpace(case4, TR, phase_info)
    return space, occupation_lp(space, [threads_constraint(space, T)])


def test_thread_budget_is_met_exactly_and_costs_something(case4):
    space = StateSpace(case4, TR, "start")
    free = occupation_lp(space)
    T = 0.9
    assert free.metrics.mean_threads > T  # so the budget binds
    _, lp = _budget(case4, T)
    # exact evaluation of the (randomised) LP policy: the budget is met with equality
    assert lp.metrics.mean_threads == pytest.approx(T, rel=1e-8)
    assert lp.constraint_values["max_mean_threads"] == pytest.approx(T, rel=1e-8)
    assert lp.objective >= free.objective * (1 - 1e-10)
    assert lp.stationary @ cost_rate(space) == pytest.approx(lp.objective, rel=1e-8)
    # one constraint: a basic optimum randomises in at most one decision node (Altman, Thm 3.8); the
    # budget binds, so in exactly one, between two actions whose pure policies straddle the budget ...
    (node,) = lp.policy.randomised_nodes
    (under, cost_under), (over, _) = sorted(_pure_at(lp.policy, node), key=lambda mc: mc[0].mean_threads)
    assert under.mean_threads < T < over.mean_threads
    # ... and the pure policy within the budget is feasible, so it costs no less than the optimum
    assert cost_under >= lp.objective * (1 - 1e-9)
    assert lp.shadow_prices["max_mean_threads"] > 0


def test_slack_budget_gives_the_unconstrained_optimum(case4):
    space = StateSpace(case4, TR, "start")
    free = occupation_lp(space)
    _, lp = _budget(case4, 5.0)
    assert lp.objective == pytest.approx(free.objective, rel=1e-9)
    assert lp.shadow_prices["max_mean_threads"] == pytest.approx(0.0, abs=1e-9)


def test_shadow_price_is_the_slope_of_the_optimal_cost(case4):
    """g*(T) is convex and piecewise linear; its one-sided slopes bracket the dual μ(T)."""
    T, d = 0.9, 1e-3
    g = {t: _budget(case4, t)[1] for t in (T - d, T, T + d)}
    mu = g[T].shadow_prices["max_mean_threads"]
    left = (g[T - d].objective - g[T].objective) / d
    right = (g[T].objective - g[T + d].objective) / d
    assert right <= mu * (1 + 1e-6) + 1e-9 and mu <= left * (1 + 1e-6) + 1e-9
    assert left == pytest.approx(mu, rel=0.05) and right == pytest.approx(mu, rel=0.05)


def test_stage_sla_met_exactly_with_phases_known(case4):
    space = StateSpace(case4, TR, "full")
    cons = Constraints(None, {"s2": 1.5})
    co = solve_constrained(case4, cons, truncation=TR)
    assert co.unconstrained.metrics.stage_sojourn[1] > 1.5
    assert co.lp.metrics.stage_sojourn[1] == pytest.approx(1.5, rel=1e-8)
    assert co.lp.shadow_prices["stage_sla:s2"] > 0
    assert co.lp.objective >= co.unconstrained.objective * (1 - 1e-10)
    assert co.lp.space.size == space.size


def test_artifact_randomisation_reproduces_the_constrained_law(case4, tmp_path):
    """Rebuild the chain from the saved artifact + randomisation table only; evaluate it exactly."""
    co = solve_constrained(case4, Constraints(0.7), truncation=TR)
    path = tmp_path / "c.npz"
    co.policy.save(path)
    pol = RandomizedPolicy(Policy.load(path))
    assert pol.randomised_states >= 1
    space = StateSpace(case4, TR, "full")
    Q = space.Q
    rows, cols, vals = [], [], []
    for y in range(space.size):
        for act, p in pol.distribution(space.rows[y]):
            post = space.rows[y].copy()
            post[:Q] -= act
            post[Q:] += act  # phase-known layout: queue q feeds coordinate q
            rows.append(y)
            cols.append(int(space.index(post[None, :])[0]))
            vals.append(p)
    R = sp.csr_matrix((vals, (rows, cols)), shape=(space.size, space.size))
    reach, p = stationary_distribution((space.event_matrix @ R).tocsr())
    assert p @ space.threads[reach] == pytest.approx(0.7, rel=1e-8)
    assert p @ space.n_total[reach] == pytest.approx(co.lp.metrics.mean_in_system, rel=1e-9)
    # drawing follows the stored probabilities
    st = np.asarray(co.policy.meta["randomization"]["states"][0]["state"])
    dist = pol.distribution(st)
    rng = np.random.default_rng(1)
    draws = [tuple(pol.action(st, rng)) for _ in range(2000)]
    frac = draws.count(tuple(dist[0][0])) / len(draws)
    assert frac == pytest.approx(dist[0][1], abs=0.05)


def test_constraint_parsing_names_the_option(case4):
    with pytest.raises(ConstraintError, match="--stage-sla 'nope=1': unknown stage 'nope'"):
        Constraints.parse(case4, None, ["nope=1"])
    with pytest.raises(ConstraintError, match="--max-mean-threads must be a number > 0"):
        Constraints.parse(case4, 0.0, [])
    with pytest.raises(ConstraintError, match="STAGE=SECONDS"):
        Constraints.parse(case4, None, ["s2:3"])
    with pytest.raises(ConstraintError, match="target mean sojourn must be > 0"):
        Constraints.parse(case4, None, ["s2=-1"])


def test_cli_constrained_solve_and_infeasible_budget(tmp_path, capsys):
    from overtake.api.cli import main

    scen = tmp_path / "s.yaml"
    scen.write_text(
        "load: 0.6\nstages:\n"
        "  - {name: stage1, service: {hyperexponential: {probs: [0.91, 0.09], means: [0.55, 5.45]}}}\n"
        "  - {name: stage2, service: {hyperexponential: {probs: [0.91, 0.09], means: [0.55, 5.45]}}}\n"
        "truncation: {max_requests: 6, max_threads: 3}\n"
    )
    out = tmp_path / "p.npz"
    assert main(["solve", str(scen), "--max-mean-threads", "0.9", "--phase-info", "start",
                 "--out", str(out), "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["mean_threads"] == pytest.approx(0.9, rel=1e-8)
    assert Policy.load(out).meta["constraints"]["max_mean_threads"] == 0.9
    assert main(["solve", str(scen), "--max-mean-threads", "0.2", "--phase-info", "start", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-mean-threads 0.2: no policy keeps fewer than" in err[0]
    assert main(["solve", str(scen), "--quiet"]) == 2
    assert "--out" in capsys.readouterr().err
