"""The sidecar's time unit comes from the policy (controller.sidecar.units), and what a user reads is seconds.

Known answers: with the shipped example config (apache-conf/examples/sidecar.yaml and
examples/sidecar/stages.yaml) and a policy solved from a fresh ``overtake fit``, the sidecar's
predicted E[W] (``overtake_policy_predicted_response_time_seconds``) and the ``OvertakePrioLevels``
it recommends equal what ``overtake solve`` printed: the fit is in seconds, so both are the
model's numbers unchanged. A stages file whose ``classifier.time_unit`` contradicts the policy is
refused with one line; a policy that records no unit runs at the stages file's value.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.service_helpers import REPO, SidecarProc, StubApache, free_port

from overtake.controller.errors import PolicyLoadError
from overtake.controller.sidecar.units import FORMER_DEFAULT, MODEL, UNITLESS, UNRECORDED, resolve

STAGES_2 = """
stages: [{name: stage1, path: "^/slow/"}, {name: stage2, path: "^/stage2"}]
limits: {max_inflight: 8, queue_cap: 200, queue_timeout: 30}
"""


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "overtake.api.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, check=False)


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not in /-/metrics"
    return float(m.group(1))


def policy_file(path: Path, time_unit: object = None) -> Path:
    """A small pi* for two H2 stages (stage1, stage2) in the paper's unit, with ``time_unit`` in
    its metadata (None: a file from before units were recorded)."""
    from overtake.mdp import Stage, TandemModel, Truncation
    from overtake.mdp import solve as solve_optimal

    p, m = np.array([0.91, 0.09]), np.array([0.55, 5.45])
    s1 = Stage("stage1", p, np.diag(-1.0 / m))
    opt = solve_optimal(TandemModel(arrival_rate=0.3, stages=(s1, Stage("stage2", s1.alpha, s1.T))),
                        truncation=Truncation(6, 3))
    opt.policy.meta["metrics"] = opt.metrics.to_dict()
    if time_unit is not None:
        opt.policy.meta["time_unit"] = time_unit
    opt.policy.save(path)
    return path


# ---- the rule ------------------------------------------------------------------------------------
def test_resolve_takes_the_policys_unit_and_refuses_a_contradiction() -> None:
    assert resolve([("p.npz", 1.0)], None).seconds == 1.0
    assert resolve([("p.npz", 1.0)], 1.0).seconds == 1.0
    with pytest.raises(PolicyLoadError, match=r"^classifier.time_unit: the stages file says 0.01 s per model unit but "
                                              r"policy p.npz was solved in units of 1 s .*remove classifier.time_unit "
                                              r"from the stages file"):
        resolve([("p.npz", 1.0)], 0.01)
    assert resolve([("case04.npz", MODEL)], 0.01).seconds == 0.01
    with pytest.raises(PolicyLoadError, match=r"abstract unit \(time_unit: model\); set classifier.time_unit"):
        resolve([("case04.npz", MODEL)], None)
    old = resolve([("old.npz", UNRECORDED)], None)
    assert old.seconds == FORMER_DEFAULT and old.unrecorded == ("old.npz",)
    assert resolve([("old.npz", UNRECORDED)], 0.005).seconds == 0.005
    assert resolve([("pi(1)", UNITLESS)], None).seconds is None  # a baseline keeps the unit in force
    assert resolve([("pi(1)", UNITLESS)], 0.02).seconds == 0.02
    with pytest.raises(PolicyLoadError, match=r"^policy: a.npz is in units of 1 s but b.npz in units of 0.001 s"):
        resolve([("a.npz", 1.0), ("b.npz", 0.001)], None)


# ---- the shipped example config with a fresh fit -------------------------------------------------
@pytest.mark.timeout(900)  # a fit and a solve through the CLI (600 s each at most)
def test_shipped_config_with_a_fresh_fit_reads_as_solve(tmp_path: Path, stub: StubApache) -> None:
    """The operator's guide: fit, solve with age priority, install the example config, start."""
    fits = tmp_path / "fits"
    for stage in ("stage1", "stage2"):
        r = _cli("fit", str(REPO / "examples" / "demo" / f"{stage}.txt"), "--order", "2", "--out", str(fits))
        assert r.returncode == 0, r.stderr
    scen = tmp_path / "scenario.yaml"
    scen.write_text("load: 0.6\nstages:\n  - {name: stage1, service: {file: fits/stage1.json}}\n"
                    "  - {name: stage2, service: {file: fits/stage2.json}}\n")
    etc = tmp_path / "etc"
    etc.mkdir()
    r = _cli("solve", str(scen), "--out", str(etc / "policy.npz"), "--cpu-priority", "age", "--quiet")
    assert r.returncode == 0, r.stderr
    solved = json.loads(r.stdout)
    threshold, ew = solved["cpu_priority"]["age"]["thresholds"][0][0], solved["mean_response_time"]
    shutil.copy(REPO / "apache-conf" / "examples" / "sidecar.yaml", etc / "sidecar.yaml")
    shutil.copy(REPO / "examples" / "sidecar" / "stages.yaml", etc / "stages.yaml")
    port, admin = free_port(), free_port()
    s = SidecarProc(tmp_path, [], argv=[
        sys.executable, "-m", "overtake.api.cli", "sidecar", "--config", str(etc / "sidecar.yaml"),
        "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}", "--apache", stub.url,
        "--request-log", str(tmp_path / "access.log"), "--cpu-priority", "age"], ready_port=admin)
    try:
        metrics = s.request("GET", "/-/metrics", port=admin)[2].decode()
        predicted = _metric(metrics, "overtake_policy_predicted_response_time_seconds")
        line = next(e for e in s.events() if e.get("event") == "cpu_priority_threshold")
        levels = float(re.search(r"OvertakePrioLevels (\S+)", line["msg"]).group(1))  # type: ignore[union-attr]
        info = json.loads(s.request("GET", "/-/policy", port=admin)[2])
    finally:
        assert s.stop() == 0
    assert predicted == pytest.approx(ew, rel=0.01)
    assert levels == pytest.approx(threshold, rel=0.01)
    assert solved["time_unit"] == 1.0 and info["time_unit"] == 1.0
    assert info["predicted_response_time_seconds"] == pytest.approx(ew, rel=1e-9)
    print(f"solve: E[W] {ew:.6g} s, threshold {threshold:.6g} s; sidecar: {predicted:.6g} s, "
          f"OvertakePrioLevels {levels:.6g}")


