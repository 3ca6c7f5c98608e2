"""overtake.controller.online (the package): demand and arrival estimators, the refit/re-solve/swap loop, and the loop in
a real sidecar in front of a real Apache.

Known answers: hand-computed ∫ c(K)/K dt on small admission timelines; a Poisson stream of known
rate; case 4 of van der Weij et al.'s Table 1 (H2 stages, load 0.6) as the truth the refit must recover;
exact E[W] of π(1) on the true model (mdp.evaluate_baseline).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from prometheus_client import generate_latest
from support.service_helpers import replay_h2_transactions

from overtake.controller.errors import SidecarInputError
from overtake.controller.harness import apache
from overtake.controller.harness.loadgen import get
from overtake.controller.harness.scratch import free_port, scratch_dir
from overtake.controller.online import (
    AccessLogTail,
    ArrivalRate,
    AttainedService,
    DemandRecorder,
    OnlineCollector,
    OnlineLoop,
    OnlineSettings,
)
from overtake.controller.sidecar.classifier import Classifier
from overtake.controller.sidecar.limiter import Limiter
from overtake.controller.sidecar.options import SidecarOptions
from overtake.controller.sidecar.policies import load_policy
from overtake.controller.sidecar.service import Sidecar
from overtake.controller.sidecar.stages import StagesConfig, StageTable
from overtake.mdp import Stage, TandemModel, evaluate_baseline
from overtake.mdp.model import capacity

REPO = Path(__file__).resolve().parents[2]
CASE4_PROBS = np.array([0.91, 0.09])
CASE4_MEANS = np.array([0.55, 5.45])
CASE4_MEAN = float(CASE4_PROBS @ CASE4_MEANS)  # 0.991 model units
TIME_UNIT = 0.01  # seconds of service per model time unit (the stages file's default)


def _table() -> StageTable:
    return StageTable(StagesConfig.model_validate(
        {"stages": [{"name": "stage1", "path": "^/stage1$"}, {"name": "stage2", "path": "^/stage2$"}]}))


def _h2(rng: np.random.Generator, n: int) -> np.ndarray:
    phase = rng.random(n) < CASE4_PROBS[1]
    return rng.exponential(np.where(phase, CASE4_MEANS[1], CASE4_MEANS[0]))


# ---- estimators ------------------------------------------------------------------------------
def test_attained_service_equals_the_hand_computed_integral() -> None:
    # A in [0, 3], B in [1, 4]. One core: A = 1 + 2/2 = 2, B = 2/2 + 1 = 2.
    a = AttainedService(cores=1)
    a.admit(1, 0.0)
    a.admit(2, 1.0)
    assert a.release(1, 3.0) == pytest.approx(2.0)
    assert a.release(2, 4.0) == pytest.approx(2.0)
    # two cores: each of two threads has a whole core: A = 1 + 2 = 3, B = 2 + 1 = 3
    a = AttainedService(cores=2)
    a.admit(1, 0.0)
    a.admit(2, 1.0)
    assert a.release(1, 3.0) == pytest.approx(3.0)
    assert a.release(2, 4.0) == pytest.approx(3.0)
    # overhead δ = 0.5 on one core: c(1) = 1/1.5, c(2)/2 = 1/(2·2): A = 1/1.5 + 2/4
    a = AttainedService(cores=1, overhead=0.5)
    a.admit(1, 0.0)
    a.admit(2, 1.0)
    assert a.release(1, 3.0) == pytest.approx(1 / 1.5 + 0.5)
    assert a.release(2, 4.0) == pytest.approx(0.5 + 1 / 1.5)
    assert a.release(3, 5.0) is None  # never admitted
    assert capacity(0, 1, 0.0) == 0.0 and capacity(3, 2, 0.0) == 2.0


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _recording_limiter(spec: str, clock: _Clock, **online: Any) -> tuple[Limiter, OnlineLoop]:
    """A limiter with an online loop's recorder listening, as the sidecar wires them."""
    table = _table()
    pol = load_policy(spec, table.names)
    cl = Classifier(table.config.classifier, pol)
    lim = Limiter(pol, cl, stage_names=table.names, queue_caps=(100, 100), max_inflight=64,
                  passthrough_cap=None, passthrough_queue_cap=10, clock=clock)
    loop = OnlineLoop(OnlineSettings(**online), table=table, time_unit=1.0, policy=pol,
                      current=lambda: lim.policy, swap=lambda p: pol, clock=clock)
    lim.add_listener(loop.recorder)
    return lim, loop


