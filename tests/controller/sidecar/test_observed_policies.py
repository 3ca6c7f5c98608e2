"""The sidecar enforces what was solved for: ``none`` policies on counts, ``route``
policies on learned route classes, and ``auto`` choosing among them.

Known answers: the limiter's state equals the counts recomputed from its tickets, and every
answer equals :meth:`overtake.mdp.Policy.action` on that state; the learned class of a route
equals the brute-force maximum of its posterior; :func:`overtake.controller.sidecar.auto.choose` on
hand-made predictions.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy.linalg import expm

from overtake.controller.sidecar.auto import Evidence, choose
from overtake.controller.sidecar.classifier import Classifier
from overtake.controller.sidecar.limiter import ADMITTED, QUEUED, Limiter
from overtake.controller.sidecar.policies import BaselinePolicy, PolicySet, TablePolicy, load_policy
from overtake.controller.sidecar.stages import ClassifierSettings
from overtake.mdp.model import Stage, TandemModel
from overtake.mdp.observed import solve_observed
from overtake.mdp.routes import RouteSplit
from overtake.mdp.rule_evaluation import evaluate_baseline
from overtake.mdp.statespace import Truncation

NAMES = ("s1", "s2")
H2 = (np.array([0.91, 0.09]), np.diag([-1 / 0.55, -1 / 5.45]))


def _model() -> TandemModel:
    s1 = Stage("s1", np.array([1.0]), np.array([[-1.0]]))
    s2 = Stage("s2", *H2)
    return TandemModel(0.6 / (1.0 + s2.mean()), (s1, s2))


def _split(model: TandemModel) -> RouteSplit:
    a = float(model.stages[1].alpha[0])
    p = (a - 0.1) / (0.99 - 0.1)
    return RouteSplit.build(model, [None, [("light", p, [0.99, 0.01]), ("heavy", 1 - p, [0.1, 0.9])]])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("observed")
    model = _model()
    out = {}
    none = solve_observed(model, truncation=Truncation(6))
    route = solve_observed(model, phase_info="route", routes=_split(model), truncation=Truncation(6))
    ps = evaluate_baseline(model, "pi(inf)").metrics.mean_response_time
    for name, opt in (("none", none), ("route", route)):
        pol = opt.policy
        pol.meta["metrics"] = opt.metrics.to_dict()
        pol.meta["baselines"] = {"pi(inf)": ps}
        out[name] = d / f"{name}.npz"
        pol.save(out[name])
    return out


def _counts(lim: Limiter) -> tuple[int, ...]:
    """The observation recomputed from the tickets: waiting per queue, threads per stage."""
    tandem = lim.tandem
    waiting = [len(q) for qs in tandem.queues for q in qs] if lim.per_phase else [
        sum(len(q) for q in qs) for qs in tandem.queues]
    threads = [sum(1 for t in tandem.active if t.stage == i) for i in range(lim.n)]
    return (*waiting, *threads)


class Checked:
    """Wraps a TablePolicy: every consult must see the ticket counts and get the mdp Policy's answer."""

    def __init__(self, inner: TablePolicy) -> None:
        self.inner = inner
        self.lim: Limiter | None = None
        self.consults = 0
        for k in ("name", "version", "hash", "phases", "per_phase_queues", "threads_per_stage", "phase_info",
                  "predicted_wait", "passthrough_wait", "alpha", "T", "labels"):
            setattr(self, k, getattr(inner, k))

    def action(self, state: tuple[int, ...]) -> tuple[int, ...]:
        assert self.lim is not None and state == _counts(self.lim)
        self.consults += 1
        a = self.inner.action(state)
        assert a == tuple(int(x) for x in self.inner.policy.action(state))
        return a


def _drive(pol: TablePolicy, mode: str, steps: int = 400, seed: int = 3) -> Checked:
    async def run() -> Checked:
        chk = Checked(pol)
        clf = Classifier(ClassifierSettings(mode=mode), chk)  # type: ignore[arg-type]
        lim = Limiter(chk, clf, stage_names=NAMES, queue_caps=(1000, 1000), max_inflight=64,  # type: ignore[arg-type]
                      passthrough_cap=None, passthrough_queue_cap=10)
        chk.lim = lim
        rng = random.Random(seed)
        live = []
        for _ in range(steps):
            admitted = [t for t in live if t.status == ADMITTED]
            if admitted and rng.random() < 0.5:
                t = rng.choice(admitted)
                live.remove(t)
                lim.release(t, "completed")
                if t.stage == 0:
                    nt = lim.submit(1, clf.start_phase(1, "GET /b", None, None), "GET /b")
                    if nt is not None:
                        live.append(nt)
            else:
                t = lim.submit(0, clf.start_phase(0, "GET /a", None, None), "GET /a")
                if t is not None:
                    live.append(t)
            assert sum(1 for t in live if t.status == QUEUED) == sum(_counts(lim)[: len(_counts(lim)) - 2])
        return chk

    return asyncio.run(run())


