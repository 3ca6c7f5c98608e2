"""mdp.priority_prediction and mdp.priority_classes: what CPU priority does to a solved policy, as
``overtake solve --cpu-priority`` stores it.

Known answers: on one M/G/1 stage age priority's π(∞) prediction is the exact multilevel-PS
mean (Kleinrock–Muntz–Rodemich) at the threshold the visit model chose; class priority needs
the phases, and says so.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.api.cli import main
from overtake.mdp import Truncation, solve
from overtake.mdp.errors import ModelError
from overtake.mdp.mlps import dps_means, mlps_mean
from overtake.mdp.model import Stage
from overtake.mdp.observed import solve_observed
from overtake.mdp.priority_classes import (
    choose_classes,
    class_action_layout,
    class_action_optimum,
    class_candidates,
    class_model,
    model_levels,
)
from overtake.mdp.priority_prediction import predict_priority
from overtake.mdp.rule_evaluation import evaluate_baseline, evaluate_rule


@pytest.fixture(scope="module")
def h2():  # type: ignore[no-untyped-def]
    return tandem(0.6, h2_stage("a", 0.91, 0.55, 5.45))


def test_age_prediction_of_passthrough_is_the_mlps_mean(h2) -> None:  # type: ignore[no-untyped-def]
    opt = solve(h2, truncation=Truncation(12, 4))
    pr = predict_priority(h2, opt.policy, "age", requests=200_000, seeds=2, seed=3)
    a = pr.priority.thresholds[0][0]
    exact = mlps_mean(h2.stages[0], h2.arrival_rate, [a])  # strict priority; SCHED_IDLE's 3/1024 is ~strict
    assert pr.passthrough is not None and pr.passthrough_ci95 is not None
    assert abs(pr.passthrough - exact) <= 1.5 * pr.passthrough_ci95 + 0.005 * exact
    assert pr.passthrough < h2.stages[0].mean() / (1 - h2.load)  # beats PS, E[S]/(1-ρ)
    meta = pr.to_meta()
    assert meta["kind"] == "age" and meta["thresholds"] == [[a]] and json.loads(json.dumps(meta)) == meta


def test_age_prediction_simulates_until_its_ci_is_reached(h2) -> None:  # type: ignore[no-untyped-def]
    """The prediction pools the simulator's own runs at seeds 0, 1, … and stops at the first run
    whose pooled 95 % half-width is within ``rel_ci`` of the pooled mean (``rel_ci`` 0: every run)."""
    from overtake.mdp.priority import DEFAULT_LOW_WEIGHT, age_priority, exempt_stages
    from overtake.mdp.simulation import simulate

    opt = solve(h2, truncation=Truncation(12, 4))
    n = 20_000
    every = predict_priority(h2, opt.policy, "age", requests=n, seeds=3, rel_ci=0.0)
    assert (every.seeds, every.passthrough_seeds, every.requests) == (3, 3, n)
    pr = exempt_stages(age_priority(h2, [every.priority.thresholds[0][0]], weights=[1.0, DEFAULT_LOW_WEIGHT]), ())
    runs = [simulate(h2, opt.policy, requests=n, seed=k, cpu_priority=pr) for k in range(3)]
    means = np.cumsum([r.mean_response_time for r in runs]) / np.arange(1, 4)
    halves = np.sqrt(np.cumsum([r.ci95**2 for r in runs])) / np.arange(1, 4)
    assert every.mean_response_time == pytest.approx(means[2], rel=1e-12)
    assert every.ci95 == pytest.approx(halves[2], rel=1e-12)
    rel = halves / means
    assert rel[0] > rel[1]  # these seeds: a second run narrows the interval
    # a target between one run's relative half-width and two runs': exactly two runs
    two = predict_priority(h2, opt.policy, "age", requests=n, seeds=3, rel_ci=float(rel[1]) * (1 + 1e-9))
    assert two.seeds == 2 and two.mean_response_time == pytest.approx(means[1], rel=1e-12)
    assert two.ci95 <= float(rel[1]) * (1 + 1e-9) * two.mean_response_time
    loose = predict_priority(h2, opt.policy, "age", requests=n, seeds=3, rel_ci=0.9)
    assert (loose.seeds, loose.passthrough_seeds) == (1, 1)
    assert loose.to_meta()["passthrough_seeds"] == 1
    with pytest.raises(ModelError, match="rel_ci"):
        predict_priority(h2, opt.policy, "age", rel_ci=1.5)


def test_weighted_sharing_is_discriminatory_processor_sharing() -> None:
    """One H2 stage under π(∞) with CPU weights by phase is M/M/1 discriminatory processor sharing
    of its two exponential branches: the chain's exact E[W] is Fayolle–Mitrani–Iasnogorodski's."""
    s = h2_stage("a", 0.91, 0.55, 5.45)
    lam = 0.6 / s.mean()
    for w in ((1.0, 1.0), (1.0, 0.1), (1.0, 3 / 1024)):
        m = tandem(0.6, s)
        m = type(m)(lam, m.stages, weights=w)
        exact = float(np.array([0.91, 0.09]) @ dps_means([0.91 * lam, 0.09 * lam], [1 / 0.55, 1 / 5.45], w))
        assert evaluate_baseline(m, "pi(inf)", tol=1e-7).metrics.mean_response_time == pytest.approx(exact, rel=1e-6)
    from overtake.mdp.simulation import simulate

    sim = simulate(type(m)(lam, m.stages, weights=(1.0, 0.1)), "pi(inf)", requests=200_000, seed=5)  # the same weights
    exact = float(np.array([0.91, 0.09]) @ dps_means([0.91 * lam, 0.09 * lam], [1 / 0.55, 1 / 5.45], (1.0, 0.1)))
    assert abs(sim.mean_response_time - exact) <= 1.5 * sim.ci95
    with pytest.raises(ModelError, match="one positive CPU weight per"):
        type(m)(lam, m.stages, weights=(1.0,))


def test_class_prediction_is_exact_and_the_class_optimum_beats_it(h2) -> None:  # type: ignore[no-untyped-def]
    """π* solved for PS, run with short-first classes: exact (weighted chain) and simulated agree;
    the spawn policy solved with the classes in force is never worse (it optimises that chain)."""
    two = tandem(0.6, h2_stage("a", 0.91, 0.55, 5.45), h2_stage("b", 0.91, 0.55, 5.45))
    full = solve(two, truncation=Truncation(10, 3)).policy
    pr = predict_priority(two, full, "class")
    assert pr.requests == 0 and pr.ci95 == 0.0 and pr.priority.start_levels == ((0, 1), (0, 1))
    from overtake.mdp.simulation import simulate

    sim = simulate(two, full, requests=300_000, seed=11, cpu_priority=pr.priority)
    assert abs(sim.mean_response_time - pr.mean_response_time) <= 1.5 * sim.ci95 + 0.01 * pr.mean_response_time
    cm = class_model(two)
    opt = solve(cm, truncation=Truncation(10, 3))
    ev = evaluate_rule(cm, full.layout, full.actions, max_requests=10, max_threads=3)
    assert opt.metrics.mean_response_time <= ev.mean_response_time + 1e-9
    assert pr.to_meta()["thresholds"] == [[None], [None]]  # never demoted by age: JSON null, not Infinity


def test_class_needs_the_phases_and_phases_that_stay(h2) -> None:  # type: ignore[no-untyped-def]
    obs = solve_observed(h2, phase_info="none", truncation=Truncation(8, 3))
    with pytest.raises(ModelError, match="phase_info 'none'.*use age"):
        predict_priority(h2, obs.policy, "class")
    full = solve(h2, truncation=Truncation(8, 3)).policy
    with pytest.raises(ModelError, match="expected one of age, class"):
        predict_priority(h2, full, "nice")
    from overtake.mdp import Stage

    erlang = Stage("e", np.array([1.0, 0.0]), np.array([[-2.0, 2.0], [0.0, -2.0]]))
    with pytest.raises(ModelError, match="phases do not move"):
        class_model(tandem(0.5, erlang))


def test_cli_solve_stores_the_predictions(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from overtake.mdp import Policy

    scen = tmp_path / "s.yaml"
    scen.write_text("load: 0.5\nstages:\n  - name: a\n    service: {hyperexponential: {probs: [0.9, 0.1], "
                    "means: [0.5, 5.5]}}\n")
    out = tmp_path / "p.npz"
    assert main(["solve", str(scen), "--out", str(out), "--quiet", "--cpu-priority", "age"]) == 0
    doc = json.loads(capsys.readouterr().out)
    meta = Policy.load(out).meta["cpu_priority"]
    assert set(doc["cpu_priority"]) == set(meta) == {"age"} and np.isfinite(meta["age"]["passthrough"])
    age = doc["cpu_priority"]["age"]  # each figure simulated until its half-width is 2 % of it, six runs at most
    for runs, mean, half in ((age["seeds"], age["mean_response_time"], age["ci95"]),
                             (age["passthrough_seeds"], age["passthrough"], age["passthrough_ci95"])):
        assert 1 <= runs <= 6 and (half <= 0.02 * mean or runs == 6)
    assert main(["solve", str(scen), "--out", str(out), "--quiet", "--cpu-priority", "class"]) == 0
    doc = json.loads(capsys.readouterr().out)
    pol = Policy.load(out)
    cls = pol.meta["cpu_priority"]["class"]
    assert pol.model.weights is not None and cls["solved"] and cls["start_levels"] == [[0, 1]]
    # solved with the classes in force: its E[W] is the chain's, and better than without them
    assert cls["mean_response_time"] == pytest.approx(doc["mean_response_time"], rel=2e-3)
    assert cls["mean_response_time"] < cls["without_lever"]
    # one H2 stage: the cuts of the remaining-work ranking give short-first only
    assert [c["start_levels"] for c in cls["candidates"]] == [[[0, 1]]]
    assert main(["solve", str(scen), "--out", str(out), "--phase-info", "none", "--cpu-priority", "class"]) != 0
    assert "--cpu-priority class" in capsys.readouterr().err


def _plain_gain(model, trunc: Truncation) -> float:  # type: ignore[no-untyped-def]
    from overtake.mdp.average_cost import solve_space
    from overtake.mdp.statespace import StateSpace

    return solve_space(StateSpace(model, trunc), method="rvi", tol=1e-11).gain


def test_class_action_with_equal_weights_is_the_plain_optimum(h2) -> None:  # type: ignore[no-untyped-def]
    # two CPU classes of the same weight are one class: the doubled MDP's optimum is π*'s
    two = tandem(0.6, h2_stage("a", 0.91, 0.55, 5.45), h2_stage("b", 0.91, 0.55, 5.45))
    trunc = Truncation(6, 3)
    r = class_action_optimum(two, trunc, weight=1.0, tol=1e-11)  # Anderson, against RVI's plain gain
    assert r.gain == pytest.approx(_plain_gain(two, trunc), rel=1e-9)
    assert r.fixed_gain == pytest.approx(r.gain, rel=1e-9)


def test_class_action_handles_moving_phases() -> None:
    # Erlang-2 stages: the class must follow the request through its phases (block-diagonal T)
    T = np.array([[-4.0, 4.0], [0.0, -4.0]])
    model = tandem(0.5, Stage("e1", np.array([1.0, 0.0]), T), Stage("e2", np.array([1.0, 0.0]), T))
    trunc = Truncation(6, 3)
    r = class_action_optimum(model, trunc, weight=1.0, tol=1e-11, method="rvi")
    assert r.gain == pytest.approx(_plain_gain(model, trunc), rel=1e-9)
    assert r.fixed_gain is None  # short-first by phase is not exact when phases move
    low = class_action_optimum(model, trunc, weight=0.1, tol=1e-11, method="rvi")
    assert low.gain <= r.gain * (1 + 1e-9)  # more actions never cost


def test_class_action_optimum_bounds_the_fixed_class_optimum(h2) -> None:  # type: ignore[no-untyped-def]
    two = tandem(0.6, h2_stage("a", 0.91, 0.55, 5.45), h2_stage("b", 0.91, 0.55, 5.45))
    trunc = Truncation(7, 3)
    r = class_action_optimum(two, trunc, weight=0.01, tol=1e-11)  # Anderson, the default
    pi_ = class_action_optimum(two, trunc, weight=0.01, tol=1e-11, method="pi")
    assert pi_.gain == pytest.approx(r.gain, rel=1e-9)  # two solvers, one optimum
    assert r.fixed_gain is not None and r.gain <= r.fixed_gain * (1 + 1e-9)
    assert r.gain < _plain_gain(two, trunc)  # the low class helps with H2 stages
    assert r.gain_bounds[0] <= r.gain <= r.gain_bounds[1]
    assert all(0.0 <= s <= 1.0 for s in r.low_share)


def test_layout_rejects_spawn_actions_without_a_queue() -> None:
    from overtake.mdp.statespace import Layout

    with pytest.raises(ValueError, match="action_queue"):
        Layout("full", np.array([0, 0]), (((0, 1.0),),), (((0, 1.0),), ((1, 1.0),), ((1, 1.0),)),
               np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="give action_queue"):
        Layout("full", np.array([0]), (((0, 1.0),),), (((0, 1.0),), ((0, 1.0),)))
    with pytest.raises(ModelError, match="weight"):
        class_action_layout(tandem(0.5, h2_stage("a", 0.91, 0.55, 5.45)), 0.0)


def test_classes_by_remaining_work_beat_short_first_where_the_long_stage_comes_first() -> None:
    # Table 1 case 12's shape: stage 1 slow (2.75 / 27.25), stage 2 fast (0.55 / 5.45). Expected
    # remaining work: (1, short) 3.75, (1, long) 28.25, (2, short) 0.55, (2, long) 5.45; short-first
    # demotes (2, long) although it has less work left than (1, short)
    model = tandem(0.6, h2_stage("a", 0.91, 2.75, 27.25), h2_stage("b", 0.91, 0.55, 5.45))
    cands = class_candidates(model)
    assert cands[0] == ((0, 1), (0, 1))  # short-first first
    assert set(cands[1:]) == {((1, 1), (0, 1)), ((0, 1), (0, 1)), ((0, 1), (0, 0))} - {cands[0]}
    trunc = Truncation(8, 3)
    ch = choose_classes(model, truncation=trunc, tol=1e-3)
    by = dict(ch.candidates)
    assert ch.levels == min(by, key=lambda lv: by[lv])
    assert by[ch.levels] < by[((0, 1), (0, 1))]  # the cut above (2, long) beats short-first here
    assert model_levels(ch.optimum.policy.model) == ch.levels
    # the class as an action bounds every fixed assignment, the chosen one included. Anderson (the
    # default method) rather than RVI: this chain mixes slowly (long phase mean 27.25), RVI needs far
    # more sweeps for the same 1e-9 bounds, and Anderson's agreement with RVI and PI is checked on its
    # own (test_solver_methods; test_class_action_optimum_bounds_the_fixed_class_optimum)
    act = class_action_optimum(model, trunc, tol=1e-9)
    fixed = class_action_optimum(model, trunc, tol=1e-9, levels=((0, 1), (0, 1)))
    assert act.fixed_gain is not None and fixed.fixed_gain is not None
    assert act.gain <= act.fixed_gain * (1 + 1e-9) <= fixed.fixed_gain * (1 + 1e-9)
    with pytest.raises(ModelError, match="levels"):
        class_model(model, levels=((0, 1),))


def test_a_passthrough_simulated_with_other_settings_is_refused():
    """A passthrough computed beside the solve must have been simulated as this prediction asks."""
    from overtake.mdp.priority_prediction import AgePassthrough, predict_priority
    from overtake.mdp.thresholds import choose_tandem_thresholds

    model = tandem(0.3, exp_stage("s1", 1.0), exp_stage("s2", 1.0))
    pt = AgePassthrough(choose_tandem_thresholds(model, common=True), 1.0, 0.1, 1, (50_000, 6, 0, 0.02))
    with pytest.raises(ModelError, match="passthrough was simulated with"):
        predict_priority(model, None, "age", passthrough=pt)  # type: ignore[arg-type]
