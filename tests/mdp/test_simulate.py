"""The simulator against closed forms and exact policy evaluation (two independent methods).

Statistical checks use fixed seeds and the run's own batch-means 95% half-width h; a check
passes when the known value lies within 1.5·h (z < 2.94, a 0.3% false-alarm rate per check, so
the suite is not a coin toss while a biased simulator — off by a few h — still fails).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.stats as st
from support.mdp_helpers import exp_stage, h2_stage, tandem

from overtake.api.cli import main
from overtake.mdp import solve
from overtake.mdp.errors import ModelError, PolicyFileError
from overtake.mdp.heuristic import evaluate_heuristic
from overtake.mdp.model import Stage, capacity, capacity_compiled
from overtake.mdp.policy import Policy
from overtake.mdp.rule_evaluation import evaluate_baseline, evaluate_rule
from overtake.mdp.simulation import ServiceSampler, posterior_labels, service_from_spec, simulate
from overtake.mdp.statespace import Layout, Truncation

Z = 1.5  # multiples of the 95% half-width (see module docstring)


def inside(res, value: float) -> bool:  # type: ignore[no-untyped-def]
    return abs(res.mean_response_time - value) <= Z * res.ci95


def test_mm1_mean_and_percentiles() -> None:
    model = tandem(0.6, exp_stage("a", 1.0))
    res = simulate(model, "pi(1)", requests=200_000, seed=11)
    assert inside(res, 1.0 / (1.0 - 0.6))
    # FCFS M/M/1 sojourn ~ Exp(μ − λ): p-quantile = −ln(1 − p)/(μ − λ)
    for p in (50.0, 95.0, 99.0):
        want = -math.log(1 - p / 100) / 0.4
        assert res.percentiles[f"p{p:g}"] == pytest.approx(want, rel=0.03)
    assert res.mean_threads == pytest.approx(0.6, rel=0.02)
    assert abs(res.little_residual) < 0.01


def test_capacity_curve_cores_and_overhead() -> None:
    """c(K) = min(K, m)/(1 + δK): with m = 2 and exponential work π(∞) is M/M/2 (Erlang C);
    with δ = 0.25 and one thread π(1) is M/M/1 at rate 1/(1 + δ)."""
    from overtake.mdp.model import TandemModel

    m2 = TandemModel(1.2, (exp_stage("a", 1.0),), cores=2)
    res = simulate(m2, "pi(inf)", requests=300_000, seed=18)
    assert inside(res, 1.0 + 0.45 / 0.8)
    slow = TandemModel(0.5, (exp_stage("a", 1.0),), overhead=0.25)
    res = simulate(slow, "pi(1)", requests=300_000, seed=19)
    assert inside(res, 1.0 / (1.0 / 1.25 - 0.5))


def test_capacity_is_one_function_for_numpy_and_the_compiled_kernels() -> None:
    """c(K) = min(K, m)/(1 + δK) at hand-computed points; numba's compilation of the same function
    (what the simulator and heuristic kernels call) gives bit-identical values."""
    assert capacity(0, 1, 0.0) == 0.0 and capacity(3, 2, 0.0) == 2.0 and capacity(2, 1, 0.5) == 0.5
    assert capacity(3, 2, 0.25) == 2 / 1.75
    ks = np.arange(-1, 13)
    for m in (1, 2, 4):
        for d in (0.0, 0.1, 0.25):
            want = np.array([min(k, m) / (1.0 + d * k) if k > 0 else 0.0 for k in ks.tolist()])
            np.testing.assert_array_equal(capacity(ks, m, d), want)
            assert [capacity_compiled(k, m, d) for k in ks.tolist()] == want.tolist()


def test_pi1_is_pollaczek_khinchine_with_summed_exponential_stages() -> None:
    model = tandem(0.6, exp_stage("a", 5.0), exp_stage("b", 1.0))
    res = simulate(model, "pi(1)", requests=200_000, seed=12)
    ES, ES2 = 6.0, 2 * 25 + 2 * 1 + 2 * 5
    lam = model.arrival_rate
    assert inside(res, ES + lam * ES2 / (2 * (1 - lam * ES)))
    # π(1) serves a request to departure: nobody waits at stage 2
    assert res.stages[1].mean_waiting == 0.0
    assert res.stages[1].mean_sojourn == pytest.approx(1.0, rel=0.02)


def test_pi_inf_is_processor_sharing_insensitive() -> None:
    """M/G/1-PS: E[W] = E[S]/(1 − ρ) for H2 and for deterministic non-PH work alike."""
    model = tandem(0.6, h2_stage("a", 0.91, 0.55, 5.45), h2_stage("b", 0.91, 2.75, 27.25))
    res = simulate(model, "pi(inf)", requests=200_000, seed=13)
    assert inside(res, model.mean_service() / 0.4)
    assert res.mean_threads == pytest.approx(res.mean_in_system, rel=1e-9)
    det = [ServiceSampler("det", dist=st.uniform(loc=s.mean(), scale=0.0)) for s in model.stages]
    res = simulate(model, "pi(inf)", requests=200_000, seed=14, service=det)
    assert inside(res, model.mean_service() / 0.4)


def coxian_stage(name: str) -> Stage:
    """Three phases with exits from every phase and forward jumps (c² > 1 and < 1 parts)."""
    T = np.array([[-4.0, 1.2, 0.0], [0.0, -1.0, 0.5], [0.0, 0.0, -0.25]])
    return Stage(name, np.array([1.0, 0.0, 0.0]), T)


def erlang_stage(name: str, k: int, mean: float) -> Stage:
    r = k / mean
    return Stage(name, np.eye(k)[0], -r * np.eye(k) + r * np.eye(k, k=1))


def test_phase_transitions_inside_a_stage_pi1_and_pi_inf_closed_forms() -> None:
    """Coxian and Erlang stages (phase moves simulated): π(1) = P-K, π(∞) = E[S]/(1 − ρ)."""
    model = tandem(0.6, coxian_stage("a"), erlang_stage("b", 3, 1.0))
    a, b = model.stages
    ES = a.mean() + b.mean()
    ES2 = a.second_moment() + b.second_moment() + 2 * a.mean() * b.mean()
    lam = model.arrival_rate
    res = simulate(model, "pi(1)", requests=300_000, seed=15)
    assert inside(res, ES + lam * ES2 / (2 * (1 - lam * ES)))
    for s, want in zip(res.stages, (a.mean(), b.mean())):
        assert s.mean_sojourn - s.mean_waiting == pytest.approx(want, rel=0.02)
    res = simulate(model, "pi(inf)", requests=300_000, seed=16)
    assert inside(res, ES / 0.4)


def test_heuristic_with_phase_transitions_matches_exact(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = tandem(0.6, coxian_stage("a"), exp_stage("b", 1.0))
    exact = evaluate_heuristic(model, tol=1e-3).metrics
    res = simulate(model, "heuristic", requests=300_000, seed=17)
    assert inside(res, exact.mean_response_time)
    assert res.mean_threads == pytest.approx(exact.mean_threads, rel=0.03)


@pytest.fixture(scope="module")
def case2():  # type: ignore[no-untyped-def]
    """Table 1 case 2 (exp(1) then H2 r=0.91, 0.55/5.45), ρ = 0.6."""
    return tandem(0.6, exp_stage("s1", 1.0), h2_stage("s2", 0.91, 0.55, 5.45))


@pytest.mark.parametrize("name", ["pi(4)", "pi(1,1)"])
def test_baselines_match_exact_evaluation_on_table1_case2(case2, name: str) -> None:  # type: ignore[no-untyped-def]
    exact = evaluate_baseline(case2, name, tol=1e-4).metrics
    res = simulate(case2, name, requests=300_000, seed=21)
    assert inside(res, exact.mean_response_time)
    assert res.mean_threads == pytest.approx(exact.mean_threads, rel=0.03)
    for s, want in zip(res.stages, exact.stage_sojourn):
        assert s.mean_sojourn == pytest.approx(want, rel=0.05)


@pytest.mark.parametrize("phase_info", ["full", "start"])
def test_policy_artifact_matches_its_exact_evaluation(case2, tmp_path, phase_info: str) -> None:  # type: ignore[no-untyped-def]
    """π* on a small truncation, saved and loaded; beyond the truncation both methods use the
    artifact's documented projection, so they must agree on E[W]."""
    opt = solve(case2, phase_info=phase_info, truncation=Truncation(10, 3))  # type: ignore[arg-type]
    path = tmp_path / "p.npz"
    opt.policy.save(path)
    pol = Policy.load(path)
    exact = evaluate_rule(case2, Layout.build(case2, phase_info), pol.actions, max_requests=40, max_threads=3)  # type: ignore[arg-type]
    assert exact.blocking_probability < 1e-4  # far below the CI: the chain is effectively untruncated
    res = simulate(case2, pol, requests=300_000, seed=22)
    assert inside(res, exact.mean_response_time)
    assert res.mean_threads == pytest.approx(exact.mean_threads, rel=0.03)


