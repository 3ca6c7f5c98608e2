"""The live verification end to end: a real private Apache, the sidecar with ``--verify``, open-loop
traffic, windows of a few seconds.

- π(1) (one request in Apache at a time) for short requests beside long reports (a path no stage
  claims): Apache's processor sharing gives the short requests together k/(k + h) of the core
  when k of them run beside h reports, π(1) only 1/(h + 1), so π(1)'s queue builds where the
  default's does not. The model of that scenario (:func:`reports_model`) puts π(1)'s mean
  response time more than twice the default's; the verifier estimates a loss and falls back to
  Apache's default (``worse``).
- short requests beside long reports under the age threshold of π* for Table 1 case 4 (mod_overtake_prio
  through the control file): Apache's processor sharing gives a short request about a quarter of
  the core, the threshold puts the reports at nice 19 and gives it nearly all; the verifier
  keeps the policy, and the module has the policy's threshold and the default's (3600 s, nothing
  demoted) in force in turn.

Every request is answered (200) through every switch; the verdict is in the log, ``/-/policy``
and the metrics."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from support.control_apache import control_apache
from support.service_helpers import SidecarProc

from overtake.controller.harness import apache
from overtake.controller.harness.loadgen import calibrate
from overtake.controller.harness.scratch import free_port, scratch_dir

if TYPE_CHECKING:
    from overtake.mdp import TandemModel

UNIT = 0.02  # seconds of CPU per model time unit: well above the scheduler's slice, so Apache shares like PS
STAGES = """
stages:
  - name: stage1
    path: "^/stage1$"
  - name: stage2
    path: "^/stage2$"
limits: {max_inflight: 28, queue_cap: 1000, queue_timeout: 120}
classifier: {mode: hidden}
"""
STAGES_EXPLICIT = STAGES.replace("{mode: hidden}", f"{{mode: explicit, time_unit: {UNIT}}}")
THRESHOLD = 1.77  # model units of thread CPU: the age lever's threshold for case 4
VERIFY = ["--verify", "--verify-window", "4", "--verify-settle", "1", "--verify-min-pairs", "3",
          "--verify-max-pairs", "6", "--verify-min-requests", "10"]


@pytest.fixture(scope="module")
def server(apache_available: None) -> Iterator[apache.ApacheInstance]:
    parent = scratch_dir("overtake-verify-test-")
    cores = sorted(os.sched_getaffinity(0))
    inst = apache.start(parent / "wd", f"127.0.0.1:{free_port()}", cpu=cores[-1] if len(cores) > 1 else None,
                        max_workers=32)
    try:
        calibrate(apache.parse_listen(inst.listen)[1], 0.001, n=32, rounds=1)  # every worker's Lua state, before timing
        yield inst
    finally:
        apache.stop(inst.workdir, graceful=False)
        shutil.rmtree(parent, ignore_errors=True)


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str, phase: int | None) -> int:
    ph = "" if phase is None else f"X-Overtake-Phase: {phase}\r\n"
    writer.write(f"GET {path} HTTP/1.1\r\nHost: verify\r\n{ph}\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    n = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
              if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(n)
    return int(head[9:12])


async def _drive(port: int, rate: float, demands: Callable[[np.random.Generator], list[float]],
                 done: threading.Event, deadline: float, phases: bool, hogs: int) -> list[int]:
    """Poisson transactions (one connection each, its stages in order) until ``done`` or the
    deadline; the status of every request sent (599: no answer). ``phases``: send each
    request's phase (1: short, 2: long) in X-Overtake-Phase. ``hogs`` clients each keep one
    300 ms request running on /stage3 (no stage claims it) meanwhile."""
    rng = np.random.default_rng(5)
    codes: list[int] = []

    async def transaction(work: list[float]) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for s, w in enumerate(work):
                if not w:
                    continue
                try:
                    phase = (1 if w < 0 else 2) if phases and s < 2 else None
                    codes.append(await _get(reader, writer, f"/stage{s + 1}?work={abs(w):.6f}", phase))
                except (OSError, asyncio.IncompleteReadError, ValueError):
                    codes.append(599)
                    return
        finally:
            writer.close()

    async def hog() -> None:
        while not done.is_set() and time.monotonic() < deadline:
            await transaction([0.0, 0.0, 0.3])

    tasks = [asyncio.create_task(hog()) for _ in range(hogs)]
    while not done.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(float(rng.exponential(1 / rate)))
        tasks.append(asyncio.create_task(transaction(demands(rng))))
    await asyncio.gather(*tasks)
    return codes


def verify_run(side: SidecarProc, rate: float, demands: Callable[[np.random.Generator], list[float]],
               timeout: float = 240, phases: bool = False, hogs: int = 0,
               on_watch: Callable[[], None] | None = None) -> tuple[dict[str, Any], list[int]]:
    """Drive traffic until the verification decides; (its /-/policy view, the statuses).
    ``on_watch`` is called at every look at /-/policy (once a second)."""
    done = threading.Event()
    view: dict[str, Any] = {}

    def watch() -> None:
        while not done.is_set():
            time.sleep(1)
            info = json.loads(side.request("GET", "/-/policy")[2])
            view.update(info)
            if on_watch is not None:
                on_watch()
            if info["verify"]["state"] != "verifying":
                done.set()

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    codes = asyncio.run(_drive(side.port, rate, demands, done, time.monotonic() + timeout, phases, hogs))
    done.set()
    th.join(10)
    return view, codes


REPORTS = 7  # clients that each keep one 300 ms report running beside the short requests
SHORT = 0.0025  # mean seconds of CPU of a short request (Erlang-4: c² = 1/4)
SHORT_RATE = 35.0  # short requests per second: under π(1) each holds the core's 1/8 share, load 0.7
# up to eight pairs: a neighbour's load on Apache's core widens the pairs' spread (it slows π(1) the more)
SLOW_VERIFY = ["--verify", "--verify-window", "4", "--verify-settle", "1", "--verify-min-pairs", "3",
               "--verify-max-pairs", "8", "--verify-min-requests", "10"]


def pair_gains(side: SidecarProc) -> list[float]:
    """Each counted pair's gain, 1 - policy mean / default mean, for the test's printout."""
    pairs = [e["detail"] for e in side.events() if e.get("event") == "verification_pair" and "gain" in e["detail"]]
    return [round(1 - p["policy_mean_seconds"] / p["default_mean_seconds"], 2) for p in pairs]


def short_demand(rng: np.random.Generator) -> list[float]:
    """One stage request's demand in seconds of CPU: Erlang-4 of mean :data:`SHORT`."""
    return [float(rng.gamma(4, SHORT / 4))]


