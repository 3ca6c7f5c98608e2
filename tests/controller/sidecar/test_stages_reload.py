"""SIGHUP re-reads the stages file: what can change live is applied, the rest named (reload_partial).

Known answers: a policy in model units runs at the stages file's ``classifier.time_unit``, so
doubling it doubles ``overtake_policy_predicted_response_time_seconds``; ``limits.max_inflight``
is ``overtake_inflight_limit``. ``classifier.mode`` and the routes shape the queues: changing
them is logged as needing a restart and the running ones stay. A stages file that contradicts
the running policy's unit, or does not parse, is refused whole.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
from support.service_helpers import SidecarProc, StubApache
from test_time_unit import STAGES_2, policy_file

from overtake.controller.sidecar.stages import StagesConfig
from overtake.controller.sidecar.stages_reload import live_merge


def _metric(s: SidecarProc, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", s.request("GET", "/-/metrics")[2].decode(), re.M)
    assert m, name
    return float(m.group(1))


def _hup_until(s: SidecarProc, event: str, count: int) -> list[dict[str, object]]:
    s.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while True:
        seen = [e for e in s.events() if e.get("event") == event]
        if len(seen) >= count:
            return seen
        assert time.monotonic() < deadline, s.text()
        time.sleep(0.05)


def test_sighup_applies_the_stages_file_live_and_names_the_rest(tmp_path: Path, stub: StubApache) -> None:
    pol = policy_file(tmp_path / "model.npz", time_unit="model")
    s = SidecarProc(tmp_path, ["--policy", str(pol), "--apache", stub.url],
                    stages=STAGES_2 + "classifier: {mode: explicit, time_unit: 0.01}\n")
    stages = next(tmp_path.glob(f"stages-{s.port}.yaml"))
    try:
        w1 = _metric(s, "overtake_policy_predicted_response_time_seconds")
        assert _metric(s, "overtake_inflight_limit") == 8
        stages.write_text(STAGES_2.replace("max_inflight: 8", "max_inflight: 4")
                          + "classifier: {mode: hidden, time_unit: 0.02}\n")
        partial = _hup_until(s, "reload_partial", 1)
        assert "classifier.mode" in str(partial[0]["detail"]) and "time_unit" not in str(partial[0]["detail"])
        assert _metric(s, "overtake_policy_predicted_response_time_seconds") == pytest.approx(2 * w1)
        assert _metric(s, "overtake_inflight_limit") == 4
        info = json.loads(s.request("GET", "/-/policy")[2])
        assert info["time_unit"] == 0.02 and info["classifier"] == "explicit"  # the mode needs a restart
        applied = [e for e in s.events() if e.get("event") == "reload" and "max_inflight" in str(e.get("detail"))]
        assert applied and "classifier.time_unit: 0.01 -> 0.02" in str(applied[0]["detail"])
        # a file that does not parse is refused whole; the running stages stay
        stages.write_text("stages: [{name: stage1}]\n")
        refused = _hup_until(s, "reload_refused", 1)
        assert "stages[0]" in str(refused[0]["detail"])
        assert _metric(s, "overtake_inflight_limit") == 4 and s.request("GET", "/stage2")[0] == 200
    finally:
        assert s.stop() == 0


def test_a_reload_contradicting_the_policys_unit_is_refused(tmp_path: Path, stub: StubApache) -> None:
    pol = policy_file(tmp_path / "secs.npz", time_unit=1.0)
    s = SidecarProc(tmp_path, ["--policy", str(pol), "--apache", stub.url], stages=STAGES_2)
    stages = next(tmp_path.glob(f"stages-{s.port}.yaml"))
    try:
        stages.write_text(STAGES_2.replace("max_inflight: 8", "max_inflight: 5") + "classifier: {time_unit: 0.01}\n")
        refused = _hup_until(s, "reload_refused", 1)
        assert "the stages file says 0.01 s per model unit but policy secs.npz" in str(refused[0]["detail"])
        assert json.loads(s.request("GET", "/-/policy")[2])["time_unit"] == 1.0
        assert _metric(s, "overtake_inflight_limit") == 8  # refused whole
    finally:
        assert s.stop() == 0


def test_live_merge_keeps_what_needs_a_restart() -> None:
    old = StagesConfig.model_validate({"stages": [{"name": "a", "path": "^/a"}, {"name": "b", "path": "^/b"}],
                                       "limits": {"max_inflight": 8}})
    new = StagesConfig.model_validate({"stages": [{"name": "a", "path": "^/a", "queue_cap": 3},
                                                  {"name": "b", "path": "^/bb"}],
                                       "limits": {"max_inflight": 4}, "classifier": {"header": "X-Phase"}})
    merged, applied, restart = live_merge(old, new)
    assert merged.stages == old.stages and merged.classifier.header == "X-Overtake-Phase"
    assert merged.limits.max_inflight == 4
    assert restart == ["stages (names, order, routes, methods, next, cpu_exempt, lock)", "classifier.header"]
    assert applied == ["limits.max_inflight: 8 -> 4"]
    same = StagesConfig.model_validate({"stages": [{"name": "a", "path": "^/a", "queue_cap": 3},
                                                   {"name": "b", "path": "^/b"}], "limits": {"max_inflight": 8}})
    merged, applied, restart = live_merge(old, same)
    assert restart == [] and applied == ["stages[a].queue_cap: none -> 3"] and merged.stages[0].queue_cap == 3