def test_recorder_feeds_attained_service_from_real_admissions() -> None:
    """The limiter's own admission instants drive the integral: π(1) serialises A and B
    (A alone 0..3, B alone 3..4), π(2) overlaps them (2 and 2)."""

    async def run(spec: str) -> list[float]:
        clock = _Clock()
        lim, loop = _recording_limiter(spec, clock, min_samples=2)
        ta = lim.submit(0, 0, "a")
        clock.t = 1.0
        tb = lim.submit(0, 0, "b")
        assert ta is not None and tb is not None
        clock.t = 3.0
        lim.release(ta, "completed")
        clock.t = 4.0
        lim.release(tb, "completed")
        assert loop.recorder.arrivals[0].total == 2
        return list(loop.recorder.stages[0].reservoirs["attained"])

    assert asyncio.run(run("pi(1)")) == pytest.approx([3.0, 1.0])
    assert asyncio.run(run("pi(2)")) == pytest.approx([2.0, 2.0])


def test_arrival_rate_of_a_poisson_stream() -> None:
    rng = np.random.default_rng(7)
    lam, window = 40.0, 50.0
    times = np.cumsum(rng.exponential(1 / lam, int(lam * 400)))
    est = ArrivalRate(window, start=0.0)
    checks = iter([30.0, 100.0, 200.0, 300.0])
    at = next(checks)
    for t in times:
        while t > at:
            r = est.rate(at)
            span = min(at, window)
            sd = math.sqrt(lam * span) / span  # Poisson count over the covered span
            assert r is not None and abs(r - lam) < 4 * sd + lam * (window / 64) / span, (at, r)
            at = next(checks, math.inf)
        est.add(float(t))
    # the window forgets: 60 s after the last arrival nothing is left
    assert est.rate(float(times[-1]) + 60.0) == 0.0
    assert est.rate(0.0) is None


def test_reservoir_keeps_the_latest_samples() -> None:
    clock = _Clock()
    _, loop = _recording_limiter("pi(1)", clock, min_samples=10, reservoir=100)
    for i in range(1000):
        loop.recorder.add_demand(1, float(i), "attained")
    kept = list(loop.recorder.stages[1].reservoirs["attained"])
    assert kept == [float(i) for i in range(900, 1000)]
    assert loop.recorder.stages[1].observed["attained"] == 1000


def test_settings_are_validated_with_the_option_name() -> None:
    with pytest.raises(SidecarInputError, match="--min-samples"):
        OnlineSettings(min_samples=1)
    with pytest.raises(SidecarInputError, match="--refit-interval"):
        OnlineSettings(refit_interval=0)
    with pytest.raises(SidecarInputError, match="--swap-margin"):
        OnlineSettings(margin=1.5)


def test_access_log_tail_reads_only_new_complete_lines(tmp_path: Path) -> None:
    line = ('127.0.0.1 1763719200000000 "GET {p}?work=0.01 HTTP/1.1" 200 12 D=10500 msT=10 usT=10500 '
            'stage={s} cpu_us={c} tid=77 rid=-')
    fmt = apache.LOG_FORMAT
    assert fmt.startswith('%h %{begin:usec}t "%r" %>s %b D=%D')  # the lines below follow this format
    log = tmp_path / "access.log"
    tail = AccessLogTail(log, _table())
    assert tail.poll() == []
    with log.open("w") as f:
        f.write(line.format(p="/stage1", s="stage1", c=10000) + "\n")
        f.write(line.format(p="/other", s="-", c="-") + "\n")
        f.write(line.format(p="/stage2", s="stage2", c=2500) + "\n")
        f.write(line.format(p="/stage2", s="stage2", c=999)[:40])  # being written
    assert tail.poll() == [(0, 0.01), (1, 0.0025)]
    assert tail.poll() == []
    with log.open("a") as f:
        f.write(line.format(p="/stage2", s="stage2", c=999)[40:] + "\n")
    assert tail.poll() == [(1, 0.000999)]
    assert tail.bad_lines == 0
    late = AccessLogTail(log, _table())  # opened on an existing log: only what follows
    assert late.poll() == []
    with log.open("a") as f:
        f.write(line.format(p="/stage1", s="stage1", c=40) + "\n")
    assert late.poll() == [(0, 4e-05)] and tail.poll() == [(0, 4e-05)]


