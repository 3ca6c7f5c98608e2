"""Module mode's follow-up reservation (``OvertakeStageNext first second``), on a private Apache
(mpm_event) whose count table lets one ``second`` request run at a time (π(8,1)):

- a request of ``first`` that ends on a kept-alive connection reserves the connection's turn of
  ``second``; a newcomer of ``second`` that arrives in between waits, and the connection's
  follow-up runs ahead of it (their handler spans do not overlap, the follow-up's first);
- a reservation whose request never comes expires after ``OvertakeStageFollowUp``: a newcomer
  held behind it then runs without reaching its hold bound, and the expiry is counted;
- a connection that closes gives its reservation up at once (counted as closed, not expired);
- under a mixed load, the started requests and reservations of ``second`` never exceed the
  table's one slot, and every reservation made ends exactly once;
- ``overtake sidecar --enforce module`` beside it exports the reservation counters on /-/metrics.
"""

from __future__ import annotations

import http.client
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.control_apache import control_apache
from support.service_helpers import SidecarProc

from overtake.controller.harness import apache
from overtake.controller.harness.scratch import free_port
from overtake.controller.sidecar.control_file import ControlFile
from overtake.controller.sidecar.count_table import from_policy
from overtake.controller.sidecar.policies import BaselinePolicy

NAMES = ("first", "second")
FOLLOW_UP = 2.0  # OvertakeStageFollowUp: long enough to act between the two requests
HOLD = 30.0
OUTCOMES = ("claimed", "expired", "closed", "other")


@pytest.fixture(scope="module")
def tandem(apache_available: None) -> Iterator[tuple[apache.ApacheInstance, str]]:
    with control_apache("module-follow", levels=(0.5,), nice=("idle",), stage_hold=HOLD, mpm="event",
                        stages=(("first", "^/stage1$"), ("second", "^/stage2$")),
                        stage_next=(("first", "second"),), stage_follow_up=FOLLOW_UP) as (inst, path):
        table = from_policy(BaselinePolicy("pi(8,1)", 2), NAMES)
        assert table is not None
        cf = ControlFile(path)
        try:
            gen = cf.write(2, None, table.encode())
        finally:
            cf.close()
        _until(inst, lambda st: st.get("overtake_stage_table_generation") == gen)
        yield inst, path


def _status(inst: apache.ApacheInstance) -> dict[str, float]:
    with urllib.request.urlopen(inst.base_url + "/overtake-prio-status", timeout=30) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}