def reports_model(reports: int, short: float, rate: float) -> TandemModel:
    """The slower-policy scenario as the paper's tandem: one stage of Erlang-4 demands (mean
    ``short`` s of CPU, Poisson ``rate``) beside ``reports`` requests that never end, all sharing
    one core equally, so each of K stage threads runs at 1/(K + reports) of the core. That is
    c(K) = min(K, m)/(1 + δK) with m above any K and δ = 1/reports, per thread reports/(K + reports),
    with demands of ``reports`` x ``short`` in the model's work: the time unit stays a second."""
    from overtake.mdp import Stage, TandemModel

    k, work = 4, reports * short
    T = np.diag(np.full(k, -k / work)) + np.diag(np.full(k - 1, k / work), 1)
    return TandemModel(arrival_rate=rate, stages=(Stage("stage1", np.eye(k)[0], T),), cores=1000,
                       overhead=1.0 / reports)


def test_a_policy_slower_than_apaches_default_falls_back(server: apache.ApacheInstance, tmp_path: Path) -> None:
    from overtake.mdp import evaluate_baseline

    model = reports_model(REPORTS, SHORT, SHORT_RATE)
    slow, default = (evaluate_baseline(model, p).metrics.mean_response_time for p in ("pi(1)", "pi(inf)"))
    # cross-check by closed forms: π(1) is M/E4/1 FCFS of service (h + 1) s, Pollaczek-Khinchine;
    # the default a symmetric queue with h permanent jobs, (h + 1) s / (1 - λ s) (Kelly, Reversibility
    # and Stochastic Networks, §3.3)
    service, rho = (REPORTS + 1) * SHORT, SHORT_RATE * (REPORTS + 1) * SHORT
    assert slow == pytest.approx(service * (1 + rho * 1.25 / (2 * (1 - rho))), rel=1e-2)
    assert default == pytest.approx(service / (1 - SHORT_RATE * SHORT), rel=1e-2)
    expected = 1 - slow / default  # the verifier's gain: about -124 %, far beyond a few pairs' noise
    assert expected < -1.0, expected
    side = SidecarProc(tmp_path, ["--policy", "pi(1)", "--apache", server.base_url, *SLOW_VERIFY], stages=STAGES)
    try:
        view, codes = verify_run(side, SHORT_RATE, short_demand, hogs=REPORTS)
        v = view["verify"]
        assert v["state"] == "fell_back" and v["in_force"] == "default", side.text()[-4000:]
        assert v["reason"] == "worse" and v["gain"] < 0 and v["ci"][1] < 0 and v["policy"] == "pi(1)", v
        assert view["name"] == "pi(1)"  # the policy the sidecar stands for, now running as the default
        assert codes and all(c == 200 for c in codes), sorted(set(codes))
        decision = [e for e in side.events() if e.get("event") == "verification_decision"]
        assert len(decision) == 1 and decision[0]["detail"]["gain"] == v["gain"], decision
        metrics = side.request("GET", "/-/metrics")[2].decode()
        assert 'overtake_verification_state{state="fell_back"} 1.0' in metrics
        assert 'overtake_verification_arm{arm="default"} 1.0' in metrics
        assert f'overtake_verification_pairs_total{{outcome="used"}} {float(v["pairs"])!r}' in metrics
        print(f"pi(1) beside {REPORTS} reports: {v['pairs']} pairs, gain {v['gain']:+.1%} CI {v['ci']} "
              f"(model {expected:+.1%}), {v['reason']}; pairs' gains {pair_gains(side)}; {len(codes)} requests")
    finally:
        side.stop()


