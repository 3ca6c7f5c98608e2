"""Module mode: the stages file's stages and ``next`` against Apache's ``OvertakeStage`` sections
and ``OvertakeStageNext``, on a private Apache with mod_overtake_prio (three stages, first -> second).

- The module publishes each stage with the stage its ``OvertakeStageNext`` names.
- A module-mode sidecar whose stages file agrees logs agreement once, no mismatch, and shows
  ``module_stages.agree: true`` in ``/-/policy``.
- A ``next:`` that differs from ``OvertakeStageNext``: a warning naming the stage and both values,
  ``agree: false``, the mismatch gauge at 1 for that stage only.
- A stage on one side only (either side): a warning per stage, naming it and the file to fix.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.control_apache import control_apache
from support.service_helpers import SidecarProc

from overtake.controller.harness import apache
from overtake.controller.harness.scratch import free_port
from overtake.controller.sidecar.module_stages import parse_module_stages

PATHS = {"first": "^/stage1$", "second": "^/stage2$", "third": "^/stage3$", "extra": "^/stage4$"}


@pytest.fixture(scope="module")
def linked(apache_available: None) -> Iterator[tuple[apache.ApacheInstance, str]]:
    with control_apache("module-links", levels=(0.5,), nice=("idle",), stage_hold=1.5, mpm="event",
                        stages=tuple((s, PATHS[s]) for s in ("first", "second", "third")),
                        stage_next=(("first", "second"),)) as served:
        yield served


def _stages_yaml(stages: dict[str, str | None]) -> str:
    rows = "".join(f"  - name: {s}\n    path: {json.dumps(PATHS[s])}\n" + (f"    next: {n}\n" if n else "")
                   for s, n in stages.items())
    return (f"stages:\n{rows}limits: {{max_inflight: 16, queue_cap: 1000, queue_timeout: 30}}\n"
            "classifier: {mode: hidden, time_unit: 0.005}\n")


def _sidecar(inst: apache.ApacheInstance, path: str, tmp_path: Path, stages: dict[str, str | None]) -> SidecarProc:
    admin = free_port()
    return SidecarProc(tmp_path, ["--policy", "passthrough", "--apache", inst.base_url, "--control-file", path,
                                  "--enforce", "module", "--status-interval", "0.5", "--admin-listen",
                                  f"127.0.0.1:{admin}"], stages=_stages_yaml(stages), ready_port=admin)


def _checked(side: SidecarProc) -> dict[str, Any]:
    """``module_stages`` of ``/-/policy`` once the module's status was read (within 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        info: dict[str, Any] = json.loads(side.request("GET", "/-/policy")[2])["module_stages"]
        if info["agree"] is not None:
            return info
        assert time.monotonic() < deadline, side.text()[-3000:]
        time.sleep(0.3)


def _mismatches(side: SidecarProc) -> list[dict[str, Any]]:
    return [e for e in side.events() if e.get("event") == "module_stage_mismatch"]


def _gauge(side: SidecarProc) -> dict[str, float]:
    text = side.request("GET", "/-/metrics")[2].decode()
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("overtake_module_stage_mismatch{")}


@pytest.mark.apache_functional
def test_the_module_publishes_its_stages_and_their_next(linked: tuple[apache.ApacheInstance, str]) -> None:
    inst, _ = linked
    with urllib.request.urlopen(inst.base_url + "/overtake-prio-status", timeout=30) as r:
        page = r.read().decode()
    assert parse_module_stages(page) == {"first": "second", "second": None, "third": None}


@pytest.mark.apache_functional
def test_an_agreeing_stages_file_says_so_once(linked: tuple[apache.ApacheInstance, str], tmp_path: Path) -> None:
    inst, path = linked
    side = _sidecar(inst, path, tmp_path, {"first": "second", "second": None, "third": None})
    try:
        info = _checked(side)
        assert info["agree"] is True and info["differences"] == [], info
        assert info["module"] == {"first": "second", "second": None, "third": None}
        time.sleep(1.5)  # a few more scrapes: still one agreement line, no mismatch
        assert [e["event"] for e in side.events() if e.get("event", "").startswith("module_stage")] == [
            "module_stages_agree"], side.text()[-3000:]
        assert _gauge(side) == {"first": 0.0, "second": 0.0, "third": 0.0}
    finally:
        side.stop()


@pytest.mark.apache_functional
def test_a_next_that_differs_from_overtake_stage_next_names_the_stage_and_both(
        linked: tuple[apache.ApacheInstance, str], tmp_path: Path) -> None:
    inst, path = linked
    side = _sidecar(inst, path, tmp_path, {"first": "third", "second": None, "third": None})
    try:
        info = _checked(side)
        assert info["agree"] is False
        assert [(d["stage"], d["kind"], d["stages_file"], d["module"]) for d in info["differences"]] == [
            ("first", "next", "third", "second")]
        time.sleep(1.5)  # logged once, not at every scrape
        (e,) = _mismatches(side)
        assert e["stage"] == "first" and "'third'" in e["msg"] and "'second'" in e["msg"], e
        assert "OvertakeStageNext first third" in e["detail"]["fix"] and "next: second" in e["detail"]["fix"]
        assert _gauge(side) == {"first": 1.0, "second": 0.0, "third": 0.0}
        assert not [x for x in side.events() if x.get("event") == "module_stages_agree"]
    finally:
        side.stop()


@pytest.mark.apache_functional
def test_a_stage_on_one_side_only(linked: tuple[apache.ApacheInstance, str], tmp_path: Path) -> None:
    inst, path = linked
    side = _sidecar(inst, path, tmp_path, {"first": "second", "second": None, "extra": None})
    try:
        info = _checked(side)
        assert info["agree"] is False
        assert [(d["stage"], d["kind"]) for d in info["differences"]] == [
            ("extra", "missing_in_module"), ("third", "missing_in_stages_file")]
        time.sleep(1.0)
        said = {e["stage"]: e for e in _mismatches(side)}
        assert set(said) == {"extra", "third"} and len(_mismatches(side)) == 2
        assert "OvertakeStage extra" in said["extra"]["detail"]["fix"]
        assert "stages file" in said["third"]["detail"]["fix"]
        assert _gauge(side) == {"first": 0.0, "second": 0.0, "extra": 1.0, "third": 1.0}
    finally:
        side.stop()