def test_every_line_of_a_stage_arrives_and_only_a_200_answer_gives_a_demand(tmp_path: Path) -> None:
    """Module mode's arrivals and demands from the log: a request the module dropped (its client
    left: 499) or answered with an error arrived all the same; a demand is the stage handler's CPU
    note, or else the module's thread-CPU note where the stage's work runs in Apache's threads
    (a real application's handler), never where it runs behind FPM or a proxy (Apache only waits)."""
    head = '127.0.0.1 1763719200000000 "GET {p} HTTP/1.1" {code} 12 D=10500 msT=10 usT=10500 stage=- cpu_us={c} tid=77 rid=-'
    times = " owall_us=9000 ostart_us=100 ocpu_us={o} owait_us=500 oblocked_us=0"
    lines = [head.format(p="/stage1", code=200, c=10000) + times.format(o=10400),  # the handler's note
             head.format(p="/stage1", code=200, c="-") + times.format(o=8000),  # the module's only
             head.format(p="/stage1", code=499, c="-") + times.format(o="-").replace("9000", "-"),
             head.format(p="/stage2", code=404, c="-") + times.format(o=300),
             head.format(p="/stage2", code=200, c="-") + times.format(o="-").replace("9000", "-"),
             head.format(p="/other", code=200, c=5000) + times.format(o=5100)]
    want = {None: [(0, 0.01), (0, None), (0, None), (1, None), (1, None)],
            "apache": [(0, 0.01), (0, 0.008), (0, None), (1, None), (1, None)],
            "fcgi": [(0, 0.01), (0, None), (0, None), (1, None), (1, None)]}
    for runs_in, expected in want.items():
        log = tmp_path / f"access-{runs_in}.log"
        tail = AccessLogTail(log, _table())
        if runs_in is not None:
            tail.runs_in = lambda stage, where=runs_in: where if stage == "stage1" else None
        log.write_text("\n".join(lines) + "\n")
        recs = tail.poll()
        assert recs == expected, runs_in
        assert tail.no_cpu == (1 if runs_in == "apache" else 2), runs_in  # 200 answers without a demand
        assert tail.lines == {"stage1": 3, "stage2": 2}
        assert tail.no_demand == ({"stage2": 1} if runs_in == "apache" else {"stage1": 1, "stage2": 1})
        rec = DemandRecorder(OnlineSettings(access_log=str(log), arrivals_from_log=True), _table(),
                             time_unit=0.01, cores=1, overhead=0.0, clock=lambda: 100.0)
        assert rec.poll_log(recs) == 5
        assert [rec.arrivals[i].total for i in (0, 1)] == [3, 2]  # every routed line, whatever its answer
        assert [len(rec.stages[i].reservoirs["access_log"]) for i in (0, 1)] == [2 if runs_in == "apache" else 1, 0]


@pytest.mark.parametrize(("runs_in", "why"), [
    (None, "OvertakeRequestTimes On"), ("fcgi", "runs in fcgi"), ("unknown", "not known yet")])
def test_module_mode_says_once_why_a_stages_answers_give_no_demand(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, runs_in: str | None, why: str) -> None:
    """Where the log is the only source (module mode), a stage whose answered requests give no
    demand would wait for samples for ever: after 50 of them, none with a demand, one warning names
    the stage, why and the fix, and the lines are counted on /-/metrics; a stage with demands is
    not named, nor the same stage twice."""
    log = tmp_path / "access.log"
    log.touch()
    table = _table()
    pol = load_policy("pi(1)", table.names)
    loop = OnlineLoop(OnlineSettings(access_log=str(log), arrivals_from_log=True), table=table, time_unit=0.01,
                      policy=pol, current=lambda: pol, swap=lambda p: pol)
    assert loop.recorder.tail is not None
    # stage1: no handler's note, the module's (None: none); stage2: the handler's note
    loop.recorder.tail.runs_in = lambda stage: None if runs_in == "unknown" else runs_in
    head = '127.0.0.1 1763719200000000 "GET {p} HTTP/1.1" 200 12 D=10500 msT=10 usT=10500 stage=- cpu_us={c} tid=77 rid=-'
    times = "" if runs_in is None else " owall_us=9000 ostart_us=100 ocpu_us=8000 owait_us=500 oblocked_us=0"
    lines = [head.format(p="/stage1", c="-") + times, head.format(p="/stage2", c=5000) + times]
    for rounds in (30, 30):  # 60 answers of each stage, read in two polls
        with log.open("a") as f:
            f.write("\n".join(lines * rounds) + "\n")
        with caplog.at_level(logging.WARNING, logger="overtake.sidecar"):
            asyncio.run(loop.poll_log())
    said = [r for r in caplog.records if getattr(r, "event", None) == "online_no_demand"]
    assert len(said) == 1 and "stage stage1: 60 answered requests" in said[0].getMessage(), [r.getMessage() for r in said]
    assert said[0].detail["stage"] == "stage1" and why in said[0].detail["why"]  # type: ignore[attr-defined]
    text = _metrics(loop)
    assert 'overtake_online_log_lines_total{stage="stage1"} 60.0' in text
    assert 'overtake_online_log_lines_without_demand_total{stage="stage1"} 60.0' in text
    assert 'overtake_online_log_lines_without_demand_total{stage="stage2"} 0.0' in text
    assert "overtake_online_log_lines_unparsed_total 0.0" in text


