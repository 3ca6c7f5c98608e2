"""Coupled stages (``TandemModel.routing``): known answers, conservation and the simulator.

The correlated case: two H2 stages (a small class of mean 0.5 with probability 0.8, a big class
of mean 3, scv 3 each) whose class is kept from stage 1 to stage 2 (R = I): a big preview is
followed by a big view, correlation 1/3 — the most a two-phase stage carries.
"""

from __future__ import annotations

import numpy as np
import pytest

from overtake.mdp import Stage, TandemModel, Truncation, solve
from overtake.mdp.baselines import Baseline
from overtake.mdp.chain import build_chain
from overtake.mdp.errors import ModelError
from overtake.mdp.evaluate import stationary_distribution
from overtake.mdp.heuristic import remaining_work
from overtake.mdp.model import exit_law
from overtake.mdp.policy import model_from_dict, model_to_dict
from overtake.mdp.rule_evaluation import evaluate_baseline, evaluate_rule
from overtake.mdp.scenario import parse_scenario
from overtake.mdp.simulation import simulate
from overtake.mdp.statespace import Layout, StateSpace, count_states

A = np.array([0.8, 0.2])
PREVIEW = Stage("preview", A, np.diag([-2.0, -1.0 / 3.0]))
VIEW = Stage("view", A, np.diag([-2.0, -1.0 / 3.0]))
LAM = 0.6 / (PREVIEW.mean() + VIEW.mean())
KEEP = np.eye(2)  # the class is kept: exit phase j starts phase j


def coupled(R: np.ndarray = KEEP, lam: float = LAM) -> TandemModel:
    return TandemModel(lam, (PREVIEW, VIEW), routing=[R])


def independent(lam: float = LAM) -> TandemModel:
    return TandemModel(lam, (PREVIEW, VIEW))


@pytest.mark.parametrize("phase_info", ["full", "start"])
def test_independent_routing_is_todays_model(phase_info: str) -> None:
    """Every row α₂: the same chain bit for bit, so the same optimum and the same E[W]."""
    tr = Truncation(10, 3)
    same = coupled(np.tile(VIEW.alpha, (2, 1)))
    assert Layout.build(same, phase_info).n_queues == Layout.build(independent(), phase_info).n_queues  # type: ignore[arg-type]
    a = solve(independent(), phase_info=phase_info, truncation=tr)  # type: ignore[arg-type]
    b = solve(same, phase_info=phase_info, truncation=tr)  # type: ignore[arg-type]
    assert b.metrics.mean_response_time == pytest.approx(a.metrics.mean_response_time, rel=1e-9)
    assert np.array_equal(a.policy.keys, b.policy.keys) and np.array_equal(a.policy.spawn, b.policy.spawn)
    for name in ("pi(1)", "pi(2)"):
        ea = evaluate_baseline(independent(), name, tol=1e-5).metrics.mean_response_time
        eb = evaluate_baseline(same, name, tol=1e-5).metrics.mean_response_time
        assert eb == pytest.approx(ea, rel=1e-9)


def test_routing_changes_the_answer() -> None:
    """Keeping the class makes FCFS worse (big previews are followed by big views) and π* better
    (a big request is known as such before its second stage): the routing is not ignored."""
    for name in ("pi(1)", "pi(2)"):
        ind = evaluate_baseline(independent(), name, tol=1e-5).metrics.mean_response_time
        cpl = evaluate_baseline(coupled(), name, tol=1e-5).metrics.mean_response_time
        assert cpl > 1.05 * ind
    # processor sharing is insensitive to the service law beyond its mean: π(∞) does not move
    assert evaluate_baseline(coupled(), "pi(inf)", tol=1e-6).metrics.mean_response_time == pytest.approx(
        evaluate_baseline(independent(), "pi(inf)", tol=1e-6).metrics.mean_response_time, rel=1e-6)


def test_full_layout_keeps_the_state_space_start_adds_a_queue_per_routing_row() -> None:
    tr = Truncation(8, 3)
    assert count_states(coupled(), tr, "full") == count_states(independent(), tr, "full")
    start = Layout.build(coupled(), "start")
    # stage 1: one queue; stage 2: one per distinct routing row (two here)
    assert start.queue_stage.tolist() == [0, 1, 1]
    assert count_states(coupled(), tr, "start") == StateSpace(coupled(), tr, "start").size
    assert count_states(coupled(), tr, "start") > count_states(independent(), tr, "start")
    # two equal rows are one class
    half = coupled(np.array([[0.8, 0.2], [0.8, 0.2]]))
    assert Layout.build(half, "start").n_queues == 2