# ---- refusals and old files ----------------------------------------------------------------------
def test_a_stages_file_contradicting_the_policy_is_refused_in_one_line(tmp_path: Path, stub: StubApache) -> None:
    pol = policy_file(tmp_path / "seconds.npz", time_unit=1.0)
    stages = tmp_path / "stages.yaml"
    stages.write_text(STAGES_2 + "classifier: {time_unit: 0.01}\n")
    r = _cli("sidecar", "--policy", str(pol), "--apache", stub.url, "--listen", f"127.0.0.1:{free_port()}",
             "--stages", str(stages), "--loop", "asyncio", timeout=120)  # refused at start, not served
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert "the stages file says 0.01 s per model unit but policy seconds.npz was solved in units of 1 s" in lines[0]
    assert "remove classifier.time_unit from the stages file" in lines[0]


def test_policy_units_and_old_files(tmp_path: Path, stub: StubApache) -> None:
    """A model-unit policy runs at the stages file's unit; an old file too, with one warning; a
    swap to a policy of another unit changes the unit in force, one that contradicts it is refused."""
    model = policy_file(tmp_path / "model.npz", time_unit=MODEL)
    old = policy_file(tmp_path / "old.npz")
    s = SidecarProc(tmp_path, ["--policy", str(old), "--apache", stub.url],
                    stages=STAGES_2 + "classifier: {time_unit: 0.005}\n")
    try:
        w = json.loads(s.request("GET", "/-/policy")[2])["predicted_response_time_model_units"]
        assert json.loads(s.request("GET", "/-/policy")[2])["time_unit"] == 0.005
        assert _metric(s.request("GET", "/-/metrics")[2].decode(),
                       "overtake_policy_predicted_response_time_seconds") == pytest.approx(w * 0.005)
        for _ in range(2):  # the same old file again: no second warning
            assert s.request("PUT", "/-/policy", body=str(old).encode())[0] == 200
        warned = [e for e in s.events() if e.get("event") == "time_unit_unrecorded"]
        assert len(warned) == 1 and "old.npz records no time unit" in warned[0]["msg"]
        assert s.request("PUT", "/-/policy", body=str(model).encode())[0] == 200
        secs = policy_file(tmp_path / "secs.npz", time_unit=1.0)
        code, _, body = s.request("PUT", "/-/policy", body=str(secs).encode())
        assert code == 422 and b"the stages file says 0.005 s per model unit but policy secs.npz" in body
        assert json.loads(s.request("GET", "/-/policy")[2])["name"] == "model.npz"  # the old one kept
    finally:
        assert s.stop() == 0
    s = SidecarProc(tmp_path, ["--policy", "pi(1)", "--apache", stub.url], stages=STAGES_2)
    try:
        assert json.loads(s.request("GET", "/-/policy")[2])["time_unit"] == 1.0  # a baseline: seconds
        assert s.request("PUT", "/-/policy", body=str(policy_file(tmp_path / "ms.npz", time_unit=0.001)).encode())[0] == 200
        info = json.loads(s.request("GET", "/-/policy")[2])
        assert info["time_unit"] == 0.001  # the policy's unit, now in force
        assert info["predicted_response_time_seconds"] == pytest.approx(info["predicted_response_time_model_units"] * 0.001)
        code, _, body = s.request("PUT", "/-/policy", body=str(model).encode())
        assert code == 422 and b"abstract unit (time_unit: model); set classifier.time_unit" in body
    finally:
        assert s.stop() == 0


