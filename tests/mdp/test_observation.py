"""Observation policies (phase_info none / route) against known answers and invariants.

* the observation is the state when every stage has one phase: the local search is Howard's policy
  iteration there, and its table is π* exactly;
* more information never hurts: π*(full) ≤ π*(start) ≤ best(none) on one truncation, and a route
  split sits between full and none;
* the chain's decisions are constant on each observation class;
* every accepted improvement step lowers the exact gain, and the gain it reports is the one an
  independent evaluation (breadth-first chain, Gauss–Seidel stationary law) finds;
* a single H2 stage on a cap of 3 requests has 72 deterministic observation policies: the
  exhaustive minimum is the search's answer;
* E W(none) is at most every baseline's exactly evaluated E[W] (auto-truncation).
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.mdp.average_cost import induced_matrix, policy_iteration
from overtake.mdp.errors import ModelError
from overtake.mdp.model import Stage
from overtake.mdp.observation import ObservationSpace, observe
from overtake.mdp.observed import solve_observed
from overtake.mdp.observed_chain import evaluate_observed
from overtake.mdp.observed_improve import improve
from overtake.mdp.observed_tables import stage_rule, starting_tables
from overtake.mdp.policy import Policy
from overtake.mdp.routes import RouteSplit
from overtake.mdp.rule_evaluation import evaluate_baseline
from overtake.mdp.statespace import Layout, StateSpace, Truncation


def _exact_gain(space: StateSpace, decision: np.ndarray) -> float:
    from overtake.mdp.average_cost import evaluate_bias

    gamma, _ = evaluate_bias(space, induced_matrix(space, decision), space.cost / space.rate)
    return gamma * space.rate


def erlang(name: str, k: int, mean: float) -> Stage:
    rate = k / mean
    return Stage(name, np.eye(k)[0], -rate * np.eye(k) + rate * np.eye(k, k=1))


# ---- known answers ------------------------------------------------------------------------------
def test_single_exponential_stage_gain_is_the_mm1c_queue() -> None:
    """One exponential stage, PS at rate 1 with any number of threads: E[N] of M/M/1/C."""
    rho, C = 0.6, 6
    model = tandem(rho, exp_stage("a", 1.0))
    osp = ObservationSpace(model, Truncation(C), Layout.build(model, "none"), blocking_cost=False)
    for table in (osp.classes[:, :1], np.minimum(osp.classes[:, :1], 1)):  # π(∞), and one per epoch
        ev = osp.evaluate(osp.repair(table))
        want = rho / (1 - rho) - (C + 1) * rho ** (C + 1) / (1 - rho ** (C + 1))
        assert ev.gain == pytest.approx(want, rel=1e-10)


def test_none_is_full_with_exponential_stages() -> None:
    """One phase per stage: the observation is the state; starting from π(∞) the search (then
    Howard's policy iteration) reaches π*, whose gain policy iteration on the full layout gives."""
    model = tandem(0.6, exp_stage("a", 1.0), exp_stage("b", 5.0))
    tr = Truncation(8)
    full = policy_iteration(StateSpace(model, tr, "full"))
    g_full = _exact_gain(full.space, full.decision)
    for start in (["pi(inf)"], None):
        opt = solve_observed(model, truncation=tr, baselines=start, heuristic=start is None)
        assert opt.solve.gain == pytest.approx(g_full, rel=1e-10)
    opt = solve_observed(model, truncation=tr, baselines=["pi(inf)"], heuristic=False)
    assert any(h.get("accepted") for h in opt.solve.history)  # it had to move away from π(∞)


def _models() -> list[tuple[str, object]]:
    return [
        ("case 4 (H2, H2)", tandem(0.6, h2_stage("s1", 0.91, 0.55, 5.45), h2_stage("s2", 0.91, 0.55, 5.45))),
        ("case 7 (H2, exp)", tandem(0.6, h2_stage("s1", 0.91, 0.55, 5.45), exp_stage("s2", 5.0))),
        ("exp, H2 at load 0.8", tandem(0.8, exp_stage("s1", 1.0), h2_stage("s2", 0.8, 0.2, 3.0))),
        ("Erlang-2, H2", tandem(0.6, erlang("s1", 2, 1.0), h2_stage("s2", 0.9, 0.5, 5.5))),
    ]


@pytest.mark.parametrize("name,model", _models())
def test_more_information_never_hurts(name: str, model) -> None:  # type: ignore[no-untyped-def]
    """g(π*, full) ≤ g(π*, start) ≤ g(best none) on one truncation (same caps, same blocking cost)."""
    tr = Truncation(6)
    full = policy_iteration(StateSpace(model, tr, "full"))
    start = policy_iteration(StateSpace(model, tr, "start"))
    none = solve_observed(model, truncation=tr)
    g_full, g_start = _exact_gain(full.space, full.decision), _exact_gain(start.space, start.decision)
    assert g_full <= g_start * (1 + 1e-9)
    assert g_start <= none.solve.gain * (1 + 1e-9)
    # each local search (one per starting table) lowers the gain at every step; the best is kept
    runs: list[list[float]] = []
    for h in none.solve.history:
        if h["iteration"] == 0:
            runs.append([h["gain"]])
        elif h.get("accepted"):
            runs[-1].append(h["gain"])
    assert len(runs) == 3
    assert all(b < a for run in runs for a, b in itertools.pairwise(run))
    assert none.solve.gain == min(run[-1] for run in runs)


def test_improvement_steps_lower_the_exact_gain_and_match_an_independent_evaluation() -> None:
    model = tandem(0.6, exp_stage("s1", 1.0), h2_stage("s2", 0.91, 0.55, 5.45))  # Table 1, case 2
    tr = Truncation(8)
    layout = Layout.build(model, "none")
    osp = ObservationSpace(model, tr, layout)
    start = osp.table(stage_rule(model, "pi(2)"))
    imp = improve(osp, start, start="pi(2)")
    gains = [h["gain"] for h in imp.history if h["iteration"] == 0 or h.get("accepted")]
    assert len(gains) >= 3  # it moved
    assert all(b < a for a, b in itertools.pairwise(gains))
    # independently: the table as a policy file, its chain built breadth-first, Gauss–Seidel
    pol = osp.policy(imp.actions)
    m = evaluate_observed(model, layout, pol.actions, max_requests=tr.max_requests, max_threads=tr.k_max)
    assert m.mean_response_time == pytest.approx(imp.evaluation.metrics.mean_response_time, rel=1e-9)
    m0 = evaluate_observed(model, layout, stage_rule(model, "pi(2)"), max_requests=tr.max_requests)
    assert m0.mean_response_time == pytest.approx(imp.history[0]["mean_response_time"], rel=1e-9)


def test_baseline_tables_evaluate_as_the_baselines() -> None:
    """π(k) and π(∞) are observation policies: on one cap their tables' exact E[W] is the
    baselines' (phase-at-start chain, breadth-first, decisions at every event)."""
    model = tandem(0.6, h2_stage("s1", 0.91, 0.55, 5.45), h2_stage("s2", 0.91, 0.55, 5.45))
    C = 8
    osp = ObservationSpace(model, Truncation(C), Layout.build(model, "none"))
    from overtake.mdp.baselines import Baseline
    from overtake.mdp.rule_evaluation import evaluate_rule

    for name in ("pi(1)", "pi(2)", "pi(inf)", "pi(1,1)"):
        ev = osp.evaluate(osp.table(stage_rule(model, name)))
        b = Baseline.parse(name, 2)
        lay = Layout.build(model, "start")
        want = evaluate_rule(model, lay, b.rule(lay.queue_stage, model.coord_stage()), max_requests=C,
                             max_threads=b.max_threads)
        assert ev.metrics.mean_response_time == pytest.approx(want.mean_response_time, rel=1e-9), name


def test_decisions_are_constant_on_observation_classes() -> None:
    model = tandem(0.6, h2_stage("s1", 0.91, 0.55, 5.45), erlang("s2", 2, 1.0))
    opt = solve_observed(model, truncation=Truncation(6))
    pol = opt.policy
    osp = ObservationSpace(model, Truncation(6), Layout.build(model, "none"))
    table = pol.actions(osp.classes)
    R = osp.decision_matrix(table).tocoo()
    # threads started from each queue in state y: w(y) − E[w(post)], the class's action for every y
    Q = osp.Q
    started = np.zeros((osp.size, Q))
    np.add.at(started, R.row, R.data[:, None] * (osp.space.rows[R.row, :Q] - osp.space.rows[R.col, :Q]))
    assert np.allclose(started, table[osp.class_of])
    # the artifact answers by observation: every full state of a class gets the class's action
    obs = observe(model, osp.layout, osp.space.rows)
    assert np.array_equal(pol.actions(obs), table[osp.class_of])


def test_exhaustive_search_on_a_single_h2_stage() -> None:
    """One H2 stage, cap 3: 72 deterministic observation policies; the search finds the best."""
    model = tandem(0.7, h2_stage("s", 0.8, 0.3, 3.8))
    tr = Truncation(3)
    osp = ObservationSpace(model, tr, Layout.build(model, "none"))
    choices = []
    for o in osp.classes:
        w, K = int(o[0]), int(o[1])
        lo = 1 if K == 0 and w > 0 else 0
        choices.append(range(lo, min(w, 3 - K) + 1))
    assert math.prod(len(c) for c in choices) == 72
    best = min(osp.evaluate(np.array(t)[:, None]).gain for t in itertools.product(*choices))
    assert solve_observed(model, truncation=tr).solve.gain == pytest.approx(best, rel=1e-10)


@pytest.mark.parametrize("model", [
    tandem(0.7, h2_stage("s", 0.8, 0.3, 3.8)),  # the improved table wins
    tandem(0.6, exp_stage("s1", 1.0), exp_stage("s2", 5.0)),  # π(1) is optimal: a tie at best
])
def test_none_is_never_worse_than_a_baseline(model) -> None:  # type: ignore[no-untyped-def]
    """Auto-truncation: E W(none) ≤ min over the baselines, each exactly evaluated."""
    opt = solve_observed(model, tol=1e-3)
    ew = opt.metrics.mean_response_time
    names = ["pi(1)", "pi(2)", "pi(4)", "pi(inf)"] + (["pi(1,1)"] if model.n_stages == 2 else [])
    for name in names:
        assert ew <= evaluate_baseline(model, name, tol=1e-3).metrics.mean_response_time
    assert opt.source in opt.candidates and opt.candidates[opt.source] == ew
    assert ew == min(opt.candidates.values())


# ---- routes -------------------------------------------------------------------------------------
def _split(model, s_light: float = 0.99, s_heavy: float = 0.1) -> RouteSplit:  # type: ignore[no-untyped-def]
    """Two routes on the last (H2) stage, 'light' and 'heavy', averaging to its α."""
    a = model.stages[-1].alpha[0]
    p = (a - s_heavy) / (s_light - s_heavy)
    routes: list[list[tuple[str, float, list[float]]] | None] = [None] * (model.n_stages - 1)
    routes.append([("light", p, [s_light, 1 - s_light]), ("heavy", 1 - p, [s_heavy, 1 - s_heavy])])
    return RouteSplit.build(model, routes)


@pytest.fixture(scope="module")
def case2_observed():  # type: ignore[no-untyped-def]
    """Table 1 case 2 solved with phase_info none and route (the light/heavy split) on one cap: the
    searches are the expensive part, and the tests below only read their results."""
    model = tandem(0.6, exp_stage("s1", 1.0), h2_stage("s2", 0.91, 0.55, 5.45))
    tr = Truncation(6)
    none = solve_observed(model, truncation=tr)
    route = solve_observed(model, phase_info="route", routes=_split(model), truncation=tr)
    return model, tr, none, route


def test_route_sits_between_full_and_none(case2_observed) -> None:  # type: ignore[no-untyped-def]
    model, tr, none, route = case2_observed
    full = policy_iteration(StateSpace(model, tr, "full"))
    assert _exact_gain(full.space, full.decision) <= route.solve.gain * (1 + 1e-9)
    assert route.metrics.mean_response_time <= none.metrics.mean_response_time
    assert route.source == "improved" and route.policy.phase_info == "route"
    # routes that reveal the phase (α = e_j) are the full layout's waiting queues: for H2 stages,
    # whose phases never move, route then sees everything but the active threads' phases
    exact = _split(model, 1.0, 0.0)
    perfect = solve_observed(model, phase_info="route", routes=exact, truncation=tr)
    assert perfect.solve.gain <= route.solve.gain * (1 + 1e-9)


def test_a_single_route_per_stage_is_none() -> None:
    model = tandem(0.6, h2_stage("s1", 0.91, 0.55, 5.45), exp_stage("s2", 1.0))
    tr = Truncation(6)
    a = ObservationSpace(model, tr, Layout.build(model, "none"))
    b = ObservationSpace(model, tr, RouteSplit.single(model).layout(model, "none"))
    t = a.table(lambda o: np.minimum(o[:, :2], 1))
    assert a.evaluate(t).gain == pytest.approx(b.evaluate(t).gain, rel=1e-12)


def test_route_split_validation_names_the_field() -> None:
    model = tandem(0.6, exp_stage("s1", 1.0), h2_stage("s2", 0.91, 0.55, 5.45))
    with pytest.raises(ModelError, match=r"stages\.1\.routes: the routes' mixture"):
        RouteSplit.build(model, [None, [("a", 0.5, [0.99, 0.01]), ("b", 0.5, [0.1, 0.9])]])
    with pytest.raises(ModelError, match=r"stages\.1\.routes\.0\.alpha: must be 2 probabilities"):
        RouteSplit.build(model, [None, [("a", 1.0, [1.0])]])
    with pytest.raises(ModelError, match=r"stages\.1\.routes: weights must be > 0 and sum to 1"):
        RouteSplit.build(model, [None, [("a", 0.7, [0.91, 0.09]), ("b", 0.7, [0.91, 0.09])]])


# ---- the artifact -------------------------------------------------------------------------------
@pytest.mark.parametrize("info", ["none", "route"])
def test_observation_policy_file_round_trip(tmp_path, info: str) -> None:  # type: ignore[no-untyped-def]
    model = tandem(0.6, exp_stage("s1", 1.0), h2_stage("s2", 0.91, 0.55, 5.45))
    routes = _split(model) if info == "route" else None
    opt = solve_observed(model, phase_info=info, routes=routes, truncation=Truncation(5))  # type: ignore[arg-type]
    path = tmp_path / "p.npz"
    opt.policy.save(path)
    pol = Policy.load(path)
    assert pol.phase_info == info and pol.digest() == opt.policy.digest()
    want = ["waiting:s1"] + (["waiting:s2/light", "waiting:s2/heavy"] if info == "route" else ["waiting:s2"])
    assert pol.columns == want + ["threads:s1", "threads:s2"]
    rows = np.array([[2, 1, *([0] if info == "route" else []), 0, 1]])
    assert np.array_equal(pol.actions(rows), opt.policy.actions(rows))


def test_simulated_observation_policies_match_their_exact_evaluation(case2_observed) -> None:  # type: ignore[no-untyped-def]
    """The simulator (decisions at arrivals and completions, route drawn at each stage entry)
    against the exact chain of the same artifact on a cap where blocking is negligible: below
    1e-5, the cap moves E[W] by about 1e-4, a few thousandths of the simulation's ci95 (about
    0.08), so the check keeps its power while the cap keeps the route chain small."""
    from overtake.mdp.simulation import simulate

    model, _, none, route = case2_observed
    for opt, seed in ((none, 31), (route, 32)):
        pol = opt.policy
        lay = pol.layout
        exact = evaluate_observed(model, lay, pol.actions, max_requests=25)
        assert exact.blocking_probability < 1e-5
        res = simulate(model, pol, requests=300_000, seed=seed)
        assert abs(res.mean_response_time - exact.mean_response_time) <= 1.5 * res.ci95, pol.phase_info
        assert res.mean_threads == pytest.approx(exact.mean_threads, rel=0.03)


# ---- the CLI ------------------------------------------------------------------------------------
def test_cli_compare_and_solve_with_phase_info_none(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from overtake.api.cli import main

    scen = tmp_path / "s.yaml"
    scen.write_text(
        "load: 0.5\ntruncation: {max_requests: 6}\nstages:\n"
        "  - {name: stage1, service: {exponential: {mean: 1.0}}}\n"
        "  - {name: stage2, service: {hyperexponential: {probs: [0.91, 0.09], means: [0.55, 5.45]}},\n"
        "     routes: [{name: light, weight: 0.9101123595505618, alpha: [0.99, 0.01]},\n"
        "              {name: heavy, weight: 0.0898876404494382, alpha: [0.1, 0.9]}]}\n"
    )
    assert main(["compare", str(scen), "--phase-info", "none", "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {"policies", "gains", "arrival_rate", "load", "states", "iterations", "method",
                        "gain_bounds", "truncation", "seconds", "observation"}
    assert all(g >= 0 for g in doc["gains"].values())
    assert set(doc["policies"]) == {"pi*", "pi(1)", "pi(4)", "pi(inf)", "pi(1,1)"}
    out = tmp_path / "p.npz"
    assert main(["solve", str(scen), "--phase-info", "route", "--out", str(out), "--quiet"]) == 0
    solved = json.loads(capsys.readouterr().out)
    assert solved["phase_info"] in ("route", "none") and Policy.load(out).observed
    assert solved["mean_response_time"] <= doc["policies"]["pi*"]["mean_response_time"]
    assert main(["simulate", str(scen), "--policy", str(out), "--requests", "3000", "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 3000


def test_scenario_phase_info_and_routes() -> None:
    from overtake.mdp.scenario import parse_scenario

    h2 = {"hyperexponential": {"probs": [0.91, 0.09], "means": [0.55, 5.45]}}
    routes = [{"name": "light", "weight": 0.9101123595505618, "alpha": [0.99, 0.01]},
              {"name": "heavy", "weight": 0.0898876404494382, "alpha": [0.1, 0.9]}]
    sc = parse_scenario({"load": 0.6, "phase_info": "route", "stages": [
        {"name": "a", "service": {"exponential": {"mean": 1.0}}}, {"name": "b", "service": h2, "routes": routes}]})
    split = sc.build_routes(sc.build_model())
    assert split is not None and split.n_queues == 3 and split.queue_labels(sc.build_model())[1:] == ["b/light", "b/heavy"]
    bare = parse_scenario({"load": 0.6, "phase_info": "route", "stages": [{"name": "b", "service": h2}]})
    with pytest.raises(ModelError, match=r"phase_info: 'route' needs routes on at least one stage"):
        bare.build_routes(bare.build_model())
    with pytest.raises(ModelError, match=r"^phase_info: Input should be 'full', 'start', 'none' or 'route'"):
        parse_scenario({"load": 0.6, "phase_info": "hidden", "stages": [{"name": "b", "service": h2}]})
    bad = parse_scenario({"load": 0.6, "stages": [{"name": "b", "service": h2, "routes": routes[:1]}]})
    with pytest.raises(ModelError, match=r"stages\.0\.routes: weights must be > 0 and sum to 1"):
        bad.build_routes(bad.build_model())


def test_iterative_evaluation_agrees_with_the_direct_solve(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large chains evaluate a trial table by BiCGSTAB, preconditioned by the space's cheapest LU
    and started from the current table's solution, instead of a new LU (ObservationSpace.evaluate):
    the gain, E[W], bias and stationary laws agree with a direct solve to 1e-9 relative, and a
    local search takes the same steps either way. The chain here is small; the size above which
    the iterative path is taken is lowered to 0 so that it is."""
    from overtake.mdp import observation_exact

    model = tandem(0.6, exp_stage("s1", 1.0), h2_stage("s2", 0.91, 0.55, 5.45))  # Table 1, case 2
    layout = _split(model).layout(model)
    tr = Truncation(7)
    start = starting_tables(ObservationSpace(model, tr, layout), ["pi(inf)"], False, {})["pi(inf) (lightest route first)"]
    direct = improve(ObservationSpace(model, tr, layout), start, start="pi(inf)")
    calls: list[bool] = []
    iterate = observation_exact.Factor.iterate

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = iterate(self, *args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(observation_exact, "DIRECT_STATES", 0)
    monkeypatch.setattr(observation_exact.Factor, "iterate", counted)
    osp = ObservationSpace(model, tr, layout)
    assert osp.size > 1000
    fast = improve(osp, start, start="pi(inf)")
    assert len(calls) >= 4 and all(calls)  # the iterative path was taken, and converged every time
    assert np.array_equal(fast.actions, direct.actions)
    assert [h.get("accepted") for h in fast.history] == [h.get("accepted") for h in direct.history]
    for a, b in zip(fast.history, direct.history, strict=True):
        if "gain" in b:
            assert a["gain"] == pytest.approx(b["gain"], rel=1e-9)
            assert a["mean_response_time"] == pytest.approx(b["mean_response_time"], rel=1e-9)
    # one far step, field by field: the current table's proposal in every class
    ev0 = osp.evaluate(start)
    B = osp.propose(start, ev0).actions
    changed = osp.class_size[np.any(B != start, axis=1)].sum()
    assert changed > observation_exact.LOW_RANK  # BiCGSTAB, not the low-rank GMRES
    n = len(calls)
    it, dr = osp.evaluate(B, near=ev0), ObservationSpace(model, tr, layout).evaluate(B)
    assert len(calls) > n and calls[-1] and not it.refactored and dr.refactored
    assert it.gain == pytest.approx(dr.gain, rel=1e-9)
    assert it.metrics.mean_response_time == pytest.approx(dr.metrics.mean_response_time, rel=1e-9)
    for x, y in ((it.bias, dr.bias), (it.post, dr.post), (it.epochs, dr.epochs)):
        assert np.abs(x - y).max() <= 1e-9 * np.abs(y).max()


class _Clock:
    """A ``time`` module whose clock advances ``step`` seconds per reading (a fast or a loaded machine)."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


def test_iterative_search_does_not_depend_on_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The iterative solves stop on work, not on time: a machine 10⁶ times slower takes the same
    path (each solve iterative or direct alike) to the same table and bitwise the same gains."""
    from overtake.mdp import factor, observation_exact

    model = tandem(0.6, exp_stage("s1", 1.0), h2_stage("s2", 0.91, 0.55, 5.45))  # Table 1, case 2
    layout = _split(model).layout(model)
    tr = Truncation(7)
    monkeypatch.setattr(observation_exact, "DIRECT_STATES", 0)  # the iterative path on this small chain
    start = starting_tables(ObservationSpace(model, tr, layout), ["pi(inf)"], False, {})["pi(inf) (lightest route first)"]
    iterate = observation_exact.Factor.iterate
    runs = []
    for step in (1e-6, 1.0):
        monkeypatch.setattr(factor, "time", _Clock(step))
        calls: list[bool] = []

        def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            out = iterate(self, *args, **kwargs)
            calls.append(out is not None)  # noqa: B023 (called within this iteration)
            return out

        monkeypatch.setattr(observation_exact.Factor, "iterate", counted)
        runs.append((improve(ObservationSpace(model, tr, layout), start, start="pi(inf)"), calls))
    (fast, fast_calls), (slow, slow_calls) = runs
    assert len(fast_calls) >= 4 and any(fast_calls)  # the iterative path was taken
    assert slow_calls == fast_calls
    assert np.array_equal(fast.actions, slow.actions)
    assert [h.get("gain") for h in fast.history] == [h.get("gain") for h in slow.history]
    assert fast.evaluation.gain == slow.evaluation.gain


def test_iterative_solves_given_up_after_failing_in_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A space whose iterative solves keep missing their budget factors its trials at once after
    ITER_GIVE_UP failures in a row (ObservationSpace.evaluate), with the same answers: every
    trial's gain, E[W] and law agree with a space that factors every table (1e-9 relative), and a
    solve that converges resets the count. The failures are made by a budget of one iteration."""
    from overtake.mdp import observation_exact

    model = tandem(0.6, exp_stage("s1", 1.0), h2_stage("s2", 0.91, 0.55, 5.45))  # Table 1, case 2
    layout = Layout.build(model, "none")
    tr = Truncation(7)
    monkeypatch.setattr(observation_exact, "DIRECT_STATES", 0)  # the iterative path on this small chain
    osp, ref = ObservationSpace(model, tr, layout), ObservationSpace(model, tr, layout)
    start = starting_tables(osp, ["pi(inf)", "pi(2)"], False, {})
    A, B = start["pi(inf)"], start["pi(2)"]
    assert np.any(A != B)
    calls: list[bool] = []
    iterate = observation_exact.Factor.iterate
    starve = [True]

    def counted(self, A_, B_, X0, *, budget, trans=False):  # type: ignore[no-untyped-def]
        out = iterate(self, A_, B_, X0, budget=1 if starve[0] else budget, trans=trans)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(observation_exact.Factor, "iterate", counted)
    ev = osp.evaluate(A)
    tables = [B, A, B, A, B]
    for k, T in enumerate(tables):
        got, want = osp.evaluate(T, near=ev), ref.evaluate(T)
        assert got.refactored  # each starved solve failed: a new factorization answered
        assert got.gain == pytest.approx(want.gain, rel=1e-9)
        assert got.metrics.mean_response_time == pytest.approx(want.metrics.mean_response_time, rel=1e-9)
        assert np.abs(got.post - want.post).max() <= 1e-9 * want.post.max()
        # iterative attempts: one per trial until ITER_GIVE_UP failed in a row, none after
        assert len(calls) == min(k + 1, observation_exact.ITER_GIVE_UP) and not any(calls)
        ev = got
    assert observation_exact.ITER_GIVE_UP < len(tables)  # the attempts stopped
    # a converging solve resets the count
    osp2 = ObservationSpace(model, tr, layout)
    ev2 = osp2.evaluate(A)
    failed = osp2.evaluate(B, near=ev2)
    assert failed.refactored and osp2.exact.iter_failed == 1
    starve[0] = False
    calls.clear()
    ok = osp2.evaluate(A, near=failed)
    assert calls and all(calls) and not ok.refactored and osp2.exact.iter_failed == 0


def test_debug_log_accounts_for_every_search(caplog) -> None:  # type: ignore[no-untyped-def]
    """The debug lines name one search per start, with the evaluations and gains the trace records."""
    import logging
    import re

    model = tandem(0.6, exp_stage("s1", 1.0), h2_stage("s2", 0.91, 0.55, 5.45))
    with caplog.at_level(logging.DEBUG, logger="overtake.mdp.observed"):
        opt = solve_observed(model, phase_info="route", routes=_split(model), truncation=Truncation(4))
    lines = [r.getMessage() for r in caplog.records if r.name == "overtake.mdp.observed"]
    assert any(line.startswith("route: solve cap 4 ") for line in lines)
    found = {m[1]: (int(m[2]), float(m[3])) for line in lines
             if (m := re.match(r"route:\s+from (.+): (\d+) evaluations, \d+ steps, g = (\S+); stop: .+", line))}
    entry = next(t for t in opt.trace if "improved_gains" in t)
    assert set(found) == set(entry["improved_gains"])
    assert sum(n for n, _ in found.values()) == entry["evaluations"]
    for k, (_, g) in found.items():
        assert g == pytest.approx(entry["improved_gains"][k], rel=1e-9)


def test_equal_starting_tables_are_searched_once() -> None:
    """A table equal to an earlier start is dropped (its search would repeat the earlier one): the
    answer's gain is the one of the search from the same table under its other name."""
    from overtake.mdp.observed import distinct  # re-exported from observed_improve

    model = tandem(0.6, exp_stage("s1", 1.0), h2_stage("s2", 0.91, 0.55, 5.45))
    osp = ObservationSpace(model, Truncation(4), _split(model).layout(model))
    tables = starting_tables(osp, ["pi(1)", "pi(inf)", "pi(2)"], False, {})
    tables["copy of pi(inf)"] = tables["pi(inf) (lightest route first)"].copy()
    kept = distinct(tables)
    assert list(kept) == ["pi(1) (lightest route first)", "pi(inf) (lightest route first)",
                          "pi(2) (lightest route first)"]
    once = improve(osp, kept["pi(inf) (lightest route first)"])
    twice = improve(osp, tables["copy of pi(inf)"])
    assert once.evaluation.gain == pytest.approx(twice.evaluation.gain, rel=1e-12)