def test_none_policy_is_enforced_on_counts_per_stage(files: dict[str, Path]) -> None:
    pol = load_policy(str(files["none"]), NAMES)
    assert isinstance(pol, TablePolicy)
    assert (pol.phases, pol.per_phase_queues, pol.threads_per_stage, pol.phase_info) == ((1, 1), False, True, "none")
    chk = _drive(pol, "hidden")
    assert chk.consults > 100


def test_route_policy_queues_per_route_class_and_counts_threads_per_stage(files: dict[str, Path]) -> None:
    pol = load_policy(str(files["route"]), NAMES)
    assert isinstance(pol, TablePolicy)
    assert (pol.phases, pol.per_phase_queues, pol.threads_per_stage) == ((1, 2), True, True)
    assert pol.labels is not None and np.allclose(pol.labels[1][0], [[0.99, 0.01], [0.1, 0.9]])
    chk = _drive(pol, "learned")
    assert chk.consults > 100


def _posterior_argmax(pol: TablePolicy, demands: list[float]) -> int:
    """Brute force: argmax_r log p_r + Σ_k log(α_r exp(T t_k) t0)."""
    prior, w = pol.labels[1]  # type: ignore[index]
    T = H2[1]
    t0 = -T.sum(axis=1)
    score = [np.log(w[r]) + sum(np.log(prior[r] @ expm(T * t) @ t0) for t in demands) for r in range(len(w))]
    return int(np.argmax(score))


@pytest.mark.parametrize("demands", [[0.3, 0.5, 0.8, 0.2, 0.6], [4.0, 9.0, 2.5, 6.0], [0.4, 7.0, 0.5]])
def test_learned_route_class_is_the_posterior_maximum(files: dict[str, Path], demands: list[float]) -> None:
    pol = load_policy(str(files["route"]), NAMES)
    assert isinstance(pol, TablePolicy)
    clf = Classifier(ClassifierSettings(mode="learned", time_unit=1.0), pol)
    assert clf.start_phase(1, "GET /x", None, None) == int(np.argmax(pol.labels[1][1]))  # type: ignore[index]
    for t in demands:
        clf.observe(1, "GET /x", t)
    assert clf.start_phase(1, "GET /x", None, None) == _posterior_argmax(pol, demands)
    # the history outlives a swap: rebinding recomputes the likelihoods under the labels
    clf.bind(pol)
    assert clf.start_phase(1, "GET /x", None, None) == _posterior_argmax(pol, demands)


def test_short_and_long_routes_land_in_light_and_heavy_classes(files: dict[str, Path]) -> None:
    pol = load_policy(str(files["route"]), NAMES)
    assert isinstance(pol, TablePolicy)
    clf = Classifier(ClassifierSettings(mode="learned", time_unit=1.0), pol)
    rng = np.random.default_rng(1)
    for t in rng.exponential(0.55, 30):
        clf.observe(1, "GET /small", float(t))
    for t in rng.exponential(5.45, 30):
        clf.observe(1, "GET /report", float(t))
    assert clf.start_phase(1, "GET /small", None, None) == 0  # light: 99 % short
    assert clf.start_phase(1, "GET /report", None, None) == 1  # heavy: 90 % long


class _Fake:
    def __init__(self, name: str, info: str, w: float | None, ps: float | None) -> None:
        self.name, self.phase_info, self.predicted_wait, self.passthrough_wait = name, info, w, ps

    def __getattr__(self, k: str) -> Any:  # the rest of SpawnPolicy is not read by choose
        raise AttributeError(k)


def test_choose_takes_the_best_usable_policy_or_passthrough() -> None:
    full, route, none = _Fake("full", "full", 4.0, 5.0), _Fake("route", "route", 4.5, 5.0), _Fake("none", "none", 4.8, 5.0)
    ps = BaselinePolicy("passthrough", 2)
    cands = [full, route, none]
    c = choose(cands, {"none"}, ps)  # type: ignore[arg-type]
    assert c.policy is none and c.mode == "hidden" and c.predicted_gain == pytest.approx(0.04)
    assert choose(cands, {"none", "route"}, ps).policy is route  # type: ignore[arg-type]
    c = choose(cands, {"none", "route", "full", "start"}, ps)  # type: ignore[arg-type]
    assert c.policy is full and c.mode == "explicit"
    c = choose(cands, {"none"}, ps, margin=0.05)  # type: ignore[arg-type]
    assert c.policy is ps and "below the 5 % margin: running passthrough" in c.reason
    c = choose([_Fake("old", "none", 4.0, None)], {"none"}, ps)  # type: ignore[list-item]
    assert c.policy is ps and "no candidate policy" in c.reason