# ---- a unit change keeps what was measured -------------------------------------------------------
def test_a_unit_change_rescales_learned_demands_and_online_samples(tmp_path: Path) -> None:
    """Conservation: the seconds measured before a unit change are the seconds held after it."""
    from overtake.controller.online import OnlineSettings
    from overtake.controller.online.estimators import DemandRecorder
    from overtake.controller.sidecar.classifier import Classifier
    from overtake.controller.sidecar.policies import load_policy
    from overtake.controller.sidecar.stages import ClassifierSettings, StagesConfig, StageTable

    pol = load_policy(str(policy_file(tmp_path / "p.npz", time_unit=MODEL)), ("stage1", "stage2"))
    moved = Classifier(ClassifierSettings(mode="learned", time_unit=0.01, history=8), pol)
    fresh = Classifier(ClassifierSettings(mode="learned", time_unit=0.001, history=8), pol)
    for c in (moved, fresh):
        for _ in range(4):
            c.observe(0, "r", 0.004)  # 0.4 units at 10 ms: short; 4 units at 1 ms: long
    assert moved.start_phase(0, "r", None, None) == 0 and fresh.start_phase(0, "r", None, None) == 1
    moved.set_time_unit(0.001)
    assert moved.start_phase(0, "r", None, None) == 1  # as if it had always run at 1 ms
    assert list(moved._routes["r"].samples) == pytest.approx(list(fresh._routes["r"].samples))

    table = StageTable(StagesConfig.model_validate({"stages": [{"name": "stage1", "path": "^/a"},
                                                               {"name": "stage2", "path": "^/b"}]}))
    rec = DemandRecorder(OnlineSettings(), table, time_unit=0.01, cores=1, overhead=0.0, clock=lambda: 0.0)
    for s in (0.01, 0.03):
        rec.add_demand(0, s, "attained")
    rec.set_time_unit(0.005)
    assert np.mean(rec.choose(0)[1]) * 0.005 == pytest.approx(0.02)  # 20 ms either way
    assert rec.stages[0].reservoirs["attained"].maxlen == OnlineSettings().reservoir