# ---- the loop on case 4 ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker() -> Iterator[ProcessPoolExecutor]:
    ex = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    try:
        yield ex
    finally:
        ex.shutdown(wait=True)


def _sidecar(policy: str) -> Sidecar:
    return Sidecar(_table(), SidecarOptions.from_flat(policy=policy, apache="http://127.0.0.1:9", listen="127.0.0.1:9"))


def _case4_loop(side: Sidecar, clock: _Clock, executor: Any, seed: int, scale: float = 1.0,
                age_thresholds: bool = False, **kw: Any) -> OnlineLoop:
    """A loop wired to ``side`` exactly as Sidecar wires its own, fed case 4 data: 4000 H2 demands per
    stage (seconds = model units × TIME_UNIT × ``scale``) and Poisson arrivals at load 0.6 over 120 s."""
    settings = OnlineSettings(**{"refit_interval": 3600.0, "min_samples": 500, "arrival_window": 120.0,
                                 "reservoir": 4000, **kw})
    loop = OnlineLoop(settings, table=side.table, time_unit=TIME_UNIT, policy=side.policy,
                      current=lambda: side.limiter.policy, swap=lambda p: side.swap(p, source="online"),
                      executor=executor, clock=clock, age_thresholds=age_thresholds)
    rng = np.random.default_rng(seed)
    for stage in (0, 1):
        for x in _h2(rng, 4000):
            loop.recorder.add_demand(stage, float(x) * TIME_UNIT * scale, "attained")
    lam = 0.6 / (2 * CASE4_MEAN) / TIME_UNIT / scale  # transactions per second
    t = clock.t
    for gap in rng.exponential(1 / lam, int(lam * 130)):
        t += gap
        if t > clock.t + 120:
            break
        loop.recorder.add_arrival(0, t)
    clock.t += 120.0
    return loop


def _metrics(loop: OnlineLoop) -> str:
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    reg.register(OnlineCollector(loop))
    return generate_latest(reg).decode()


