"""overtake.controller.sidecar.virtual against closed forms and the MDP's exact evaluation (two independent methods).

The twin drives the sidecar's Limiter on a virtual processor-sharing CPU; over long Poisson
traces its mean response time must converge to (a) M/M/1-PS's 1/(mu - lambda) and (b) the
exact E[W] that mdp/ computes for the same policy on van der Weij et al.'s tandem — which also checks
that `next` reservations give the model's routing.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from overtake.controller.sidecar import virtual
from overtake.mdp import Stage, TandemModel, Truncation, solve
from overtake.mdp.rule_evaluation import evaluate_baseline


def _trace(lam: float, means: list[float], n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tr = {"arrival": np.cumsum(rng.exponential(1 / lam, n))}
    for i, m in enumerate(means):
        tr[f"demand{i}"] = rng.exponential(m, n)
        tr[f"phase{i}"] = np.zeros(n, dtype=np.int64)
    return tr


def _mean_ci(x: np.ndarray, batches: int = 20) -> tuple[float, float]:
    x = x[x.size // 20:]
    bm = np.array([b.mean() for b in np.array_split(x, batches)])
    return float(bm.mean()), float(2.093 * bm.std(ddof=1) / np.sqrt(batches))


def test_one_stage_ps_is_mm1() -> None:
    m, ci = _mean_ci(virtual.replay(_trace(0.5, [1.0], 60_000, 1), "passthrough"))
    assert abs(m - 2.0) <= max(3 * ci, 0.02), (m, ci)  # E[W] = 1 / (mu - lambda)


@pytest.fixture(scope="module")
def tandem() -> TandemModel:
    # van der Weij et al. Table 1 case 1: two exponential stages of mean 1, rho = 0.6
    e = (np.array([1.0]), np.array([[-1.0]]))
    return TandemModel(arrival_rate=0.3, stages=(Stage("stage1", *e), Stage("stage2", *e)))


@pytest.mark.parametrize("spec", ["pi(1)", "passthrough"])
def test_tandem_converges_to_the_exact_evaluation(tandem: TandemModel, spec: str) -> None:
    exact = evaluate_baseline(tandem, "pi(1)" if spec == "pi(1)" else "pi(inf)").metrics.mean_response_time
    m, ci = _mean_ci(virtual.replay(_trace(0.3, [1.0, 1.0], 60_000, 2), spec))
    assert abs(m - exact) <= 3 * ci, (spec, m, ci, exact)


def test_next_routing_is_the_models_and_client_routing_is_not(tandem: TandemModel, tmp_path: Path) -> None:
    tr = _trace(0.3, [1.0, 1.0], 20_000, 3)
    nxt = virtual.replay(tr, "pi(1)", routing="next")
    np.testing.assert_allclose(nxt, virtual.replay(tr, "pi(1)", routing="instant"), rtol=1e-12)
    # pi* of the exponential tandem is pi(1) (Table 1: gain 0.00): the same response times
    path = tmp_path / "star.npz"
    solve(tandem, truncation=Truncation(10, 3)).policy.save(path)
    np.testing.assert_allclose(virtual.replay(tr, str(path), routing="next"), nxt, rtol=1e-9)
    # without the reservation a waiting stage-1 request takes the thread first: slower, every time
    assert np.nanmean(virtual.replay(tr, "pi(1)", routing="client")) > 1.03 * np.nanmean(nxt)


def test_bad_routing_and_trace_are_named() -> None:
    with pytest.raises(ValueError, match="routing: one of next, client, instant"):
        virtual.replay(_trace(0.5, [1.0], 10, 0), "pi(1)", routing="fast")
    with pytest.raises(ValueError, match="trace: needs 'arrival'"):
        virtual.replay({"arrival": np.zeros(3)}, "pi(1)")


@pytest.mark.slow  # three replays of 150,000 requests and a simulation of a million
def test_one_stage_priority_levels_match_the_simulator_and_mlps() -> None:
    """The twin's CPU priority on one H2 stage under passthrough (π(∞)): E[W] of the
    exact MLPS analysis (strict priority) and of the simulator (kernel weight 3/1024) agree
    with the twin's within the CIs."""
    from overtake.mdp.mlps import mlps_mean
    from overtake.mdp.priority import age_priority
    from overtake.mdp.simulation import simulate

    h2 = Stage("a", np.array([0.91, 0.09]), np.diag([-1 / 0.55, -1 / 5.45]))
    model = TandemModel(arrival_rate=0.6 / h2.mean(), stages=(h2,))
    rng = np.random.default_rng(5)
    n = 150_000
    ph = (rng.random(n) >= 0.91).astype(np.int64)
    tr = {"arrival": np.cumsum(rng.exponential(1 / model.arrival_rate, n)),
          "demand0": rng.exponential(np.where(ph == 1, 5.45, 0.55)), "phase0": ph}
    strict = age_priority(model, [1.8], weights=[1.0, 1e-9])
    m, ci = _mean_ci(virtual.replay(tr, "passthrough", cpu_priority=strict), batches=30)
    exact = mlps_mean(h2, model.arrival_rate, [1.8])
    assert abs(m - exact) <= 1.5 * ci, (m, ci, exact)
    kernel = age_priority(model, [1.8])  # default demoted weight: SCHED_IDLE's 3/1024
    m, ci = _mean_ci(virtual.replay(tr, "passthrough", cpu_priority=kernel), batches=30)
    sim = simulate(model, "pi(inf)", requests=1_000_000, seed=8, cpu_priority=kernel)
    assert abs(m - sim.mean_response_time) <= 1.5 * math.hypot(ci, sim.ci95), (m, ci, sim.mean_response_time)
    plain = virtual.replay(tr, "passthrough")  # no CPU priority: the equal-sharing path, untouched
    assert abs(_mean_ci(plain, batches=30)[0] - h2.mean() / 0.4) <= 1.5 * _mean_ci(plain, batches=30)[1]