def _with_predictions(f: _Fake, **predictions: dict[str, float | None]) -> _Fake:
    f.priority_predictions = predictions  # type: ignore[attr-defined]
    return f


def test_choose_with_cpu_priority() -> None:
    """Under age priority every candidate is weighed by its prediction with CPU priority, passthrough
    by π(∞)'s; gains stay against Apache's default without it (5.0 here)."""
    ps = BaselinePolicy("passthrough", 2)
    none = _with_predictions(_Fake("none", "none", 4.8, 5.0), age={"mean_response_time": 4.5, "passthrough": 4.3})
    full = _with_predictions(_Fake("full", "full", 4.0, 5.0), age={"mean_response_time": 3.9, "passthrough": 4.3},
                       **{"class": {"mean_response_time": 3.6, "passthrough": None}})
    c = choose([none, full], {"none"}, ps, cpu_priority="age")  # type: ignore[list-item]
    assert c.policy is ps and c.predicted_gain == pytest.approx(0.14) and "age priority in Apache" in c.reason
    c = choose([none, full], {"none", "full", "start"}, ps, cpu_priority="age")  # type: ignore[list-item]
    assert c.policy is full and c.predicted_gain == pytest.approx(0.22) and "with age priority" in c.reason
    # a candidate without a prediction under CPU priority is not usable under it
    c = choose([_Fake("old", "none", 4.0, 5.0)], {"none"}, ps, cpu_priority="age")  # type: ignore[list-item]
    assert c.policy is ps and "overtake solve --cpu-priority age" in c.reason
    # class priority: the phase-aware candidate by its class prediction, the others as solved
    c = choose([none, full], {"none", "full", "start"}, ps, cpu_priority="class")  # type: ignore[list-item]
    assert c.policy is full and c.predicted_gain == pytest.approx(0.28)
    assert choose([none, full], {"none"}, ps, cpu_priority="class").policy is none  # type: ignore[list-item]
    # a policy solved with the classes in force is a candidate under class priority only
    solved = _Fake("class.npz", "full", 3.5, 5.0)
    solved.solved_priority = "class"  # type: ignore[attr-defined]
    assert choose([full, solved], {"none", "full", "start"}, ps, cpu_priority="class").policy is solved  # type: ignore[list-item]
    assert choose([full, solved], {"none", "full", "start"}, ps).policy is full  # type: ignore[list-item]


def test_evidence_needs_nearly_every_request_to_carry_the_header() -> None:
    ev = Evidence(window=100)
    assert ev.available() == {"none"}
    for i in range(100):
        ev.request(i != 0)
    assert ev.available() == {"none", "full", "start"}
    ev.request(False)
    ev.request(False)
    assert "full" not in ev.available()
    for _ in range(8):
        ev.demand("GET /a")
    assert "route" in ev.available()


def test_a_directory_of_policies_is_auto_s_candidate_set(files: dict[str, Path]) -> None:
    pset = load_policy(str(files["none"].parent), NAMES)
    assert isinstance(pset, PolicySet) and sorted(m.phase_info for m in pset.members) == ["none", "route"]
    assert pset.chosen is pset.passthrough and pset.phase_info == "none" and pset.per_phase_queues is False


def _auto_dir(d: Path) -> Path:
    """A directory with a full and a none policy for stages stage1 (exp) and stage2 (H2)."""
    from overtake.mdp import solve

    s1 = Stage("stage1", np.array([1.0]), np.array([[-1.0]]))
    s2 = Stage("stage2", *H2)
    model = TandemModel(0.6 / (1.0 + s2.mean()), (s1, s2))
    d.mkdir()
    ps = evaluate_baseline(model, "pi(inf)").metrics.mean_response_time
    for name, opt in (("full", solve(model, truncation=Truncation(6))),
                      ("none", solve_observed(model, truncation=Truncation(6)))):
        opt.policy.meta.update(metrics=opt.metrics.to_dict(), baselines={"pi(inf)": ps})
        opt.policy.save(d / f"{name}.npz")
    return d


