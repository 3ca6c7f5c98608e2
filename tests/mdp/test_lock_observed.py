"""A stage with a lock under policies that see counts only (``phase_info`` none and route): known
answers, holding at the lock against blocking, the policy's projection and the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from overtake.mdp import Stage, TandemModel, Truncation, solve
from overtake.mdp.evaluate import stationary_distribution
from overtake.mdp.observation import ObservationSpace, observe
from overtake.mdp.observed import holds_at_locks, solve_observed
from overtake.mdp.observed_chain import evaluate_observed, observed_chain
from overtake.mdp.observed_tables import stage_rule
from overtake.mdp.routes import RouteSplit
from overtake.mdp.rule_evaluation import evaluate_baseline, grow_requests
from overtake.mdp.simulation import simulate
from overtake.mdp.statespace import Layout

H2 = Stage("preview", np.array([0.8, 0.2]), np.diag([-4.0, -0.4]))
EXP = Stage("view", np.array([1.0]), np.array([[-1.5]]))


def pollaczek_khinchine(stage: Stage, lam: float) -> float:
    rho = lam * stage.mean()
    return stage.mean() + lam * stage.second_moment() / (2 * (1 - rho))


def split(model: TandemModel) -> RouteSplit:
    """Two routes on the first (H2) stage, 'small' and 'big', averaging to its α."""
    a = model.stages[0].alpha
    big = [(a[0] - 0.7 * 0.99) / 0.3, (a[1] - 0.7 * 0.01) / 0.3]
    return RouteSplit.build(model, [[("small", 0.7, [0.99, 0.01]), ("big", 0.3, big)], None])


@pytest.mark.parametrize("phase_info", ["none", "route"])
def test_a_lock_as_wide_as_the_thread_cap_changes_nothing(phase_info: str) -> None:
    tr = Truncation(8, 3)
    plain = TandemModel(0.5, (H2, EXP))
    ref = solve(plain, phase_info=phase_info, routes=split(plain) if phase_info == "route" else None,  # type: ignore[arg-type]
                truncation=tr)
    for m in (3, 5):
        model = TandemModel(0.5, (H2, EXP), locks=(m, m))
        got = solve(model, phase_info=phase_info, routes=split(model) if phase_info == "route" else None,  # type: ignore[arg-type]
                    truncation=tr)
        assert got.metrics.mean_response_time == pytest.approx(ref.metrics.mean_response_time, rel=1e-9)
    narrow = TandemModel(0.5, (H2, EXP), locks=(1, None))
    got = solve(narrow, phase_info=phase_info, routes=split(narrow) if phase_info == "route" else None,  # type: ignore[arg-type]
                truncation=tr)
    assert got.metrics.mean_response_time > 1.01 * ref.metrics.mean_response_time


@pytest.mark.parametrize("k", [1, 2, 3])
def test_one_locked_stage_under_a_blind_thread_cap_is_pollaczek_khinchine(k: int) -> None:
    """Whatever a blind thread cap k >= 1 admits, the lock serves one request at a time at full
    speed: M/G/1 FCFS. Rule as Apache runs it (threads beyond the lock block) and the table held
    at the lock alike."""
    lam = 0.5
    model = TandemModel(lam, (H2,), locks=(1,))
    layout = Layout.build(model, "none")

    def cap(obs: np.ndarray) -> np.ndarray:
        return np.minimum(obs[:, :1], np.maximum(k - obs[:, 1:], 0))

    pk = pollaczek_khinchine(H2, lam)
    m, _ = grow_requests(lambda C: evaluate_observed(model, layout, cap, max_requests=C), 20, 1e-7, "cap")
    assert m.mean_response_time == pytest.approx(pk, rel=1e-6)
    ch = observed_chain(model, layout, cap, max_requests=20)
    assert ch.rows.shape[1] == 1 + 2 + 2  # waiting, holders per phase, blocked per phase
    assert ch.rows[:, 3:].sum(axis=1).max() == k - 1  # threads beyond the lock block, up to the cap
    osp = ObservationSpace(model, Truncation(60, 60), layout)
    held = osp.evaluate(osp.table(cap)).metrics
    assert held.mean_response_time == pytest.approx(pk, rel=1e-5)
    assert held.mean_response_time > 1.1 * H2.mean() / (1 - lam * H2.mean())  # not processor sharing's


def test_the_blind_optimum_holds_at_the_lock() -> None:
    """The blind solve never blocks a thread: its tables start a preview only while the lock is
    free. Apache's rules block threads there; their tables held at the lock run alike (the held
    request starts at the release, the blocked thread's slot stays idle until then), and the
    optimum is no worse than any of them."""
    model = TandemModel(0.5, (H2, EXP), locks=(1, None))
    layout = Layout.build(model, "none")
    opt = solve_observed(model, phase_info="none")
    ch = observed_chain(model, layout, opt.policy.actions, max_requests=40)
    reach, pi = stationary_distribution(ch.P)
    Q, D = layout.n_queues, model.n_coords
    assert ch.rows.shape[1] == Q + D + 2
    assert ch.rows[reach][:, Q + D:].sum() == 0  # no blocked thread is ever reached
    assert np.all(observe(model, layout, ch.rows)[:, Q] <= 1)
    ew = opt.metrics.mean_response_time
    for name in ("pi(2)", "pi(4)", "pi(inf)"):
        assert not holds_at_locks(model, name)
        blocking = evaluate_baseline(model, name, tol=1e-4).metrics.mean_response_time
        assert ew <= blocking * (1 + 1e-3)
    for locks in ((1, None), (None, 1)):
        m2 = TandemModel(0.5, (H2, EXP), locks=locks)
        osp = ObservationSpace(m2, Truncation(25, 25), layout)
        for name in ("pi(2)", "pi(3)", "pi(inf)"):
            rule = stage_rule(m2, name)
            ch = observed_chain(m2, layout, rule, max_requests=25)
            reach, pi = stationary_distribution(ch.P)
            assert float(pi @ ch.rows[reach][:, Q + D:].sum(axis=1)) > 1e-3  # Apache's rule blocks threads
            blocked = evaluate_observed(m2, layout, rule, max_requests=25)
            held = osp.evaluate(osp.table(rule)).metrics
            assert held.mean_response_time == pytest.approx(blocked.mean_response_time, rel=1e-8)


def test_a_thread_the_projection_would_start_into_a_full_lock_is_held() -> None:
    """Beyond a table's cap the projection shrinks the largest count, possibly a locked stage's
    threads: the policy still starts nothing there while the lock is full."""
    model = TandemModel(0.5, (H2, EXP), locks=(3, None))
    layout = Layout.build(model, "none")
    osp = ObservationSpace(model, Truncation(4, 4), layout)
    pol = osp.policy(osp.table(stage_rule(model, "pi(inf)")))
    assert pol.actions(np.array([[1, 0, 2, 1]]))[0, 0] == 1  # the projected state: one place free
    assert pol.actions(np.array([[1, 0, 3, 1]])).tolist() == [[0, 0]]  # three hold the lock
    assert pol.actions(np.array([[2, 1, 1, 0]])).tolist() == [[2, 1]]  # two places free


def test_route_with_a_lock_sits_below_none() -> None:
    model = TandemModel(0.5, (H2, EXP), locks=(1, None))
    tr = Truncation(8, 3)
    none = solve(model, phase_info="none", truncation=tr)
    route = solve(model, phase_info="route", routes=split(model), truncation=tr)
    full = solve(model, phase_info="full", truncation=tr)
    assert full.metrics.mean_response_time <= route.metrics.mean_response_time * (1 + 1e-9)
    assert route.metrics.mean_response_time < none.metrics.mean_response_time


@pytest.mark.parametrize("table", ["optimum", "pi(inf) held"])
def test_simulator_matches_exact_for_a_blind_table_with_a_lock(table: str) -> None:
    model = TandemModel(0.5, (H2, EXP), locks=(1, None))
    layout = Layout.build(model, "none")
    if table == "optimum":
        pol = solve_observed(model, phase_info="none", truncation=Truncation(12, 4)).policy
    else:
        osp = ObservationSpace(model, Truncation(12, 12), layout)
        pol = osp.policy(osp.table(stage_rule(model, "pi(inf)")))
    exact = evaluate_observed(model, layout, pol.actions, max_requests=40).mean_response_time
    sim = simulate(model, pol, requests=100_000, seed=11)
    assert abs(sim.mean_response_time - exact) <= sim.ci95
    ps = evaluate_baseline(TandemModel(0.5, (H2, EXP)), "pi(inf)", tol=1e-4).metrics.mean_response_time
    if table == "pi(inf) held":
        assert abs(sim.mean_response_time - ps) > 3 * sim.ci95  # the lock matters