def test_a_dispatch_delay_under_pi1_is_mg1_with_the_delay_added_to_service() -> None:
    # π(1) on one stage serves one request at a time, FCFS; each hand-over idles the CPU for d,
    # so the queue is M/G/1 with service S + d: Pollaczek–Khinchine, E W = E B + λ E B² / (2(1 − λ E B))
    lam, d = 0.5, 0.2
    eb, eb2 = 1.0 + d, 2.0 + 2 * d + d * d  # S ~ Exp(1)
    pk = eb + lam * eb2 / (2 * (1 - lam * eb))
    m, ci = _mean_ci(virtual.replay(_trace(lam, [1.0], 60_000, 4), "pi(1)", dispatch_delay=d))
    assert abs(m - pk) <= max(3 * ci, 0.02), (m, ci, pk)
    # a lone request: response = delay + demand, under any policy
    lone = {"arrival": np.array([0.0, 100.0]), "demand0": np.array([1.5, 0.5]), "phase0": np.zeros(2, np.int64)}
    np.testing.assert_allclose(virtual.replay(lone, "passthrough", dispatch_delay=0.25), [1.75, 0.75], rtol=1e-12)
    with pytest.raises(ValueError, match="dispatch_delay"):
        virtual.replay(lone, "pi(1)", dispatch_delay=-1.0)


def test_routes_in_the_trace_keep_the_stage_prior_and_learned_mode_finds_pure_routes(tmp_path: Path) -> None:
    from overtake.controller.harness.loadgen import make_trace, route_path
    from overtake.mdp.routes import RouteSplit

    h2 = Stage("stage1", np.array([0.91, 0.09]), np.diag([-1 / 0.55, -1 / 5.45]))
    model = TandemModel(arrival_rate=0.5, stages=(h2,))
    # two routes that each reveal the phase: 91 % of requests on the short one
    split = RouteSplit.build(model, [[("short", 0.91, [1.0, 0.0]), ("long", 0.09, [0.0, 1.0])]])
    tr = make_trace(model, 30_000, 5, routes=split)
    assert np.array_equal(tr["phase0"], tr["route0"])  # pure routes: the route is the phase
    assert abs(float(np.mean(tr["phase0"] == 0)) - 0.91) < 0.01
    assert abs(float(tr["demand0"].mean()) - 1.0) < 0.05  # E S = 0.91·0.55 + 0.09·5.45
    assert route_path(0, tr, 0) == f"/stage1/r{int(tr['route0'][0])}" and "route0" not in make_trace(model, 5, 5)
    path = tmp_path / "star.npz"
    opt = solve(model, truncation=Truncation(14, 4))
    opt.policy.save(path)
    # learned mode classifies each route from its history: π* then runs as with phase headers,
    # so both converge to the MDP's exact E[W] (the first requests of each route are guessed)
    for mode in ("explicit", "learned"):
        m, ci = _mean_ci(virtual.replay(tr, str(path), mode=mode))
        assert abs(m - opt.metrics.mean_response_time) <= max(3 * ci, 0.02 * m), (mode, m, ci)
    ex = virtual.replay(tr, str(path), mode="explicit")
    le = virtual.replay(tr, str(path), mode="learned")
    assert np.mean(np.isclose(ex[3000:], le[3000:], rtol=1e-9)) > 0.95  # the same decisions once learned


def test_a_route_policy_in_learned_mode_converges_to_its_exact_evaluation(tmp_path: Path) -> None:
    # a multi-route workload on one H2 stage: three routes, 99 / 50 / 10 % short
    from overtake.controller.harness.loadgen import make_trace
    from overtake.mdp.routes import RouteSplit

    h2 = Stage("stage1", np.array([0.91, 0.09]), np.diag([-1 / 0.55, -1 / 5.45]))
    model = TandemModel(arrival_rate=0.6, stages=(h2,))
    x = (0.99 - 0.91) / (2 * 0.99 - 0.5 - 0.1)
    split = RouteSplit.build(model, [[("r0", 1 - 2 * x, [0.99, 0.01]), ("r1", x, [0.5, 0.5]),
                                      ("r2", x, [0.1, 0.9])]])
    opt = solve(model, phase_info="route", routes=split, truncation=Truncation(12, 4))
    path = tmp_path / "route.npz"
    opt.policy.save(path)
    tr = make_trace(model, 40_000, 6, routes=split)
    m, ci = _mean_ci(virtual.replay(tr, str(path), mode="learned"))
    assert abs(m - opt.metrics.mean_response_time) <= max(3 * ci, 0.02 * m), (m, ci, opt.metrics.mean_response_time)