def test_refit_on_case4_swaps_pi1_for_the_solved_policy_and_keeps_it_after(worker: ProcessPoolExecutor) -> None:
    side = _sidecar("pi(1)")
    clock = _Clock()
    loop = _case4_loop(side, clock, worker, seed=4)
    t0 = time.perf_counter()
    outcome = asyncio.run(loop.refit())
    seconds = time.perf_counter() - t0
    rec = loop.last
    assert outcome == "swapped", rec
    # the fit recovers case 4's means (4000 samples: 3.5 % standard error)
    for f in rec["fit"]:
        assert f["mean"] == pytest.approx(CASE4_MEAN, rel=0.10), f
        assert f["order"] == 2  # BIC prefers H2 over the exponential
        # phase 1 is the short phase (as case04.yaml and the clients' phase header have it)
        assert -1 / f["T"][0][0] == pytest.approx(CASE4_MEANS[0], rel=0.25)
        assert -1 / f["T"][1][1] == pytest.approx(CASE4_MEANS[1], rel=0.25)
        assert f["alpha"][0] == pytest.approx(CASE4_PROBS[0], abs=0.03)
    assert rec["load"] == pytest.approx(0.6, rel=0.15)
    # π(1)'s predicted E[W] under the refitted model is close to its exact value on the true model
    a, T = CASE4_PROBS, np.diag(-1 / CASE4_MEANS)
    true_model = TandemModel(0.6 / (2 * CASE4_MEAN), (Stage("stage1", a, T), Stage("stage2", a, T)))
    pi1_true = evaluate_baseline(true_model, "pi(1)").metrics.mean_response_time
    assert rec["predicted_current"] == pytest.approx(pi1_true, rel=0.25)
    assert rec["predicted_new"] < rec["predicted_current"] * 0.99
    # swapped through the sidecar's atomic path: version (swap count, name, hash) moved on
    assert side.metrics.swaps == 1 and loop.generation == 1
    assert side.policy.name.startswith("online-") and side.policy.phases == (2, 2)
    assert side.policy.predicted_wait == pytest.approx(rec["predicted_new"], rel=1e-9)
    text = _metrics(loop)
    assert 'overtake_online_refits_total{outcome="swapped"} 1.0' in text
    m = re.search(r'overtake_online_fitted_mean_seconds\{source="attained",stage="stage1"\} (\S+)', text)
    assert m and float(m.group(1)) == pytest.approx(CASE4_MEAN * TIME_UNIT, rel=0.10)
    assert re.search(r'overtake_online_predicted_response_time_seconds\{policy="new"\} ', text)
    print(f"refit+solve {seconds:.2f} s (worker {rec['worker_seconds']}); means "
          f"{[round(f['mean'], 4) for f in rec['fit']]} vs {CASE4_MEAN}; E[W] pi(1) {rec['predicted_current']:.4f} "
          f"(true {pi1_true:.4f}), pi* {rec['predicted_new']:.4f}")

    # rate limited: a second attempt inside the interval starts nothing
    assert asyncio.run(loop.refit()) == "skipped_rate_limited"
    assert loop.outcomes["swapped"] == 1 and side.metrics.swaps == 1

    # the same data seen again while the solved π* runs: the re-solve gives the same policy, kept
    clock2 = _Clock()
    again = _case4_loop(side, clock2, worker, seed=4)
    assert asyncio.run(again.refit()) == "kept", again.last
    assert again.last["predicted_new"] == pytest.approx(again.last["predicted_current"], rel=1e-6)
    assert side.metrics.swaps == 1 and side.policy.name.startswith("online-")
    asyncio.run(loop.close())
    asyncio.run(again.close())


def test_age_thresholds_follow_a_changed_demand_scale_though_the_count_policy_is_kept(
        worker: ProcessPoolExecutor) -> None:
    """With age thresholds (a control file): demands four times longer at the same load leave the best
    count policy as it was (the model scales in time), so its predicted E[W] is no better; the refit
    still swaps, because the thresholds chosen for the new demands moved, about fourfold."""
    from overtake.controller.sidecar.control_file import age_thresholds

    side = _sidecar("pi(1)")
    loop = _case4_loop(side, _Clock(), worker, seed=4, age_thresholds=True)
    assert asyncio.run(loop.refit()) == "swapped", loop.last
    first = age_thresholds(side.limiter.policy)
    assert first is not None
    longer = _case4_loop(side, _Clock(), worker, seed=4, scale=4.0, age_thresholds=True)
    assert asyncio.run(longer.refit()) == "swapped", longer.last
    rec = longer.last
    assert not rec["predicted_new"] < rec["predicted_current"] * 0.99, rec  # the count policy alone: kept
    assert "age thresholds moved" in rec["reason"], rec["reason"]
    second = age_thresholds(side.limiter.policy)
    assert second is not None
    assert second[0][0] == pytest.approx(4 * first[0][0], rel=0.35), (first, second)
    # the same demands again: neither the count policy nor the thresholds move, kept
    again = _case4_loop(side, _Clock(), worker, seed=4, scale=4.0, age_thresholds=True)
    assert asyncio.run(again.refit()) == "kept", again.last
    for lp in (loop, longer, again):
        asyncio.run(lp.close())


def test_failing_solve_is_counted_and_the_old_policy_kept() -> None:
    """Fault injection: the solver (overtake.mdp.solve) raises inside the (thread) worker."""
    side = _sidecar("pi(2)")
    clock = _Clock()
    with (
        ThreadPoolExecutor(1) as ex,
        mock.patch("overtake.mdp.solve", side_effect=RuntimeError("injected solver failure")),
    ):
        loop = _case4_loop(side, clock, ex, seed=1, refit_interval=30.0)
        assert asyncio.run(loop.refit()) == "failed"
        assert "injected solver failure" in loop.last["reason"]
        # rate limiting holds for failures too, and lifts after the interval
        clock.t += 29.0
        assert asyncio.run(loop.refit()) == "skipped_rate_limited"
        clock.t += 1.5
        assert asyncio.run(loop.refit()) == "failed"
    assert side.policy.name == "pi(2)" and side.metrics.swaps == 0
    assert loop.outcomes == {**dict.fromkeys(loop.outcomes, 0), "failed": 2, "skipped_rate_limited": 1}
    assert not list(Path(loop.worker.dir).glob("*.npz")) if loop.worker.dir else True  # nothing left behind
    asyncio.run(loop.close())


