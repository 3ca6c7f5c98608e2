"""The control file end to end: a real private Apache with mod_overtake_prio's
``OvertakeControlFile``, the sidecar writing it, no config edit and no restart.

- An online refit on traffic whose demands the running policy knows nothing of (π(1), no
  thresholds: Apache runs its configured 0.5 s) chooses age thresholds for the fitted service
  times; the module's status shows them in force, equal to what the sidecar logged, while
  Apache's parent PID and its config generation (``/server-status``) stay the same.
- A control file truncated or overwritten with garbage while requests run: every request is
  answered, no child dies, the configured threshold is back in force at once, one error line per
  state for the whole server; a good table written afterwards is in force again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from support.control_apache import control_apache
from support.control_apache import get as _get
from support.control_apache import prio_counters as _status
from support.service_helpers import SidecarProc, StubApache, replay_h2_transactions

from overtake.controller.harness import apache
from overtake.controller.harness.apache.cpu_priority import CpuPriority
from overtake.controller.sidecar.control_file import ControlFile, encode

CONFIGURED = 0.5  # OvertakePrioLevels of the private Apache: the fallback
STAGES = """
stages:
  - name: stage1
    path: "^/stage1$"
  - name: stage2
    path: "^/stage2$"
limits: {max_inflight: 16, queue_cap: 1000, queue_timeout: 30}
classifier: {mode: explicit, time_unit: 0.005}
"""


@pytest.fixture(scope="module")
def controlled(apache_available: None) -> Iterator[tuple[apache.ApacheInstance, str]]:
    """A private Apache whose module reads a control file (it creates the file empty, and its key)."""
    with control_apache("control", pin=True, levels=(CONFIGURED,), nice=("idle",)) as served:
        yield served


def _config_generation(inst: apache.ApacheInstance) -> int:
    m = re.search(r"^ParentServerConfigGeneration: (\d+)$", _get(inst, "/server-status?auto")[1], re.M)
    assert m, "mod_status reports no config generation"
    return int(m.group(1))


def _apache_pid(inst: apache.ApacheInstance) -> int:
    return int((Path(inst.workdir) / "run" / "httpd.pid").read_text())


def _threshold(st: dict[str, float]) -> float:
    return st['overtake_cpu_prio_level_threshold_seconds{level="1"}']


@pytest.mark.apache_functional
def test_a_refit_puts_new_thresholds_in_force_without_a_restart(controlled: tuple[apache.ApacheInstance, str],
                                                               tmp_path: Path) -> None:
    inst, path = controlled
    pid, gen0 = _apache_pid(inst), _config_generation(inst)
    side = SidecarProc(tmp_path, ["--policy", "pi(1)", "--apache", inst.base_url, "--control-file", path,
                                  "--online", "--refit-interval", "2", "--min-samples", "100",
                                  "--arrival-window", "60", "--access-log", str(inst.access_log),
                                  "--status-interval", "0.5"], stages=STAGES)
    try:
        before = _status(inst)
        # pi(1) chose no thresholds: the file is read, the configured one stays in force
        assert before["overtake_cpu_prio_control_in_force"] == 0
        assert before["overtake_cpu_prio_control_generation"] >= 2
        assert _threshold(before) == pytest.approx(CONFIGURED)
        n = 150
        demands, _, codes = replay_h2_transactions(
            lambda path, headers: side.request("GET", path, headers=headers, timeout=60)[0], n)
        assert codes.count(200) == 2 * n
        deadline = time.monotonic() + 300  # fit, solve and the thresholds' choice, on a shared machine
        while time.monotonic() < deadline:
            info = json.loads(side.request("GET", "/-/policy")[2])
            if info["online"]["generation"] >= 1 or info["online"]["refits"]["failed"]:
                break
            time.sleep(1)
        assert info["online"]["generation"] == 1 and info["name"].startswith("online-"), side.text()[-3000:]
        written = [e["detail"] for e in side.events()
                   if e.get("event") == "control_file" and e["detail"]["thresholds_seconds"]]  # type: ignore[index]
        assert written, side.text()[-3000:]
        new = written[-1]
        chosen = new["thresholds_seconds"][0][0]  # type: ignore[index]
        after = _status(inst)
        assert after["overtake_cpu_prio_control_in_force"] == 1
        assert after["overtake_cpu_prio_control_generation"] == new["generation"] > before[
            "overtake_cpu_prio_control_generation"]
        assert _threshold(after) == pytest.approx(chosen, rel=1e-6)
        assert after['overtake_cpu_prio_control_stage_threshold_seconds{stage="1",level="1"}'] == pytest.approx(
            chosen, rel=1e-6)
        # chosen for the fitted times (the optimiser's range is 1e-3..1e3 mean service times), not the fallback
        mean_s = float(demands.mean())
        assert 1e-3 * mean_s < chosen < 1e3 * mean_s and chosen != pytest.approx(CONFIGURED)
        assert _apache_pid(inst) == pid and _config_generation(inst) == gen0  # no restart, no graceful
        # the sidecar passes the module's view on to Prometheus
        want = f"overtake_cpu_prio_control_generation {float(new['generation'])!r}"  # type: ignore[arg-type]
        deadline = time.monotonic() + 30
        while want not in side.request("GET", "/-/metrics")[2].decode():
            assert time.monotonic() < deadline, side.request("GET", "/-/metrics")[2].decode()[-3000:]
            time.sleep(0.5)
        print(f"refit: threshold {chosen:.6g} s (mean demand {mean_s:.4g} s), file generation "
              f"{before['overtake_cpu_prio_control_generation']:.0f} -> {new['generation']}")
    finally:
        side.stop()


def test_a_truncated_or_corrupt_file_falls_back_and_loses_nothing(controlled: tuple[apache.ApacheInstance, str]
                                                                  ) -> None:
    inst, path = controlled
    err_log = Path(inst.workdir) / "logs" / "error.log"
    crashes = err_log.read_text().count("exit signal")
    ctl = ControlFile(path)  # as the sidecar would (root: the key file Apache made)
    try:
        ctl.write(2, [[0.002], [0.002]])
        assert _threshold(_status(inst)) == pytest.approx(0.002)
        said = err_log.read_text().count("AH90201")
        codes: list[int] = []
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                try:
                    codes.append(_get(inst, "/stage1?work=0.003")[0])
                except OSError:
                    codes.append(-1)

        ths = [threading.Thread(target=load) for _ in range(4)]
        for th in ths:
            th.start()
        try:
            time.sleep(0.3)
            os.truncate(path, 0)
            time.sleep(0.5)
            truncated = _status(inst)
            size = 64 + 3 * 72
            junk = bytearray(os.urandom(size))
            junk[8] |= 1  # an odd "generation": garbage must not pass for a table being written
            with open(path, "r+b") as f:  # garbage of the right size
                f.write(junk)
            time.sleep(1.2)  # a child looks at a file it refused again once a second
            corrupt = _status(inst)
        finally:
            stop.set()
            for th in ths:
                th.join(60)
        assert codes and set(codes) == {200}, f"{len(codes)} requests, answers {sorted(set(codes))}"
        assert err_log.read_text().count("exit signal") == crashes, err_log.read_text()[-2000:]
        for st in (truncated, corrupt):
            assert st["overtake_cpu_prio_control_in_force"] == 0 and st["overtake_cpu_prio_control_generation"] == 0
            assert _threshold(st) == pytest.approx(CONFIGURED)
        assert corrupt["overtake_cpu_prio_control_refusals_total"] > 0
        log = err_log.read_text()
        lines = log.count("AH90201") - said
        assert lines == 2, log[-3000:]  # one per state (truncated, corrupt) for the whole server
        assert "shorter than a control file's head" in log and "no OVTCTRL1 head" in log
        ctl.write(2, [[0.003], [0.003]])
        back = _status(inst)
        assert back["overtake_cpu_prio_control_in_force"] == 1 and _threshold(back) == pytest.approx(0.003)
        assert back["overtake_cpu_prio_control_generation"] == ctl.generation
    finally:
        ctl.close()


def test_start_and_put_write_the_policys_thresholds_in_seconds(tmp_path: Path, stub: StubApache) -> None:
    """No Apache needed: the file a sidecar writes at start and on ``PUT /-/policy`` reads back
    (the module's layout, its key) as the policy's thresholds times the time unit; a policy
    without thresholds writes none; each write is a new generation."""
    pol = _age_policy(tmp_path / "age.npz")
    path = str(tmp_path / "control")
    side = SidecarProc(tmp_path, ["--policy", str(pol), "--apache", stub.url, "--control-file", path],
                       stages=STAGES)
    try:
        key = bytes.fromhex(Path(path + ".key").read_text().strip())
        assert Path(path).read_bytes() == encode(key, 2, 2, [[0.0075], [0.0075]])  # 1.5 units x 0.005 s
        assert side.request("PUT", "/-/policy", body=b"pi(1)")[0] == 200
        assert Path(path).read_bytes() == encode(key, 4, 2, None)
        assert side.request("PUT", "/-/policy", body=str(pol).encode())[0] == 200
        assert Path(path).read_bytes() == encode(key, 6, 2, [[0.0075], [0.0075]])
        said = [e["detail"] for e in side.events() if e.get("event") == "control_file"]
        assert [d["generation"] for d in said] == [2, 4, 6]  # type: ignore[index]
        assert not [e for e in side.events() if "OvertakePrioLevels 0" in e.get("msg", "")]  # nothing to copy
    finally:
        side.stop()


def test_the_private_apaches_directive_and_its_refusal() -> None:
    from overtake.api.commands.apache import _cpu_priority
    from overtake.controller.errors import ApacheInputError
    from overtake.controller.harness.apache.cpu_priority import config_tokens

    assert config_tokens(CpuPriority(control_file="/dev/shm/c"))["CPU_PRIO_CONTROL"] == 'OvertakeControlFile "/dev/shm/c"'
    assert config_tokens(CpuPriority())["CPU_PRIO_CONTROL"].startswith("#")
    with pytest.raises(ApacheInputError, match=r"^cpu_priority.control_file: 'c' must be an absolute path"):
        CpuPriority(control_file="c")
    ns = argparse.Namespace(cpu_priority_levels="0.005", cpu_priority_nice="idle", cpu_priority_class_only=False,
                            gate=None, control_file="/dev/shm/c")
    cp = _cpu_priority(ns)
    assert cp is not None and cp.control_file == "/dev/shm/c" and cp.levels == (0.005,)
    ns.cpu_priority_levels = ns.cpu_priority_nice = None  # the fallback must be given
    with pytest.raises(ValueError, match="^--control-file: give --cpu-priority-levels too"):
        _cpu_priority(ns)


KEYED = STAGES.replace('path: "^/stage1$"', 'routes: [{path: "^/stage1$", key: ["param:k"]}]')


def _age_policy(path: Path) -> Path:
    """A π* whose file carries age thresholds of 1.5 model units for both stages."""
    from overtake.mdp import Stage, TandemModel, Truncation
    from overtake.mdp import solve as solve_optimal

    p, m = np.array([0.91, 0.09]), np.array([0.55, 5.45])
    s1 = Stage("stage1", p, np.diag(-1.0 / m))
    opt = solve_optimal(TandemModel(arrival_rate=0.3, stages=(s1, Stage("stage2", s1.alpha, s1.T))),
                        truncation=Truncation(6, 3))
    opt.policy.meta.update(metrics=opt.metrics.to_dict(), time_unit="model", cpu_priority={"age": {
        "mean_response_time": 2.0, "passthrough": 2.2, "thresholds": [[1.5], [1.5]]}})
    opt.policy.save(path)
    return path


@pytest.mark.apache_functional
def test_auto_chooses_the_size_class_and_takes_age_off_through_the_file(
        controlled: tuple[apache.ApacheInstance, str], tmp_path: Path) -> None:
    """A stage keyed on a query parameter: ``--cpu-priority auto`` runs the size class, and the
    control file holds thresholds no request reaches (the module's level count, read from its
    status) instead of the policy's age thresholds, which ``--cpu-priority age`` puts in force."""
    inst, path = controlled
    pol = _age_policy(tmp_path / "age.npz")
    for asked, want in (("age", 0.0075), ("auto", 3600.0)):
        side = SidecarProc(tmp_path, ["--policy", str(pol), "--apache", inst.base_url, "--control-file", path,
                                              "--cpu-priority", asked, "--status-interval", "0.2"], stages=KEYED)
        try:
            info = json.loads(side.request("GET", "/-/policy")[2])
            assert info["cpu_priority_choice"]["requested"] == asked
            assert info["cpu_priority"] == ("class" if asked == "auto" else "age")
            deadline = time.monotonic() + 30
            while _threshold(st := _status(inst)) != pytest.approx(want, abs=2e-3):
                assert time.monotonic() < deadline, (asked, st, side.text()[-2000:])
                time.sleep(0.2)
            assert st["overtake_cpu_prio_control_in_force"] == 1
            if asked == "auto":
                said = [e for e in side.events() if e.get("event") == "cpu_priority_auto"]
                assert len(said) == 1 and "stage1" in said[0]["detail"], side.text()[-2000:]
        finally:
            side.stop()