@pytest.fixture(scope="module")
def prio_server(apache_available: None) -> Iterator[tuple[apache.ApacheInstance, str]]:
    """Apache with mod_overtake_prio reading a control file; its configured threshold demotes
    nothing (3600 s), so only the sidecar's table demotes."""
    with control_apache("verify", pin=True, levels=(3600.0,), nice=(19,)) as (inst, path):
        calibrate(apache.parse_listen(inst.listen)[1], 0.001, n=32, rounds=1)
        yield inst, path


def case4_policy(path: Path, load: float, unit: float) -> Path:
    """π* for Table 1 case 4's two H2 stages at ``load`` on one core, carrying an age threshold
    of 1.77 model units (as ``overtake solve --cpu-priority age`` chose for this case)."""
    from overtake.mdp import Stage, TandemModel, Truncation, solve

    p, m = np.array([0.91, 0.09]), np.array([0.55, 5.45])
    s1 = Stage("stage1", p, np.diag(-1.0 / m))
    opt = solve(TandemModel(arrival_rate=load / (2 * float(p @ m)), stages=(s1, Stage("stage2", s1.alpha, s1.T))),
                truncation=Truncation(8, 3))
    opt.policy.meta.update(metrics=opt.metrics.to_dict(), time_unit=unit, cpu_priority={"age": {
        "mean_response_time": 1.0, "passthrough": 1.2, "thresholds": [[THRESHOLD], [THRESHOLD]]}})
    opt.policy.save(path)
    return path


def test_a_policy_faster_than_apaches_default_is_kept(prio_server: tuple[apache.ApacheInstance, str],
                                                      tmp_path: Path) -> None:
    """Short requests (5 ms of CPU, Poisson, load 0.1) beside three clients that each keep a 300 ms
    report running (a path no stage claims: forwarded, not measured). Apache's default shares the
    core four ways, so a short request takes about four times its CPU; the policy's age threshold
    (35 ms) puts the reports at nice 19 once past it, so short requests run nearly alone: kept.
    The module has the policy's threshold and the default's (3600 s) in force in turn, and the
    policy's at the end."""
    inst, control = prio_server
    pol = case4_policy(tmp_path / "case4-age.npz", 0.6, UNIT)
    side = SidecarProc(tmp_path, ["--policy", str(pol), "--apache", inst.base_url, "--control-file", control,
                                  "--cpu-priority", "age", "--status-interval", "0.5", *VERIFY],
                       stages=STAGES_EXPLICIT)
    seen: set[float] = set()
    try:
        view, codes = verify_run(side, 20.0, lambda rng: [-0.005], phases=True, hogs=3,
                                 on_watch=lambda: seen.add(module_threshold(inst)))
        v = view["verify"]
        assert v["state"] == "kept" and v["in_force"] == "policy", side.text()[-4000:]
        assert v["gain"] > 0.2 and v["reason"] in ("better", "max_pairs")
        assert codes and all(c == 200 for c in codes), sorted(set(codes))
        assert module_threshold(inst) == pytest.approx(THRESHOLD * UNIT)
        assert {round(x, 6) for x in seen} == {round(THRESHOLD * UNIT, 6), 3600.0}, seen  # both arms in Apache
        metrics = side.request("GET", "/-/metrics")[2].decode()
        assert 'overtake_verification_state{state="kept"} 1.0' in metrics
        print(f"age priority beside long reports: {v['pairs']} pairs, gain {v['gain']:+.1%} CI {v['ci']}, "
              f"{v['reason']}; pairs' gains {pair_gains(side)}; {len(codes)} requests")
    finally:
        side.stop()


def module_threshold(inst: apache.ApacheInstance) -> float:
    """The age threshold mod_overtake_prio has in force (seconds of thread CPU)."""
    with urllib.request.urlopen(inst.base_url + "/overtake-prio-status", timeout=30) as r:
        text = r.read().decode()
    m = re.search(r'^overtake_cpu_prio_level_threshold_seconds\{level="1"\} (\S+)$', text, re.M)
    assert m, text
    return float(m.group(1))