@pytest.mark.parametrize(("routing", "needle"), [
    ([np.eye(3)], "must be 2x2"),
    ([np.eye(2), np.eye(2)], "one exit-phase x start-phase matrix per pair"),
    ([np.array([[0.5, 0.4], [0.0, 1.0]])], "row 0"),
    ([np.array([[1.2, -0.2], [0.0, 1.0]])], ">= 0"),
    ([np.array([[0.0, 1.0], [0.0, 1.0]])], "alpha"),
])
def test_routing_is_validated(routing: list[np.ndarray], needle: str) -> None:
    with pytest.raises(ModelError, match="routing") as exc:
        coupled(routing[0]) if len(routing) == 1 else TandemModel(LAM, (PREVIEW, VIEW), routing=routing)
    assert needle in str(exc.value)


def test_exit_law_of_a_coxian() -> None:
    """Exit law known by hand: Coxian 1 → 2 with exit probability 1/4 from phase 1."""
    cox = Stage("c", np.array([1.0, 0.0]), np.array([[-4.0, 3.0], [0.0, -2.0]]))
    assert exit_law(cox) == pytest.approx([0.25, 0.75])


def test_policy_file_round_trip_keeps_the_routing() -> None:
    m = coupled()
    back = model_from_dict(model_to_dict(m))
    assert back == m and back.coupled
    assert not model_from_dict(model_to_dict(independent())).coupled


def test_a_routing_read_back_is_the_routing_written() -> None:
    """A row that sums to 1 only up to rounding (as fitted ones do) is not rescaled again when a
    policy file's model is read back: the file's hash covers the model, so a last-bit change
    would make the file look corrupt."""
    row = [0.4325152177214142, 0.5637771777263074, 0.0037076045522782953]  # rescaling it moves bits each pass
    three = Stage("view", np.array(row), np.diag([-2.0, -1.0, -0.5]))
    m = TandemModel(LAM, (PREVIEW, three), routing=[[row, row]])
    back = model_from_dict(model_to_dict(m))
    assert model_to_dict(back) == model_to_dict(m) and back == m


def test_the_heuristics_remaining_work_follows_the_routing() -> None:
    """E[remaining work] from stage-1 phase j is its phase mean plus the mean of the view it starts."""
    mean, _ = remaining_work(coupled())
    m = PREVIEW.phase_means()
    assert mean[:2] == pytest.approx(m + VIEW.phase_means())  # R = I: phase j starts phase j
    mean_i, _ = remaining_work(independent())
    assert mean_i[:2] == pytest.approx(m + VIEW.mean())


def _stage_work_rates(model: TandemModel, layout: Layout, rule: object, C: int, K: int) -> tuple[np.ndarray, float]:
    chain = build_chain(model, layout, rule, max_requests=C, max_threads=K)  # type: ignore[arg-type]
    reach, pi = stationary_distribution(chain.P)
    rows = chain.rows[reach]
    Q = layout.n_queues
    k = rows[:, Q:Q + model.n_coords]
    Kt = k.sum(axis=1)
    share = np.where(Kt > 0, model.capacity(Kt) / np.maximum(Kt, 1), 0.0)
    cs = model.coord_stage()
    rates = np.array([float(pi @ (k[:, cs == i].sum(axis=1) * share)) for i in range(model.n_stages)])
    blocked = float(pi[rows.sum(axis=1) >= C].sum())
    return rates, model.arrival_rate * (1 - blocked)


@pytest.mark.parametrize("phase_info", ["full", "start"])
def test_work_conservation_per_stage(phase_info: str) -> None:
    """The processor gives stage i work at rate λ_eff E[S_i] in the coupled chains: the routing
    keeps each stage's own service law (a wrong start law would change E[S_2])."""
    model = coupled()
    layout = Layout.build(model, phase_info)  # type: ignore[arg-type]
    if phase_info == "full":
        rule = solve(model, truncation=Truncation(10, 3)).policy.actions
    else:
        rule = Baseline.parse("pi(2)", 2).rule(layout.queue_stage, model.coord_stage())
    rates, lam_eff = _stage_work_rates(model, layout, rule, 16, 3)
    assert rates == pytest.approx([lam_eff * PREVIEW.mean(), lam_eff * VIEW.mean()], rel=1e-9)