def test_heuristic_matches_its_exact_evaluation(case2) -> None:  # type: ignore[no-untyped-def]
    exact = evaluate_heuristic(case2, tol=1e-4).metrics
    res = simulate(case2, "heuristic", requests=300_000, seed=23)
    assert inside(res, exact.mean_response_time)
    assert res.mean_threads == pytest.approx(exact.mean_threads, rel=0.03)


def test_oracle_posterior_phase_reproduces_the_ph_system(case2) -> None:  # type: ignore[no-untyped-def]
    """Service drawn outside the model from the same H2 law, phase label from the posterior
    given the work: the joint law of (phase, work) is the PH's, so E[W] is the exact one.
    With the prior label only, the heuristic loses most of its gain (it overtakes blindly)."""
    class H2:
        name = "H2 sampler"

        def __init__(self, stage: Stage) -> None:
            self.p, self.means = stage.alpha, 1.0 / -np.diag(stage.T)

        def rvs(self, size: int, random_state: np.random.Generator) -> np.ndarray:
            j = random_state.choice(self.p.size, size=size, p=self.p)
            return random_state.exponential(self.means[j])

    svc = [H2(s) for s in case2.stages]
    exact = evaluate_heuristic(case2, tol=1e-4).metrics.mean_response_time
    oracle = simulate(case2, "heuristic", requests=300_000, seed=24, service=svc, phase="oracle")
    assert inside(oracle, exact)
    prior = simulate(case2, "heuristic", requests=300_000, seed=25, service=svc, phase="prior")
    assert prior.mean_response_time - prior.ci95 > oracle.mean_response_time + oracle.ci95


