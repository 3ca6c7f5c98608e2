"""Module mode end to end: stages matched by Apache (``OvertakeStage`` in ``<LocationMatch>``), a
count table in the control file, requests held inside Apache (mpm_event), no proxy in front.

- A table that caps stage ``capped`` at one running request: its requests never overlap in the
  handler (the handler's own wall-clock span, ``?trace=1``), while ``free``'s requests, sent at
  the same time, do; every request is answered and the counts return to zero.
- A new table written to the control file (``free`` capped at one, ``capped`` free) takes effect
  without a restart: the status page shows its generation, Apache's parent PID and config
  generation are unchanged, and the overlaps follow the new table.
- A table that never starts ``capped`` while anything runs: a request of it waits at most
  ``OvertakeStageHold`` and then runs (counted); nothing is lost.
- ``overtake sidecar --enforce module``: nothing listens on its public port, its policy's table
  (and after a PUT, the new one's) is in force in Apache, the module's counters are on its
  /-/metrics; its online loop refits from Apache's access log and the refit's table reaches Apache.
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from support.control_apache import control_apache
from support.module_stages import (
    at_once,
    config_generation,
    max_overlap,
    prio_status,
    settled,
    stages_yaml,
    write_policy,
    write_table,
)
from support.service_helpers import SidecarProc, admin_token_file, replay_h2_transactions

from overtake.controller.harness import apache
from overtake.controller.harness.scratch import free_port, scratch_dir
from overtake.controller.sidecar.count_table import CountTable, from_policy
from overtake.controller.sidecar.policies import BaselinePolicy

#: OvertakeStageHold of the private Apache. A burst's last held request waits for the other
#: stage's six and its own five (0.1 s of CPU each, ~1.2 s of wall time alone on the core); the
#: functional tests' Apache shares its core with the suite's other work, and at 1.5 s a loaded run
#: let the last ones run past their turn (the bound is a liveness guard, not the policy).
HOLD = 4.0
NAMES = ("capped", "free")
URL = {"capped": "/stage1", "free": "/stage2"}


@pytest.fixture(scope="module")
def staged(apache_available: None) -> Iterator[tuple[apache.ApacheInstance, str]]:
    with control_apache("module-stages", levels=(0.5,), nice=("idle",), stage_hold=HOLD, mpm="event",
                        stages=(("capped", "^/stage1$"), ("free", "^/stage2$"))) as served:
        yield served


def _get(inst: apache.ApacheInstance, path: str) -> tuple[int, str, str | None]:
    with urllib.request.urlopen(inst.base_url + path, timeout=60) as r:
        return r.status, r.read().decode(), r.headers.get("X-Handler-Span-us")


def _burst(inst: apache.ApacheInstance, n: int, work: float) -> dict[str, list[tuple[int, int]]]:
    """n requests of each stage at once (the free stage's requests then run together); the handler
    spans per stage."""
    out = at_once([s for _ in range(n) for s in NAMES],
                  lambda stage: (stage, _get(inst, f"{URL[stage]}?work={work}&trace=1")))
    spans: dict[str, list[tuple[int, int]]] = {s: [] for s in NAMES}
    for stage, (status, _, span) in out:
        assert status == 200 and span is not None
        b, e = (int(v) for v in span.split())
        spans[stage].append((b, e))
    return spans


def _wait_generation(inst: apache.ApacheInstance, gen: int) -> dict[str, float]:
    deadline = time.monotonic() + 10
    while True:
        st = prio_status(inst)
        if st.get("overtake_stage_table_generation") == gen or time.monotonic() > deadline:
            return st


def _apache_pid(inst: apache.ApacheInstance) -> int:
    return int((Path(inst.workdir) / "run" / "httpd.pid").read_text())


def test_cap_of_one_serialises_its_stage_only_and_a_new_table_takes_effect_live(
        staged: tuple[apache.ApacheInstance, str]) -> None:
    inst, path = staged
    pid, conf_gen = _apache_pid(inst), config_generation(inst)
    table = from_policy(BaselinePolicy("pi(1,8)", 2), NAMES)
    assert table is not None
    gen = write_table(path, table)
    st = _wait_generation(inst, gen)
    assert st["overtake_stage_table_generation"] == gen
    assert st['overtake_stage_table_in_force{stage="capped"}'] == 1
    before = st
    spans = _burst(inst, 6, 0.1)
    assert max_overlap(spans["capped"]) == 1, spans["capped"]
    assert max_overlap(spans["free"]) > 1, spans["free"]  # the other stage is not held
    st = settled(inst, NAMES)
    for s in NAMES:
        assert st[f'overtake_stage_requests_total{{stage="{s}"}}'] - before[f'overtake_stage_requests_total{{stage="{s}"}}'] == 6
        assert st[f'overtake_stage_waiting{{stage="{s}"}}'] == 0
        assert st[f'overtake_stage_active{{stage="{s}"}}'] == 0
    assert st['overtake_stage_held_total{stage="capped"}'] > before['overtake_stage_held_total{stage="capped"}']
    assert st['overtake_stage_hold_timeouts_total{stage="capped"}'] == before[
        'overtake_stage_hold_timeouts_total{stage="capped"}']

    # the other way round, through the file only
    gen2 = write_policy(path, "pi(8,1)", NAMES)
    st = _wait_generation(inst, gen2)
    assert st["overtake_stage_table_generation"] == gen2 != gen
    spans = _burst(inst, 6, 0.1)
    assert max_overlap(spans["free"]) == 1, spans["free"]
    assert max_overlap(spans["capped"]) > 1, spans["capped"]
    assert _apache_pid(inst) == pid
    assert config_generation(inst) == conf_gen


def test_requests_that_never_wait_cost_no_wake_up(staged: tuple[apache.ApacheInstance, str]) -> None:
    """A table that holds nothing at the offered load (π(8,8), one request at a time): each request
    finds nothing waiting, so it is counted by the lock-free path (no ticket, no decision under the
    lock) and costs no futex wake-up (a system call per request). Under π(1,8) a burst's held
    requests are woken."""
    inst, path = staged
    _wait_generation(inst, write_policy(path, "pi(8,8)", NAMES))
    before = settled(inst, NAMES)
    for _ in range(20):
        for s in NAMES:
            assert _get(inst, f"{URL[s]}?work=0")[0] == 200
    after = settled(inst, NAMES)
    for s in NAMES:
        assert after[f'overtake_stage_requests_total{{stage="{s}"}}'] - before[
            f'overtake_stage_requests_total{{stage="{s}"}}'] == 20
        assert after[f'overtake_stage_held_total{{stage="{s}"}}'] == before[f'overtake_stage_held_total{{stage="{s}"}}']
    assert after["overtake_stage_decisions_total"] == before["overtake_stage_decisions_total"]
    assert after["overtake_stage_wakeups_total"] == before["overtake_stage_wakeups_total"]

    _wait_generation(inst, write_policy(path, "pi(1,8)", NAMES))
    before = settled(inst, NAMES)
    _burst(inst, 6, 0.05)
    after = settled(inst, NAMES)
    held = after['overtake_stage_held_total{stage="capped"}'] - before['overtake_stage_held_total{stage="capped"}']
    assert held > 0
    assert after["overtake_stage_wakeups_total"] - before["overtake_stage_wakeups_total"] >= 1


def test_a_request_held_past_its_bound_runs(staged: tuple[apache.ApacheInstance, str]) -> None:
    inst, path = staged
    # capped never starts while anything runs (the guard starts it only when nothing does)
    wcap, kcap = (4, 4), (4, 4)
    obs = CountTable(NAMES, wcap, kcap, np.zeros((625, 2), dtype=np.uint8)).observations()
    acts = np.zeros((len(obs), 2), dtype=np.uint8)
    acts[:, 1] = obs[:, 1]  # free: start every waiting one
    gen = write_table(path, CountTable(NAMES, wcap, kcap, acts))
    before = _wait_generation(inst, gen)
    with ThreadPoolExecutor(2) as ex:
        long = ex.submit(_get, inst, f"/stage2?work={HOLD + 2.5}")  # still running at the bound
        time.sleep(0.3)
        t0 = time.monotonic()
        held = ex.submit(_get, inst, "/stage1?work=0&trace=1")
        status, _, _ = held.result(timeout=60)
        waited = time.monotonic() - t0
        assert long.result(timeout=120)[0] == 200
    assert status == 200
    assert waited >= HOLD * 0.9
    st = settled(inst, NAMES)
    assert st['overtake_stage_hold_timeouts_total{stage="capped"}'] - before[
        'overtake_stage_hold_timeouts_total{stage="capped"}'] == 1
    assert st['overtake_stage_active{stage="capped"}'] == 0 and st['overtake_stage_waiting{stage="capped"}'] == 0


MODULE_STAGES = stages_yaml("^/stage1$", "^/stage2$")


@pytest.mark.apache_functional
def test_sidecar_in_module_mode_writes_the_table_and_passes_no_traffic(
        staged: tuple[apache.ApacheInstance, str], tmp_path: Path) -> None:
    """``overtake sidecar --enforce module``: nothing listens on its public port; the policy's count
    table is in force in Apache (the generation it logged); a PUT of another blind policy reaches
    Apache through the file; the module's stage counters appear on the sidecar's /-/metrics."""
    inst, path = staged
    admin = free_port()
    side = SidecarProc(tmp_path, ["--policy", "pi(1,8)", "--apache", inst.base_url, "--control-file", path,
                                  "--enforce", "module", "--status-interval", "0.5", "--admin-listen",
                                  f"127.0.0.1:{admin}"], stages=MODULE_STAGES, ready_port=admin)
    try:
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", side.port), timeout=2).close()
        written = [e["detail"] for e in side.events() if e.get("event") == "control_file"]
        assert written, side.text()[-3000:]
        gen = written[-1]["generation"]  # type: ignore[index]
        assert _wait_generation(inst, gen)["overtake_stage_table_generation"] == gen
        spans = _burst(inst, 6, 0.1)
        assert max_overlap(spans["capped"]) == 1, spans["capped"]
        assert side.request("PUT", "/-/policy", body=b"pi(8,1)")[0] == 200
        gen2 = [e["detail"] for e in side.events() if e.get("event") == "control_file"][-1]["generation"]  # type: ignore[index]
        assert gen2 != gen and _wait_generation(inst, gen2)["overtake_stage_table_generation"] == gen2
        spans = _burst(inst, 6, 0.1)
        assert max_overlap(spans["free"]) == 1, spans["free"]
        # pi(inf) holds nothing: a file without a stage section, no table in force
        assert side.request("PUT", "/-/policy", body=b"passthrough")[0] == 200
        assert _wait_generation(inst, 0)["overtake_stage_table_generation"] == 0
        deadline = time.monotonic() + 30
        while 'overtake_stage_requests_total{stage="capped"}' not in side.request("GET", "/-/metrics")[2].decode():
            assert time.monotonic() < deadline, side.request("GET", "/-/metrics")[2].decode()[-3000:]
            time.sleep(0.5)
    finally:
        side.stop()


@pytest.mark.apache_functional
def test_a_module_mode_config_as_the_guide_writes_it_needs_no_listen(
        staged: tuple[apache.ApacheInstance, str], tmp_path: Path) -> None:
    """The deployment guide's module-mode ``sidecar.yaml`` has no ``listen`` (nothing listens): the
    sidecar starts from it and its count table comes into force in Apache."""
    inst, path = staged
    admin = free_port()
    (tmp_path / "stages.yaml").write_text(MODULE_STAGES)
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(f"enforce: module\napache: {inst.base_url}\nstages: stages.yaml\npolicy: pi(1,8)\n"
                   f"control_file: {path}\nadmin_listen: 127.0.0.1:{admin}\n"
                   f"admin_token_file: {admin_token_file(tmp_path)}\nstatus_interval: 0.5\nloop: asyncio\n")
    side = SidecarProc(tmp_path, [], argv=[sys.executable, "-m", "overtake.api.cli", "sidecar", "--config", str(cfg)],
                       admin_port=admin, ready_port=admin)
    try:
        written = [e["detail"] for e in side.events() if e.get("event") == "control_file"]
        assert written, side.text()[-3000:]
        gen = written[-1]["generation"]  # type: ignore[index]
        assert _wait_generation(inst, gen)["overtake_stage_table_generation"] == gen
        start = next(e for e in side.events() if e.get("event") == "start")
        assert start["listen"] is None and "needs enforce: module" in start["detail"], start
    finally:
        side.stop()


def _online_sidecar(inst: apache.ApacheInstance, path: str, tmp_path: Path, *, arrival_window: int) -> SidecarProc:
    """A module-mode sidecar running pi(1,8) whose online loop refits every 2 s from Apache's access log."""
    admin = free_port()
    return SidecarProc(tmp_path, ["--policy", "pi(1,8)", "--apache", inst.base_url, "--control-file", path,
                                  "--enforce", "module", "--online", "--refit-interval", "2", "--min-samples", "100",
                                  "--arrival-window", str(arrival_window), "--access-log", str(inst.access_log),
                                  "--status-interval", "0.5", "--admin-listen", f"127.0.0.1:{admin}"],
                       stages=MODULE_STAGES, ready_port=admin)


@pytest.mark.apache_functional
@pytest.mark.timeout(900)
def test_a_refit_in_module_mode_reaches_apache_through_the_file(
        staged: tuple[apache.ApacheInstance, str], tmp_path: Path) -> None:
    """The online loop of a module-mode sidecar learns demands and arrivals from Apache's access
    log (no request passes it), re-solves a blind policy and writes its count table; Apache's
    module enforces that generation, with no restart."""
    inst, path = staged
    pid, conf_gen = _apache_pid(inst), config_generation(inst)
    side = _online_sidecar(inst, path, tmp_path, arrival_window=60)
    try:
        n = 150
        _, _, codes = replay_h2_transactions(lambda p, headers: _get(inst, p)[0], n)
        assert codes.count(200) == 2 * n
        deadline = time.monotonic() + 300  # fit, solve, on a shared machine
        while time.monotonic() < deadline:
            info = json.loads(side.request("GET", "/-/policy")[2])
            if info["online"]["generation"] >= 1 or info["online"]["refits"]["failed"]:
                break
            time.sleep(1)
        refits = [e.get("refit") for e in side.events() if e.get("event") == "online_refit"]
        assert info["online"]["generation"] == 1 and info["name"].startswith("online-"), (info["online"], refits[-2:])
        written = [e for e in side.events() if e.get("event") == "control_file"]
        assert written[-1]["policy"] == info["name"], side.text()[-3000:]
        gen = written[-1]["detail"]["generation"]  # type: ignore[index]
        st = _wait_generation(inst, gen)
        assert st["overtake_stage_table_generation"] == gen
        assert st['overtake_stage_table_in_force{stage="capped"}'] == 1
        assert _apache_pid(inst) == pid and config_generation(inst) == conf_gen
    finally:
        side.stop()


def _threshold(inst: apache.ApacheInstance) -> tuple[float, float, float]:
    """The module's age threshold in force, whether it is the control file's, and that file's generation."""
    st = prio_status(inst)
    return (st['overtake_cpu_prio_level_threshold_seconds{level="1"}'], st["overtake_cpu_prio_control_in_force"],
            st["overtake_cpu_prio_control_generation"])


def _written(side: SidecarProc) -> list[dict[str, object]]:
    return [e["detail"] for e in side.events()  # type: ignore[misc]
            if e.get("event") == "control_file" and e["detail"]["thresholds_seconds"]]  # type: ignore[index]


def _until_written(side: SidecarProc, after: int, what: str) -> dict[str, object]:
    """The first control file written with thresholds after the ``after`` earlier ones (a refit's)."""
    deadline = time.monotonic() + 300  # fit, solve and the thresholds' choice, on a shared machine
    while time.monotonic() < deadline:
        got = _written(side)
        if len(got) > after:
            return got[after]
        time.sleep(1)
    raise AssertionError(f"{what}: no refit wrote thresholds: " + side.text()[-3000:])


def _refits(side: SidecarProc) -> list[dict[str, object]]:
    """The refits that ran to a decision (not those skipped before a fit)."""
    return [e for e in side.events() if e.get("event") == "online_refit"
            and e.get("outcome") in ("swapped", "kept", "failed", "skipped_superseded")]


def _until_refits(side: SidecarProc, n: int) -> None:
    deadline = time.monotonic() + 600  # two fits and solves, on a shared machine
    while len(_refits(side)) < n:
        assert time.monotonic() < deadline, side.text()[-3000:]
        time.sleep(1)


def _in_force_as_written(inst: apache.ApacheInstance, side: SidecarProc, seen: int) -> float:
    """The module's threshold, once the sidecar has logged a write after the ``seen`` earlier ones:
    the control file's (in force), of a generation and value the sidecar wrote since (a later
    refit may have written again meanwhile, not an earlier one)."""
    thr, in_force, gen = _threshold(inst)
    since = {int(w["generation"]): w["thresholds_seconds"][0][0]  # type: ignore[index,call-overload]
             for w in _written(side)[seen:]}
    assert in_force == 1 and int(gen) in since, (thr, in_force, gen, since)
    assert thr == pytest.approx(since[int(gen)], rel=1e-6)
    return thr


@pytest.mark.timeout(1200)
def test_a_changed_demand_distribution_reaches_the_modules_thresholds(
        staged: tuple[apache.ApacheInstance, str], tmp_path: Path) -> None:
    """Module mode, online: traffic of one demand distribution, then of the same shape ten times
    longer (the same load). Each refit's age thresholds are in the module's status as soon as the
    sidecar has written them (before its next refit: within one refit interval), those fitted to
    the longer demands are longer, and Apache was neither restarted nor reconfigured."""
    inst, path = staged
    pid, conf_gen = _apache_pid(inst), config_generation(inst)
    side = _online_sidecar(inst, path, tmp_path, arrival_window=30)
    try:
        seen = len(_written(side))
        _, _, codes = replay_h2_transactions(lambda p, headers: _get(inst, p)[0], 150, unit=0.004)
        assert codes.count(200) == 300
        _until_written(side, seen, "short demands")
        thr1 = _in_force_as_written(inst, side, seen)
        # the same shape, ten times longer: two thirds of the reservoir (2000 per stage) are then the new demands
        _, _, codes = replay_h2_transactions(lambda p, headers: _get(inst, p)[0], 300, seed=12, unit=0.04)
        assert codes.count(200) == 600
        # a refit running now fitted the old demands too: wait for the one after it, with the longer
        # demands still arriving (a refit needs arrivals in its window)
        stop = threading.Event()

        def trickle() -> None:
            seed = 100
            while not stop.is_set():
                replay_h2_transactions(lambda p, headers: _get(inst, p)[0], 20, seed=seed, unit=0.04)
                seed += 1

        more = threading.Thread(target=trickle)
        more.start()
        try:
            _until_refits(side, len(_refits(side)) + 2)
        finally:
            stop.set()
            more.join(120)
        thr2 = _in_force_as_written(inst, side, 0)
        assert thr2 > 2 * thr1, (thr1, thr2, [r.get("refit") for r in _refits(side)][-2:])
        assert _apache_pid(inst) == pid and config_generation(inst) == conf_gen  # no restart, no graceful
    finally:
        side.stop()


@pytest.fixture(params=["event", "prefork"])
def app(apache_available: None, request: pytest.FixtureRequest) -> Iterator[tuple[apache.ApacheInstance, str]]:
    """Module mode over an application whose handler notes no CPU (as a PHP page under mod_php, or
    any real application): the stage handler's own script without its note, at /app1 and /app2,
    with the module's request-time split on; mpm_event, and mpm_prefork (mod_php's)."""
    work = scratch_dir("overtake-module-app-")  # www-data's workers read the script
    try:
        script = work / "app.lua"
        text = (Path(__file__).resolve().parents[2] / "apache-conf" / "lua" / "stage.lua").read_text()
        note = '    r.notes["stage_cpu_us"] = tostring(cpu_us)\n'
        assert note in text
        script.write_text(text.replace(note, ""))
        with control_apache("module-app", levels=(0.5,), nice=("idle",), stage_hold=HOLD, mpm=request.param,
                            request_times=True, stages=(("capped", "^/app1$"), ("free", "^/app2$")),
                            extra_conf=f'LuaMapHandler "^/app[0-9]+$" "{script}" handle') as served:
            yield served
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.timeout(900)
def test_a_real_applications_demands_reach_the_refit_from_the_modules_cpu_note(
        app: tuple[apache.ApacheInstance, str], tmp_path: Path) -> None:
    """With no stage handler's note in the log, a module-mode sidecar takes each answered
    request's demand from the module's CPU note once the module has seen the stage's work run in
    Apache (``/-/policy``'s ``stacks``): every request of the replay is a demand sample, their mean
    is the CPU the requests asked for, and the refit solves and swaps in a policy from them."""
    inst, path = app
    admin = free_port()
    side = SidecarProc(tmp_path, ["--policy", "pi(1,8)", "--apache", inst.base_url, "--control-file", path,
                                  "--enforce", "module", "--online", "--refit-interval", "2", "--min-samples", "100",
                                  "--arrival-window", "60", "--access-log", str(inst.access_log),
                                  "--status-interval", "0.5", "--admin-listen", f"127.0.0.1:{admin}"],
                      stages=stages_yaml("^/app1$", "^/app2$"), ready_port=admin)
    try:
        for url in ("/app1", "/app2"):
            assert _get(inst, f"{url}?work=0.001")[0] == 200
        deadline = time.monotonic() + 30
        while json.loads(side.request("GET", "/-/policy")[2]).get("stacks", {}).get("free", {}).get("runs_in") is None:
            assert time.monotonic() < deadline, side.text()[-3000:]
            time.sleep(0.2)
        time.sleep(1.5)  # the log tail has read the two lines above
        before = _observed(side)
        demands, _, codes = replay_h2_transactions(lambda p, headers: _get(inst, p.replace("/stage", "/app"))[0], 150)
        assert codes.count(200) == 300
        line = next(ln for ln in inst.access_log.read_text().splitlines() if "GET /app1?" in ln)
        assert " cpu_us=- " in line and " ocpu_us=" in line and " ocpu_us=- " not in line, line
        deadline = time.monotonic() + 300  # fit, solve, on a shared machine
        while True:
            info = json.loads(side.request("GET", "/-/policy")[2])
            if info["online"]["generation"] >= 1 or info["online"]["refits"]["failed"]:
                break
            assert time.monotonic() < deadline, side.text()[-3000:]
            time.sleep(1)
        assert info["online"]["generation"] == 1, info["online"]
        after = _observed(side)
        for i, stage in enumerate(NAMES):
            assert after[stage][0] - before[stage][0] >= 150, (before, after)  # every answered request
            # the module's note is the handler's CPU and Apache's own work on the request (tens of µs)
            assert after[stage][1] == pytest.approx(float(demands[:, i].mean()), rel=0.1), (stage, after)
    finally:
        side.stop()


def _observed(side: SidecarProc) -> dict[str, tuple[float, float]]:
    """Per stage: the access log's demand samples recorded so far, and the held ones' mean (s)."""
    from prometheus_client.parser import text_string_to_metric_families

    got: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(side.request("GET", "/-/metrics")[2].decode()):
        for smp in fam.samples:
            if smp.labels.get("source") == "access_log":
                got[(smp.name, smp.labels["stage"])] = smp.value
    return {stage: (got.get(("overtake_online_demand_observations_total", stage), 0.0),
                    got.get(("overtake_online_demand_mean_seconds", stage), float("nan"))) for stage in NAMES}