def test_sidecar_auto_runs_none_without_headers_and_full_once_they_come(work: Path, stub: Any) -> None:
    """A real sidecar process in auto mode over a directory of three policies (full, none, route)."""
    from support.service_helpers import STAGES, SidecarProc

    d = _auto_dir(work / "auto-policies")
    stages = STAGES + "classifier: {mode: auto, auto_interval: 0.2, time_unit: 0.001}\n"
    s = SidecarProc(work, ["--policy", str(d), "--apache", stub.url], stages=stages)
    try:
        info = json.loads(s.request("GET", "/-/policy")[2])
        assert info["auto"]["chosen"] == "none.npz" and info["classifier"] == "hidden"
        assert info["auto"]["predicted_gain"] > 0.05 and info["phase_info"] == "none"
        for _ in range(60):  # every stage request now carries a valid phase header
            assert s.request("GET", "/stage2", headers={"X-Overtake-Phase": "1"})[0] == 200
        deadline = time.monotonic() + 10
        while info["auto"]["chosen"] != "full.npz" and time.monotonic() < deadline:
            time.sleep(0.2)
            info = json.loads(s.request("GET", "/-/policy")[2])
        assert info["auto"]["chosen"] == "full.npz" and info["classifier"] == "explicit"
        metrics = s.request("GET", "/-/metrics")[2].decode()
        assert 'chosen="full.npz"' in metrics and 'phase_info="full"' in metrics
        assert any(e.get("event") == "auto_choice" and e.get("policy") == "full.npz" for e in s.events())
    finally:
        assert s.stop() == 0


def test_auto_sees_phase_headers_of_clients_that_send_no_next_phase(work: Path, stub: Any) -> None:
    """With a ``next`` stage the sidecar peeks at the follow-up's phase; a front end that sets only
    X-Overtake-Phase must still count as sending phases (``make demo`` found auto stuck at
    counts: each peek was counted as a request without a header)."""
    import http.client

    from support.service_helpers import SidecarProc

    d = _auto_dir(work / "auto-next")
    stages = ('stages: [{name: stage1, path: "^/slow/", next: stage2}, {name: stage2, path: "^/stage2"}]\n'
              "limits: {max_inflight: 8, queue_cap: 200, queue_timeout: 30}\n"
              "classifier: {mode: auto, auto_interval: 0.2, time_unit: 0.001}\n")
    s = SidecarProc(work, ["--policy", str(d), "--apache", stub.url], stages=stages)
    try:
        for _ in range(40):  # transactions: stage 1 then stage 2 on one connection, phase headers only
            c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
            for path in ("/slow/0", "/stage2"):
                c.request("GET", path, headers={"X-Overtake-Phase": "1"})
                r = c.getresponse()  # the stub upstream echoes the path it was asked for
                assert (r.status, json.loads(r.read())["path"]) == (200, path)
            c.close()
        deadline = time.monotonic() + 10
        info = json.loads(s.request("GET", "/-/policy")[2])
        while info["auto"]["chosen"] != "full.npz" and time.monotonic() < deadline:
            time.sleep(0.2)
            info = json.loads(s.request("GET", "/-/policy")[2])
        assert info["auto"]["chosen"] == "full.npz", info["auto"]
    finally:
        assert s.stop() == 0


def test_the_twin_enforcing_a_none_policy_matches_its_exact_evaluation(files: dict[str, Path]) -> None:
    """The sidecar's own limiter and classifier (controller.sidecar.virtual) on a 40,000-transaction trace,
    against the exact E[W] of the same table extended beyond its truncation (mdp.observation)."""
    from overtake.controller.harness.loadgen import batch_means, make_trace
    from overtake.controller.sidecar import virtual
    from overtake.mdp.observed_chain import evaluate_observed
    from overtake.mdp.policy import Policy
    from overtake.mdp.statespace import Layout

    pol = Policy.load(files["none"])
    model = pol.model
    exact = evaluate_observed(model, Layout.build(model, "none"), pol.actions, max_requests=40)
    assert exact.blocking_probability < 1e-8
    trace = make_trace(TandemModel(model.arrival_rate, tuple(Stage(f"stage{i + 1}", s.alpha, s.T)
                                                             for i, s in enumerate(model.stages))), 40_000, 5)
    mean, ci = batch_means(virtual.replay(trace, _renamed(files["none"]), mode="hidden", time_unit=1.0))
    assert abs(mean - exact.mean_response_time) <= ci, (mean, ci, exact.mean_response_time)


def _renamed(path: Path) -> str:
    """The twin names its stages stage1, stage2: the same table saved under those names."""
    from overtake.mdp.policy import Policy

    pol = Policy.load(path)
    model = TandemModel(pol.model.arrival_rate, tuple(Stage(f"stage{i + 1}", s.alpha, s.T)
                                                      for i, s in enumerate(pol.model.stages)))
    out = path.with_name(path.stem + "-stages.npz")
    Policy(model, pol.phase_info, pol.max_requests, pol.max_threads, pol.keys, pol.spawn, dict(pol.meta),
           routes=pol.routes).save(out)
    return str(out)