def test_refit_is_skipped_without_samples_or_at_high_load() -> None:
    side = _sidecar("pi(1)")
    clock = _Clock()

    def boom(job: Any) -> dict[str, Any]:  # a job must never start in these cases
        raise AssertionError("job started")

    with ThreadPoolExecutor(1) as ex:
        few = OnlineLoop(OnlineSettings(min_samples=50), table=side.table, time_unit=TIME_UNIT, policy=side.policy,
                         current=lambda: side.limiter.policy, swap=lambda p: side.swap(p, source="online"),
                         executor=ex, job=boom, clock=clock)
        for _ in range(49):
            few.recorder.add_demand(0, 0.01, "attained")
            few.recorder.add_demand(1, 0.01, "attained")
        assert asyncio.run(few.refit()) == "skipped_samples"
        assert "fewer than 50" in few.last["reason"]
        loop = _case4_loop(side, clock, ex, seed=2, max_load=0.5)  # true load 0.6
        loop.worker.job = boom
        assert asyncio.run(loop.refit()) == "skipped_load"
        assert loop.last["load"] == pytest.approx(0.6, rel=0.15)
    assert side.metrics.swaps == 0


# ---- end to end: real sidecar, real Apache ---------------------------------------------------
E2E_STAGES = """
stages:
  - name: stage1
    path: "^/stage1$"
  - name: stage2
    path: "^/stage2$"
limits: {max_inflight: 16, queue_cap: 1000, queue_timeout: 30}
classifier: {mode: explicit, time_unit: 0.005}
"""


#: transactions of the end-to-end test; its refit waits for the CPU notes of all of them
#: (``--min-samples``) and counts every arrival (an ``--arrival-window`` longer than the test), so
#: what it fits does not depend on where its refit ticks fall in the traffic: a refit on the first
#: ~100 notes misses the long requests still in service (their means fall to ~0.8 of the sent
#: ones), and a 5 s window loses arrivals when the last requests finish late
N_E2E = 150


@pytest.mark.apache_functional
def test_online_loop_end_to_end_on_apache(apache_available: None) -> None:
    """~300 stage requests with case-4 H2 demands (time unit 5 ms, load 0.6) through a sidecar
    started with π(1) and --online: it must refit from Apache's CPU notes and swap in π*."""
    parent = scratch_dir("overtake-online-test-")
    cores = sorted(os.sched_getaffinity(0))
    inst = apache.start(parent / "wd", f"127.0.0.1:{free_port()}", cpu=cores[-1] if len(cores) > 1 else None,
                        max_workers=32)
    stages = parent / "stages.yaml"
    stages.write_text(E2E_STAGES)
    port, admin = free_port(), free_port()
    logf = parent / "sidecar.log"
    with logf.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "overtake.api.cli", "sidecar", "--policy", "pi(1)", "--apache", inst.base_url,
             "--listen", f"127.0.0.1:{port}", "--stages", str(stages), "--admin-listen", f"127.0.0.1:{admin}",
             "--online", "--refit-interval", "2",
             "--min-samples", str(N_E2E), "--arrival-window", "120", "--access-log", str(inst.access_log)],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if get(port, "/-/healthz")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, logf.read_text()
            time.sleep(0.1)
        unit, n = 0.005, N_E2E
        lam = 0.6 / (2 * CASE4_MEAN) / unit  # transactions per second, as replay_h2_transactions sends them
        demands, phases, codes = replay_h2_transactions(lambda path, headers: get(port, path, headers)[0], n,
                                                        unit=unit)

        def transaction(i: int) -> None:
            for s in (0, 1):
                code, _ = get(port, f"/stage{s + 1}?work={demands[i, s]:.6f}",
                               {"X-Overtake-Phase": str(int(phases[i, s]) + 1)})
                codes.append(code)

        assert codes.count(200) == 2 * n
        info: dict[str, Any] = {}
        deadline = time.monotonic() + 35
        while time.monotonic() < deadline:
            info = json.loads(get(admin, "/-/policy")[1])
            if info["online"]["generation"] >= 1 or info["online"]["refits"]["failed"]:
                break
            time.sleep(0.5)
        last = info["online"]["last"]
        assert info["online"]["generation"] == 1, (info, logf.read_text()[-3000:])
        assert info["name"].startswith("online-") and info["phases"] == [2, 2] and info["swaps"] == 1
        assert last["outcome"] == "swapped" and last["source"] == {"stage1": "access_log", "stage2": "access_log"}
        # the fitted means are Apache's CPU notes of the demands we sent; phase 1 = the short phase
        for s, f in enumerate(last["fit"]):
            sent = float(demands[:, s].mean()) / unit
            assert f["mean"] == pytest.approx(sent, rel=0.3), (f, sent)
            assert f["T"][0][0] < f["T"][1][1] < 0
        # the swapped-in policy serves: phase-tagged requests complete
        for i in range(10):
            transaction(i)
        assert codes.count(200) == 2 * n + 20
        text = get(admin, "/-/metrics")[1].decode()
        assert 'overtake_online_refits_total{outcome="swapped"} 1.0' in text
        lines = [json.loads(x) for x in logf.read_text().splitlines() if x.startswith("{")]
        ev = [x for x in lines if x.get("event") == "online_refit" and x.get("outcome") == "swapped"]
        assert ev and ev[0]["refit"]["predicted_new"] < ev[0]["refit"]["predicted_current"]
        print(f"e2e: refit {last['seconds']:.2f} s, worker {last['worker_seconds']}, lambda "
              f"{last['arrival_rate_per_second']:.1f}/s (sent {lam:.1f}/s), load {last['load']:.3f}, "
              f"means {[round(f['mean'], 3) for f in last['fit']]}, E[W] {last['predicted_current']:.3f} -> "
              f"{last['predicted_new']:.3f}")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        apache.stop(inst.workdir, graceful=False)
        shutil.rmtree(parent, ignore_errors=True)