def test_simulator_agrees_with_the_exact_evaluation() -> None:
    """π* of the coupled model and π(1) (FCFS, where the correlation shows most): the simulated
    mean within its 95 % CI of the exact one, the independent model's answer outside it; Little's
    law per stage on the threads."""
    model = coupled()
    opt = solve(model, truncation=Truncation(12, 4))
    cases = [
        (opt.policy, evaluate_rule(model, Layout.build(model, "full"), opt.policy.actions, max_requests=40,
                                   max_threads=4).mean_response_time,
         evaluate_rule(independent(), Layout.build(independent(), "full"), opt.policy.actions, max_requests=40,
                       max_threads=4).mean_response_time),
        ("pi(1)", evaluate_baseline(model, "pi(1)", tol=1e-5).metrics.mean_response_time,
         evaluate_baseline(independent(), "pi(1)", tol=1e-5).metrics.mean_response_time),
    ]
    for policy, exact, other in cases:
        sim = simulate(model, policy, requests=300_000, seed=7, batches=30)
        assert abs(sim.mean_response_time - exact) <= sim.ci95 + 2e-3 * exact, (policy, sim.mean_response_time, exact)
        assert abs(sim.mean_response_time - other) > 2 * sim.ci95
        for st in sim.stages:
            busy = sim.arrival_rate * (st.mean_sojourn - st.mean_waiting)
            assert st.mean_threads == pytest.approx(busy, rel=0.03)


def test_simulator_refuses_what_it_cannot_run() -> None:
    model = coupled()
    start = solve(model, phase_info="start", truncation=Truncation(8, 2))
    with pytest.raises(ModelError, match="routing.*phase_info full"):
        simulate(model, start.policy, requests=1000, batches=10)


def test_observation_solves_refuse_coupled_stages() -> None:
    with pytest.raises(ModelError, match="routing: coupled stages are solved with phase_info full or start"):
        solve(coupled(), phase_info="none", truncation=Truncation(6, 2))


def _scenario(**extra: object) -> dict[str, object]:
    h2 = {"hyperexponential": {"probs": [0.8, 0.2], "means": [0.5, 3.0]}}
    return {"load": 0.6, "stages": [{"name": "preview", "service": h2}, {"name": "view", "service": h2}], **extra}


def test_scenario_routing_key() -> None:
    model = parse_scenario(_scenario(routing=[[[1, 0], [0, 1]]])).build_model()
    assert model.coupled and model == coupled(lam=model.arrival_rate)
    assert not parse_scenario(_scenario()).build_model().coupled
    for bad, needle in [([[[1, 0, 0], [0, 1, 0]]], "must be 2x2"), ([[[0.5, 0.4], [0, 1]]], "normalise the row"),
                        ([[[0, 1], [0, 1]]], "set that stage's alpha")]:
        with pytest.raises(ModelError, match="^routing") as exc:
            parse_scenario(_scenario(routing=bad)).build_model()
        assert needle in str(exc.value) and "scenario key routing" in str(exc.value)
    for info in ("none", "start"):
        with pytest.raises(ModelError, match="routing: a scenario with coupled stages is solved with phase_info full"):
            parse_scenario(_scenario(routing=[[[1, 0], [0, 1]]], phase_info=info)).build_model()


def test_the_state_budget_counts_the_routing_rows() -> None:
    """A phase-blind solve of coupled stages is refused by the state budget, its extra queues counted."""
    from overtake.mdp.budget import StateBudgetError, check_budget

    tr = Truncation(10, 3)
    n_ind = check_budget(independent(), max_states=10**9, truncation=tr, phase_info="start")
    n_cpl = check_budget(coupled(), max_states=10**9, truncation=tr, phase_info="start")
    assert n_cpl == StateSpace(coupled(), tr, "start").size > n_ind
    with pytest.raises(StateBudgetError, match="exceeds --max-states"):
        check_budget(coupled(), max_states=n_cpl - 1, truncation=tr, phase_info="start")
    assert check_budget(coupled(), max_states=10**9, truncation=tr) == check_budget(independent(), max_states=10**9,
                                                                                    truncation=tr)