def _until(inst: apache.ApacheInstance, ok: object, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        st = _status(inst)
        if ok(st) or time.monotonic() > deadline:  # type: ignore[operator]
            return st
        time.sleep(0.02)


def _g(st: dict[str, float], name: str, **labels: str) -> float:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return st[f"{name}{{{inner}}}"]


def _reserved(st: dict[str, float], state: str) -> float:
    return _g(st, "overtake_stage_reserved", stage="second", state=state)


def _ended(st: dict[str, float], outcome: str) -> float:
    return _g(st, "overtake_stage_reservations_ended_total", stage="second", outcome=outcome)


def _idle(st: dict[str, float]) -> bool:
    return all(_g(st, f"overtake_stage_{k}", stage=s) == 0 for s in NAMES for k in ("waiting", "active")) \
        and all(_reserved(st, x) == 0 for x in ("waiting", "started"))


def _span(resp: http.client.HTTPResponse) -> tuple[int, int]:
    resp.read()
    assert resp.status == 200
    span = resp.getheader("X-Handler-Span-us")
    assert span is not None
    b, e = (int(v) for v in span.split())
    return b, e


def _get(conn: http.client.HTTPConnection, path: str) -> tuple[int, int]:
    conn.request("GET", path)
    return _span(conn.getresponse())


def _conn(inst: apache.ApacheInstance) -> http.client.HTTPConnection:
    host, port = apache.parse_listen(inst.listen)
    return http.client.HTTPConnection(host, port, timeout=60)


def _newcomer(inst: apache.ApacheInstance, work: float) -> tuple[int, int]:
    c = _conn(inst)
    try:
        return _get(c, f"/stage2?work={work}&trace=1")
    finally:
        c.close()


def test_the_follow_up_takes_its_reserved_turn_ahead_of_a_newcomer(tandem: tuple[apache.ApacheInstance, str]) -> None:
    inst, _ = tandem
    before = _until(inst, _idle)
    c = _conn(inst)
    try:
        _get(c, "/stage1?work=0&trace=1")
        # the reservation is started at once (nothing of second runs): it holds second's slot
        st = _until(inst, lambda s: _reserved(s, "started") == 1)
        assert _reserved(st, "started") == 1 and _g(st, "overtake_stage_active", stage="second") == 0
        with ThreadPoolExecutor(1) as ex:
            newcomer = ex.submit(_newcomer, inst, 0.05)
            st = _until(inst, lambda s: _g(s, "overtake_stage_waiting", stage="second") == 1)
            assert _g(st, "overtake_stage_waiting", stage="second") == 1, "the newcomer did not wait"
            follow = _get(c, "/stage2?work=0.05&trace=1")
            other = newcomer.result(timeout=60)
        assert follow[1] <= other[0], (follow, other)  # the follow-up ran first, alone
    finally:
        c.close()
    after = _until(inst, _idle)
    assert _ended(after, "claimed") - _ended(before, "claimed") == 1
    assert _g(after, "overtake_stage_reservations_total", stage="second") - _g(
        before, "overtake_stage_reservations_total", stage="second") == 1
    assert _g(after, "overtake_stage_hold_timeouts_total", stage="second") == _g(
        before, "overtake_stage_hold_timeouts_total", stage="second")


def test_an_unclaimed_reservation_expires_and_frees_its_slot(tandem: tuple[apache.ApacheInstance, str]) -> None:
    inst, _ = tandem
    before = _until(inst, _idle)
    c = _conn(inst)
    try:
        _get(c, "/stage1?work=0&trace=1")
        assert _reserved(_until(inst, lambda s: _reserved(s, "started") == 1), "started") == 1
        t0 = time.monotonic()
        # held behind the reservation until it expires (nothing else decides meanwhile); it runs
        # long before its hold bound
        _newcomer(inst, 0)
        waited = time.monotonic() - t0
        after = _until(inst, _idle)
    finally:
        c.close()
    assert waited < HOLD / 2, waited
    assert _ended(after, "expired") - _ended(before, "expired") == 1
    assert _ended(after, "claimed") == _ended(before, "claimed")
    assert _g(after, "overtake_stage_hold_timeouts_total", stage="second") == _g(
        before, "overtake_stage_hold_timeouts_total", stage="second")


def test_a_closed_connection_gives_its_reservation_up(tandem: tuple[apache.ApacheInstance, str]) -> None:
    inst, _ = tandem
    before = _until(inst, _idle)
    c = _conn(inst)
    _get(c, "/stage1?work=0&trace=1")
    assert _reserved(_until(inst, lambda s: _reserved(s, "started") == 1), "started") == 1
    c.close()
    after = _until(inst, lambda s: _ended(s, "closed") > _ended(before, "closed"), timeout=FOLLOW_UP * 0.8)
    assert _ended(after, "closed") - _ended(before, "closed") == 1
    assert _ended(after, "expired") == _ended(before, "expired")
    assert _reserved(after, "started") == 0 and _reserved(after, "waiting") == 0


def test_counts_are_conserved_under_a_mixed_load(tandem: tuple[apache.ApacheInstance, str]) -> None:
    inst, _ = tandem
    before = _until(inst, _idle)
    samples: list[dict[str, float]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(_status(inst))

    def pairs(n: int) -> list[tuple[int, int]]:
        c = _conn(inst)
        try:
            out = []
            for _ in range(n):
                _get(c, "/stage1?work=0.002&trace=1")
                out.append(_get(c, "/stage2?work=0.005&trace=1"))
            return out
        finally:
            c.close()

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(8) as ex:
            jobs = [ex.submit(pairs, 5) for _ in range(5)] + [ex.submit(_newcomer, inst, 0.005) for _ in range(10)]
            spans = [s for j in jobs[:5] for s in j.result(timeout=120)] + [j.result(timeout=120) for j in jobs[5:]]
    finally:
        stop.set()
        sampler.join()
    after = _until(inst, _idle)
    assert samples
    for st in samples:  # one slot of second: its running requests and started reservations share it
        assert _g(st, "overtake_stage_active", stage="second") + _reserved(st, "started") <= 1, st
        assert _g(st, "overtake_stage_active", stage="first") <= 8
    events = sorted([(b, 1) for b, _ in spans] + [(e, -1) for _, e in spans])
    now = most = 0
    for _, d in events:
        now += d
        most = max(most, now)
    assert most == 1  # second's handler spans never overlap
    made = _g(after, "overtake_stage_reservations_total", stage="second") - _g(
        before, "overtake_stage_reservations_total", stage="second")
    ended = sum(_ended(after, o) - _ended(before, o) for o in OUTCOMES)
    assert made == ended >= 1  # each reservation ends exactly once
    assert _g(after, "overtake_stage_requests_total", stage="second") - _g(
        before, "overtake_stage_requests_total", stage="second") == 35
    assert _idle(after)


MODULE_STAGES = """
stages:
  - name: first
    path: "^/stage1$"
    next: second
  - name: second
    path: "^/stage2$"
limits: {max_inflight: 16, queue_cap: 1000, queue_timeout: 30}
classifier: {mode: hidden, time_unit: 0.005}
"""


def test_the_controller_exports_the_reservations(tandem: tuple[apache.ApacheInstance, str], tmp_path: Path) -> None:
    """The sidecar in module mode (its π(8,1) table written to the control file) passes the
    module's reservation gauge and counters to its /-/metrics, with their stage labels."""
    inst, path = tandem
    admin = free_port()
    side = SidecarProc(tmp_path, ["--policy", "pi(8,1)", "--apache", inst.base_url, "--control-file", path,
                                  "--enforce", "module", "--status-interval", "0.5", "--admin-listen",
                                  f"127.0.0.1:{admin}"], stages=MODULE_STAGES, ready_port=admin)
    try:
        before = _until(inst, _idle)
        c = _conn(inst)
        try:
            _get(c, "/stage1?work=0&trace=1")
            _get(c, "/stage2?work=0&trace=1")
        finally:
            c.close()
        claimed = _ended(_until(inst, _idle), "claimed")
        assert claimed == _ended(before, "claimed") + 1
        want = f'overtake_stage_reservations_ended_total{{outcome="claimed",stage="second"}} {claimed}'
        deadline = time.monotonic() + 30
        while want not in (text := side.request("GET", "/-/metrics")[2].decode()):
            assert time.monotonic() < deadline, text[-3000:]
            time.sleep(0.5)
        assert 'overtake_stage_reserved{stage="second",state="started"}' in text
    finally:
        side.stop()