# ---- the worker: nice 19, its CPU counted, route classes carried over -------------------------
def _proc_stat(pid: int) -> list[str]:
    # fields after "pid (comm)": index 0 is field 3 (state) of proc(5)
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _proc_cpu(pid: int) -> float:
    f = _proc_stat(pid)
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_refit_worker_runs_at_nice_19_and_its_cpu_is_exported() -> None:
    """The loop's own worker process solves at nice 19 (read from /proc, the sidecar's process
    untouched) and overtake_solve_cpu_seconds_total{kind} grows by the worker's CPU time."""
    from overtake.controller.online.refit import warm_up

    own_nice = os.getpriority(os.PRIO_PROCESS, 0)
    side = _sidecar("pi(1)")
    loop = _case4_loop(side, _Clock(), None, seed=7)
    try:
        pid = loop.worker.pool().submit(os.getpid).result()
        loop.worker.pool().submit(warm_up).result()  # imports before the CPU reading, as at sidecar start
        assert pid != os.getpid()
        assert int(_proc_stat(pid)[16]) == 19
        assert os.getpriority(os.PRIO_PROCESS, 0) == own_nice
        assert not re.search(r"^overtake_solve_cpu_seconds_total\{", _metrics(loop), re.M)
        before = _proc_cpu(pid)
        assert asyncio.run(loop.refit()) == "swapped", loop.last
        grown = _proc_cpu(pid) - before
        assert loop.last["worker_pid"] == pid and loop.last["worker_nice"] == 19
        m = re.search(r'overtake_solve_cpu_seconds_total\{kind="full"\} (\S+)', _metrics(loop))
        assert m, _metrics(loop)
        cpu = float(m.group(1))
        tick = 2.0 / os.sysconf("SC_CLK_TCK")  # /proc counts in clock ticks
        # the job's own CPU: all of the worker's growth but unpickling the job and pickling the result
        assert 0 < cpu <= grown + tick
        assert cpu >= 0.9 * grown - tick
    finally:
        asyncio.run(loop.close())


