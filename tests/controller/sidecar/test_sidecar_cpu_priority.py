"""``overtake sidecar --cpu-priority age|class``: the sidecar's side of mod_overtake_prio.

The known answers: short-first classes are the phases (or route classes) whose expected work
α_k(−T)⁻¹1 exceeds the stage's mean (for Table 1's H2: 0.55 < 1 < 5.45, so classes 0 and 1);
the class header the sidecar sends replaces the client's; on a real Apache with the module, a
request the policy knows to be long enters level 1 by its class (the module's own counter says
so) and a short one does not; the module's counters appear on the sidecar's /-/metrics; in front
of an Apache without the module the sidecar says so once and proxies as before.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from support.service_helpers import SidecarProc, small_policy

from overtake.controller.errors import SidecarInputError
from overtake.controller.harness import apache
from overtake.controller.harness.apache.cpu_priority import fetch_prio_status
from overtake.controller.sidecar.heads import upstream_head
from overtake.controller.sidecar.policies import BaselinePolicy, TablePolicy, class_levels
from overtake.controller.sidecar.request import Request
from overtake.controller.sidecar.stages import StagesConfig, StageSpec, StageTable, load_stages
from overtake.mdp import Policy, Stage, TandemModel, Truncation, solve
from overtake.mdp.observed import solve_observed

STAGES = """stages:
  - {name: stage1, path: "^/stage1$", next: stage2}
  - {name: stage2, path: "^/stage2$"}
limits: {max_inflight: 8, queue_cap: 200, queue_timeout: 30}
classifier: {mode: explicit, header: X-Overtake-Phase, time_unit: 0.01}
"""


# ---- the classes (no Apache) -------------------------------------------------------------------


def test_class_levels_are_short_first_by_expected_work(tmp_path: Path) -> None:
    pol = TablePolicy(Policy.load(small_policy(tmp_path / "h2.npz")), "h2")
    assert class_levels(pol) == ((0, 1), (0, 1))  # phase means 0.55 and 5.45 around the mean 1.0
    # an Erlang-like stage whose phases are both entered first in turn: the phase with more work
    # left (the first) is the long class even though no phase mean says so alone
    T = np.array([[-2.0, 2.0], [0.0, -2.0]])
    erl = Stage("e", np.array([0.5, 0.5]), T)  # remaining work 1.0 from phase 1, 0.5 from phase 2
    opt = solve(TandemModel(0.3, (erl,)), truncation=Truncation(5, 3))
    assert class_levels(TablePolicy(opt.policy, "erl")) == ((1, 0),)
    assert class_levels(BaselinePolicy("pi(2)", 2)) is None


def test_a_policy_solved_with_classes_sends_its_own() -> None:
    from overtake.mdp.priority_classes import class_model

    s1 = Stage("stage1", np.array([0.91, 0.09]), np.diag([-1 / 2.75, -1 / 27.25]))
    s2 = Stage("stage2", np.array([0.91, 0.09]), np.diag([-1 / 0.55, -1 / 5.45]))
    lv = ((0, 1), (0, 0))  # not short-first: stage 2's long phase stays in class 0
    opt = solve(class_model(TandemModel(0.05, (s1, s2)), levels=lv), truncation=Truncation(5, 2))
    assert class_levels(TablePolicy(opt.policy, "lv")) == lv
    plain = solve(TandemModel(0.05, (s1, s2)), truncation=Truncation(5, 2))
    assert class_levels(TablePolicy(plain.policy, "plain")) == ((0, 1), (0, 1))


def test_no_class_without_phase_information() -> None:
    s = Stage("stage1", np.array([0.91, 0.09]), np.diag([-1 / 0.55, -1 / 5.45]))
    obs = solve_observed(TandemModel(0.3, (s,)), phase_info="none", truncation=Truncation(6, 3))
    assert class_levels(TablePolicy(obs.policy, "none")) is None


def _req(headers: list[tuple[bytes, bytes]]) -> Request:
    r = Request()
    r.method, r.target, r.version, r.headers = b"GET", b"/stage1", "1.1", headers
    return r


def test_upstream_head_sends_the_sidecars_class_only() -> None:
    hdrs = [(b"Host", b"x"), (b"X-Overtake-Class", b"0")]
    own = upstream_head(_req(hdrs), "127.0.0.1", 0, b"up", cpu_class=1)
    assert own.count(b"X-Overtake-Class") == 1 and b"X-Overtake-Class: 1\r\n" in own
    kept = upstream_head(_req(hdrs), "127.0.0.1", 0, b"up")  # off: a trusted client's header passes
    assert b"X-Overtake-Class: 0\r\n" in kept


# ---- on a real Apache with mod_overtake_prio ----------------------------------------------------


def _metrics(side: SidecarProc) -> str:
    return side.request("GET", "/-/metrics")[2].decode()


def test_class_mode_sets_the_level_apache_applies(prio_apache: apache.ApacheInstance, work: Path) -> None:
    pfile = small_policy(work / "cls.npz")
    side = SidecarProc(work, ["--policy", str(pfile), "--apache", prio_apache.base_url, "--cpu-priority", "class",
                              "--status-interval", "0.2"], stages=STAGES)
    try:
        host, port = apache.parse_listen(prio_apache.listen)
        before = fetch_prio_status(host, port)
        # the client claims class 0 for a long request: the sidecar's class (from the phase) wins
        code, _, _ = side.request("GET", "/stage1?work=0.002", headers={"X-Overtake-Phase": "2",
                                                                         "X-Overtake-Class": "0"})
        assert code == 200
        mid = fetch_prio_status(host, port)
        assert mid.demotions_class[1] - before.demotions_class[1] == 1
        code, _, _ = side.request("GET", "/stage2?work=0.002", headers={"X-Overtake-Phase": "1"})
        assert code == 200
        after = fetch_prio_status(host, port)
        assert after.demotions_class[1] == mid.demotions_class[1]  # the short phase starts at level 0
        assert after.requests[1] - before.requests[1] == 1  # (status scrapes end at level 0 too)
        deadline = time.monotonic() + 10
        while "overtake_cpu_prio_requests_total" not in (text := _metrics(side)):
            assert time.monotonic() < deadline, text[-2000:]
            time.sleep(0.1)
        assert 'overtake_cpu_prio_demotions_total{cause="class",level="1"}' in text
        assert side.request("GET", "/-/policy")[2].count(b'"cpu_priority": "class"') == 1
    finally:
        side.stop()


EXEMPT_STAGES = """stages:
  - {name: stage1, path: "^/stage1$", cpu_exempt: unsafe}
  - {name: stage2, path: "^/stage2$", cpu_exempt: [PUT]}
