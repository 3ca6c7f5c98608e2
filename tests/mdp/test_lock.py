"""A stage with a lock (:mod:`overtake.mdp.lock`): known answers, conservation and the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from overtake.mdp import Stage, TandemModel, Truncation, solve
from overtake.mdp.baselines import Baseline
from overtake.mdp.chain import build_chain
from overtake.mdp.errors import ModelError
from overtake.mdp.evaluate import stationary_distribution
from overtake.mdp.lock import Locks
from overtake.mdp.policy import model_from_dict, model_to_dict
from overtake.mdp.rule_evaluation import evaluate_baseline, evaluate_rule
from overtake.mdp.scenario import parse_scenario
from overtake.mdp.simulation import simulate
from overtake.mdp.statespace import Layout, transitions

H2 = Stage("preview", np.array([0.8, 0.2]), np.diag([-4.0, -0.4]))
EXP = Stage("view", np.array([1.0]), np.array([[-1.5]]))


def pollaczek_khinchine(stage: Stage, lam: float) -> float:
    """E[sojourn] of the M/G/1 FCFS queue: E[S] + λE[S²]/(2(1 − ρ))."""
    rho = lam * stage.mean()
    return stage.mean() + lam * stage.second_moment() / (2 * (1 - rho))


@pytest.mark.parametrize("baseline", ["pi(inf)", "pi(1)", "pi(3)"])
def test_one_locked_stage_is_an_mph1_fcfs_queue(baseline: str) -> None:
    """Whatever threads are started, the lock serves one request at a time at full speed: the
    Pollaczek–Khinchine mean (random order of the lock has FCFS's mean), not processor sharing's
    E[S]/(1 − ρ)."""
    lam = 0.5
    model = TandemModel(lam, (H2,), locks=(1,))
    m = evaluate_baseline(model, baseline, tol=1e-6).metrics
    assert m.mean_response_time == pytest.approx(pollaczek_khinchine(H2, lam), rel=1e-5)
    assert m.mean_response_time > 1.1 * H2.mean() / (1 - lam * H2.mean())  # the PS answer is far off
    # Little's law, and every request present holds a thread under pi(inf)
    assert m.mean_in_system == pytest.approx(lam * (1 - m.blocking_probability) * m.mean_response_time, rel=1e-9)
    if baseline == "pi(inf)":
        assert m.mean_threads == pytest.approx(m.mean_in_system, rel=1e-9)
    else:
        assert m.mean_threads < m.mean_in_system


@pytest.mark.parametrize("phase_info", ["full", "start"])
def test_a_lock_as_wide_as_the_thread_cap_changes_nothing(phase_info: str) -> None:
    model = TandemModel(0.5, (H2, EXP))
    tr = Truncation(10, 3)
    ref = solve(model, phase_info=phase_info, truncation=tr).metrics.mean_response_time  # type: ignore[arg-type]
    for m in (3, 5):
        locked = TandemModel(0.5, (H2, EXP), locks=(m, m))
        got = solve(locked, phase_info=phase_info, truncation=tr).metrics.mean_response_time  # type: ignore[arg-type]
        assert got == pytest.approx(ref, rel=1e-9)
    narrow = TandemModel(0.5, (H2, EXP), locks=(1, None))
    assert solve(narrow, phase_info=phase_info, truncation=tr).metrics.mean_response_time > ref * 1.01  # type: ignore[arg-type]
    for k in (1, 2):
        plain = evaluate_baseline(model, f"pi({k})", tol=1e-5).metrics.mean_response_time
        wide = evaluate_baseline(TandemModel(0.5, (H2, EXP), locks=(k, None)), f"pi({k})", tol=1e-5)
        assert wide.metrics.mean_response_time == pytest.approx(plain, rel=1e-9)


def test_chain_with_blocked_threads_conserves_flow() -> None:
    """pi(inf) on a locked first stage: blocked threads only while the lock is held; the lock is
    released (stage-1 completions) at the rate requests are admitted; Little per stage."""
    lam, C = 0.5, 16
    model = TandemModel(lam, (H2, EXP), locks=(1, None))
    layout = Layout.build(model, "start")
    rule = Baseline.parse("pi(inf)", 2).rule(layout.queue_stage, model.coord_stage())
    chain = build_chain(model, layout, rule, max_requests=C)
    rows = chain.rows
    locks = Locks.build(model, layout.n_queues)
    assert rows.shape[1] == layout.n_queues + model.n_coords + locks.n_twins
    holders = locks.holders(rows, 0)
    blocked = rows[:, layout.n_queues + model.n_coords:].sum(axis=1)
    assert holders.max() == 1 and blocked.max() > 0
    assert np.all(holders[blocked > 0] == 1)
    reach, pi = stationary_distribution(chain.P)
    rows, p = rows[reach], pi
    blocking = float(p[rows.sum(axis=1) >= C].sum())
    src, dst, rate = transitions(model, layout, rows, C)
    in_stage1 = rows[:, [0, 2, 3, 5, 6]].sum(axis=1)  # w_1, k_1 per phase, b_1 per phase
    dst_stage1 = dst[:, [0, 2, 3, 5, 6]].sum(axis=1)
    leaves = dst_stage1 == in_stage1[src] - 1
    released = float((p[src] * rate)[leaves].sum())
    assert released == pytest.approx(lam * (1 - blocking), rel=1e-9)
    m = evaluate_rule(model, layout, rule, max_requests=C, max_threads=None)
    assert m.stage_sojourn[0] * lam * (1 - blocking) == pytest.approx(float(p @ in_stage1), rel=1e-9)


@pytest.fixture(scope="module")
def locked_optimum():  # type: ignore[no-untyped-def]
    """π* of the locked tandem on caps (12, 4) and its exact E[W] on 40 requests: solved once for
    the two tests that read it."""
    model = TandemModel(0.5, (H2, EXP), locks=(1, None))
    pol = solve(model, phase_info="full", truncation=Truncation(12, 4)).policy
    exact = evaluate_rule(model, Layout.build(model, "full"), pol.actions, max_requests=40, max_threads=4).mean_response_time
    return model, pol, exact


def test_the_optimum_never_blocks_and_beats_the_baselines(locked_optimum) -> None:  # type: ignore[no-untyped-def]
    model, pol, exact = locked_optimum
    layout = Layout.build(model, "full")
    chain = build_chain(model, layout, pol.actions, max_requests=12, max_threads=4)
    assert chain.rows[:, layout.n_queues + model.n_coords:].max() == 0
    for b in ("pi(inf)", "pi(1)", "pi(2)", "pi(4)", "pi(1,1)"):
        assert exact < evaluate_baseline(model, b, tol=1e-4).metrics.mean_response_time


@pytest.mark.parametrize("policy", ["pi(inf)", "pi(2)", "optimum"])
def test_simulator_matches_exact_on_a_locked_tandem(policy: str, request: pytest.FixtureRequest) -> None:
    model = TandemModel(0.5, (H2, EXP), locks=(1, None))
    if policy == "optimum":
        _, pol, exact = request.getfixturevalue("locked_optimum")
        sim = simulate(model, pol, requests=100_000, seed=11)
    else:
        exact = evaluate_baseline(model, policy, tol=1e-4).metrics.mean_response_time
        sim = simulate(model, policy, requests=100_000, seed=11)
    assert abs(sim.mean_response_time - exact) <= sim.ci95
    # and the lock matters: the same run without it is off by far more than the interval
    plain = evaluate_baseline(TandemModel(0.5, (H2, EXP)), "pi(inf)", tol=1e-4).metrics.mean_response_time
    if policy == "pi(inf)":
        assert abs(sim.mean_response_time - plain) > 3 * sim.ci95


def test_scenario_lock_field() -> None:
    base = {"load": 0.5, "stages": [{"name": "preview", "service": {"exponential": {"mean": 1.0}}, "lock": 1},
                                    {"name": "view", "service": {"exponential": {"mean": 1.0}}}]}
    model = parse_scenario(base).build_model()
    assert model.locks == (1, None) and model.has_lock
    assert model_from_dict(model_to_dict(model)) == model
    bad = {**base, "stages": [{**base["stages"][0], "lock": 0}, base["stages"][1]]}
    with pytest.raises(ModelError, match=r"stages\.0\.lock: .*integer >= 1.*omit"):
        parse_scenario(bad)
    with pytest.raises(ModelError, match=r"locks\[0\]"):
        TandemModel(0.5, (H2,), locks=(0,))
    with pytest.raises(ModelError, match="locks: CPU classes by phase .* not modelled with a stage with a lock"):
        solve(model, cpu_priority="class")


def test_lock_module_doctest() -> None:
    import doctest

    from overtake.mdp import lock

    res = doctest.testmod(lock)
    assert res.attempted > 0 and res.failed == 0