def test_route_classes_carried_to_a_refitted_model_keep_the_mixture() -> None:
    """Each route keeps its likelihood ratio over the phases; the mixture of the carried routes is
    the refitted stage's α again (Σ_r p'_r α'_r = α'), and an unchanged fit changes nothing."""
    from overtake.controller.online.refit import carry_routes
    from overtake.mdp.routes import RouteSplit

    T = np.diag(-1 / CASE4_MEANS)
    old = TandemModel(0.3, (Stage("a", CASE4_PROBS, T), Stage("b", CASE4_PROBS, T)))
    split = RouteSplit.build(old, [[("img", 0.5, [0.99, 0.01]), ("php", 0.5, [0.83, 0.17])], None])
    same = carry_routes(split, old, old)
    for rs, rs2 in zip(split.stages, same.stages):
        for r, r2 in zip(rs, rs2):
            assert r2.weight == pytest.approx(r.weight, abs=1e-12)
            assert np.allclose(r2.alpha, r.alpha, atol=1e-12)
    a_new = np.array([0.8, 0.2])
    new = TandemModel(0.3, (Stage("a", a_new, T), Stage("b", a_new, T)))
    moved = carry_routes(split, old, new)
    for rs in moved.stages:
        mix = sum(r.weight * np.asarray(r.alpha) for r in rs)
        assert np.allclose(mix, a_new, atol=1e-12)
    img, php = moved.stages[0]
    # the odds of the long phase move by the same factor for every route
    factor = (0.2 / 0.8) / (0.09 / 0.91)
    assert img.alpha[1] / img.alpha[0] == pytest.approx(0.01 / 0.99 * factor, rel=1e-9)
    assert php.alpha[1] / php.alpha[0] == pytest.approx(0.17 / 0.83 * factor, rel=1e-9)


def _route_loop(tmp_path: Path, interval: float) -> OnlineLoop:
    """One H2 stage (case 4's) at load 0.5 under its route policy (two routes, 1 % and 17 % long),
    fed 4000 demands and 120 s of Poisson arrivals."""
    from overtake.controller.sidecar.policies import TablePolicy
    from overtake.mdp import solve
    from overtake.mdp.policy import Policy
    from overtake.mdp.routes import RouteSplit

    lam = 0.5 / CASE4_MEAN
    m = TandemModel(lam, (Stage("stage1", CASE4_PROBS, np.diag(-1 / CASE4_MEANS)),))
    split = RouteSplit.build(m, [[("img", 0.5, [0.99, 0.01]), ("php", 0.5, [0.83, 0.17])]])
    solve(m, phase_info="route", routes=split, tol=1e-2).policy.save(str(tmp_path / "route.npz"))
    running = [TablePolicy(Policy.load(str(tmp_path / "route.npz")), "route")]
    table = StageTable(StagesConfig.model_validate({"stages": [{"name": "stage1", "path": "^/stage1$"}]}))
    clock = _Clock()

    def swap(path: str) -> Any:
        running[0] = TablePolicy(Policy.load(path), "online")
        return running[0]

    loop = OnlineLoop(OnlineSettings(refit_interval=interval, min_samples=500, arrival_window=120.0, reservoir=4000),
                      table=table, time_unit=TIME_UNIT, policy=running[0], current=lambda: running[0], swap=swap,
                      executor=ThreadPoolExecutor(1), clock=clock)
    rng = np.random.default_rng(11)
    for x in _h2(rng, 4000):
        loop.recorder.add_demand(0, float(x) * TIME_UNIT, "attained")
    t = 0.0
    for gap in rng.exponential(TIME_UNIT / lam, int(lam / TIME_UNIT * 130)):
        t += gap
        if t > 120:
            break
        loop.recorder.add_arrival(0, t)
    clock.t = 120.0
    return loop


def test_route_policy_is_re_solved_with_its_routes(tmp_path: Path) -> None:
    """A running route policy is re-solved as a route policy (not skipped): the running one is
    evaluated exactly on the carried routes, and the re-solve is at least as good; a refit
    interval shorter than the solve skips it with the reason."""
    loop = _route_loop(tmp_path, 3600.0)
    outcome = asyncio.run(loop.refit())
    rec = loop.last
    assert outcome in ("kept", "swapped"), rec
    assert rec["current_error"] is None and math.isfinite(rec["predicted_current"])
    assert rec["predicted_new"] <= rec["predicted_current"] * (1 + 0.05)
    assert loop.solve_cpu.keys() == {"route"} and loop.solve_cpu["route"] > 0
    asyncio.run(loop.close())
    quick = _route_loop(tmp_path, 1e-3)
    assert asyncio.run(quick.refit()) == "skipped_route", quick.last
    assert "longer than the refit interval" in quick.last["reason"]
    asyncio.run(quick.close())
    for lp in (loop, quick):
        assert lp.worker.executor is not None
        lp.worker.executor.shutdown(wait=True)