limits: {max_inflight: 8, queue_cap: 200, queue_timeout: 30}
classifier: {mode: explicit, header: X-Overtake-Phase, time_unit: 0.01}
"""


@pytest.mark.parametrize(
    ("value", "exempt"),
    [("unsafe", {"POST", "PUT", "DELETE", "OPTIONS"}), ("all", {"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS"}),
     (["put", "DELETE"], {"PUT", "DELETE"}), (None, set())],
)
def test_stage_cpu_exempt_methods(tmp_path: Path, value: object, exempt: set[str]) -> None:
    spec = StageSpec(name="s", path="^/s$", cpu_exempt=value)  # type: ignore[arg-type]
    table = StageTable(StagesConfig(stages=(spec,)))
    assert {m for m in ("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS") if table.cpu_exempt(0, m)} == exempt


@pytest.mark.parametrize(("value", "message"), [("writes", "must be 'unsafe'"), ("[FETCH]", "unknown HTTP method 'FETCH'")])
def test_stage_cpu_exempt_rejects_bad_values(tmp_path: Path, value: str, message: str) -> None:
    f = tmp_path / "stages.yaml"
    f.write_text(f'stages:\n  - {{name: s, path: "^/s$", cpu_exempt: {value}}}\n')
    with pytest.raises(SidecarInputError, match=r"stages\[0\]\.cpu_exempt") as err:
        load_stages(f)
    assert message in str(err.value)


def test_exempt_stage_keeps_its_priority_in_apache(prio_apache: apache.ApacheInstance, work: Path) -> None:
    side = SidecarProc(work, ["--policy", "passthrough", "--apache", prio_apache.base_url, "--cpu-priority", "age",
                              "--status-interval", "0.2"], stages=EXEMPT_STAGES)
    try:
        host, port = apache.parse_listen(prio_apache.listen)
        before = fetch_prio_status(host, port)
        for method, path in [("POST", "/stage1"), ("GET", "/stage1"), ("POST", "/stage2"), ("PUT", "/stage2"),
                             ("POST", "/stage1")]:
            code, _, body = side.request(method, f"{path}?work=0.001", body=b"" if method != "GET" else None)
            assert code == 200, body
        after = fetch_prio_status(host, port)
        assert after.exempt_header - before.exempt_header == 3  # POST /stage1 twice, PUT /stage2
        text = _metrics(side)
        assert 'overtake_stage_cpu_exempt_total{stage="stage1"} 2.0' in text, text[-3000:]
        assert 'overtake_stage_cpu_exempt_total{stage="stage2"} 1.0' in text
        # the module's own count, passed through on the sidecar's metrics once scraped
        want = f'overtake_cpu_prio_exempt_total{{cause="header"}} {float(after.exempt_header)}'
        deadline = time.monotonic() + 10
        while want not in (text := _metrics(side)):
            assert time.monotonic() < deadline, text[-3000:]
            time.sleep(0.1)
    finally:
        side.stop()


def test_age_mode_without_the_module_says_so_and_proxies(stub, work: Path) -> None:  # type: ignore[no-untyped-def]
    side = SidecarProc(work, ["--policy", "passthrough", "--apache", stub.url, "--cpu-priority", "age",
                              "--status-interval", "0.2"])
    try:
        assert side.request("GET", "/static/x")[0] == 200
        time.sleep(0.6)
        assert "overtake_cpu_prio" not in _metrics(side)
        absent = [e for e in side.events() if e.get("event") == "cpu_priority_absent"]
        assert len(absent) == 1 and "mod_overtake_prio" in absent[0]["detail"]
    finally:
        side.stop()