def test_posterior_labels_follow_bayes_rule() -> None:
    stage = h2_stage("a", 0.5, 1.0, 10.0)
    rng = np.random.default_rng(0)
    work = np.full(200_000, 3.0)
    lab = posterior_labels(stage, work, rng)
    f = np.array([0.5 * math.exp(-3.0), 0.5 * 0.1 * math.exp(-0.3)])
    assert lab.mean() == pytest.approx(f[1] / f.sum(), abs=0.005)


def test_posterior_labels_general_ph() -> None:
    from scipy.linalg import expm

    stage = Stage("g", np.array([0.5, 0.5]), np.array([[-2.0, 1.0], [0.0, -0.5]]))
    t = stage.exit_rates
    rng = np.random.default_rng(3)
    for s in (0.2, 4.0):
        lab = posterior_labels(stage, np.full(100_000, s), rng)
        f = stage.alpha * (expm(stage.T * s) @ t)
        assert lab.mean() == pytest.approx(f[1] / f.sum(), abs=0.006)


def test_service_specs_rescale_to_the_stage_mean(tmp_path) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(1)
    for spec in ("lognorm(s=1.0)", "weibull_min(c=0.7)", "truncpareto(b=1.2, c=100)", "bimodal(p=0.8, ratio=5)"):
        s = service_from_spec(spec, mean=2.5)
        assert s.mean() == pytest.approx(2.5, rel=1e-9)
        assert s.rvs(400_000, rng).mean() == pytest.approx(2.5, rel=0.03)
    f = tmp_path / "d.txt"
    f.write_text("# durations\n1.0\n2.0, 3.0\n")
    s = service_from_spec(str(f), mean=100.0)
    assert s.mean() == pytest.approx(2.0)  # an empirical sample is used as is
    for bad, msg in [("gamma", "gamma"), ("nosuchdist(a=1)", "not a scipy.stats"), ("pareto(b=0.8)", "finite"),
                     ("lognorm(s=x)", "number"), (str(tmp_path / "missing.txt"), "does not exist")]:
        with pytest.raises(ModelError, match=msg):
            service_from_spec(bad, mean=1.0)


def test_input_errors(case2, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelError, match="requests"):
        simulate(case2, "pi(1)", requests=10)
    with pytest.raises(ModelError, match="baseline"):
        simulate(case2, "pi(x)", requests=1000)
    other = tandem(0.6, h2_stage("a", 0.5, 1.0, 2.0), h2_stage("b", 0.5, 1.0, 2.0))
    opt = solve(other, truncation=Truncation(4, 2))
    with pytest.raises(PolicyFileError, match="phases"):
        simulate(case2, opt.policy, requests=1000)


def test_cli_simulate_json_and_errors(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    sc = tmp_path / "s.yaml"
    sc.write_text("load: 0.5\nstages:\n  - name: a\n    service: {exponential: {mean: 1.0}}\n")
    assert main(["simulate", str(sc), "--policy", "pi(1)", "--requests", "100000", "--seed", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert abs(doc["mean_response_time"] - 2.0) <= Z * doc["ci95"]
    assert set(doc["percentiles"]) == {"p50", "p95", "p99", "p99.9"}
    assert doc["stages"][0]["name"] == "a"
    assert main(["simulate", str(sc), "--policy", "heuristic", "--requests", "20000",
                 "--service-from", "lognorm(s=1)", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["phase_info"] == "oracle" and doc["prior_phase"]["phase_info"] == "prior"
    assert main(["simulate", str(sc), "--policy", "pi(2,2)", "--requests", "1000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "2 per-stage caps" in err[0]
    assert main(["simulate", str(sc), "--policy", str(tmp_path / "none.npz"), "--requests", "1000"]) == 2
    assert "does not exist" in capsys.readouterr().err
