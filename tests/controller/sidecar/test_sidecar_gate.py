"""``overtake sidecar --gate``: queued requests wait in Apache's admission gate (mod_overtake_prio).

Known answers: through the sidecar with ``pi(1)`` and the gate, four 50 ms requests on Apache's
one core run one at a time (the first answer after ~50 ms, not after the ~200 ms of processor
sharing) while the later ones wait in Apache's gate (the module's counter); a request held past
the sidecar's queue timeout gets the sidecar's 503 and the module ends it; with a gate file
Apache does not map, the sidecar says so and keeps the requests itself.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from support.service_helpers import SidecarProc

from overtake.controller.harness import apache
from overtake.controller.harness.apache.cpu_priority import PrioStatus, fetch_prio_status

STAGES = """stages:
  - {name: stage1, path: "^/stage1$"}
limits: {max_inflight: 8, queue_cap: 200, queue_timeout: 0.4}
"""


def _status(inst: apache.ApacheInstance) -> PrioStatus:
    return fetch_prio_status(*apache.parse_listen(inst.listen))


@pytest.fixture(scope="module")
def gated(gate_apache: tuple[apache.ApacheInstance, str]) -> tuple[apache.ApacheInstance, str]:
    return gate_apache


def _metric(side: SidecarProc, name: str) -> float | None:
    for line in side.request("GET", "/-/metrics")[2].decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _wait_metric(side: SidecarProc, name: str, value: float, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while _metric(side, name) != value:
        assert time.monotonic() < deadline, side.text()[-2000:]
        time.sleep(0.1)


@pytest.mark.parametrize("backfill", [0, 1])
def test_sidecar_gate_enforces_pi1_inside_apache(gated: tuple[apache.ApacheInstance, str], work: Path,
                                                 backfill: int) -> None:
    """Four concurrent 50 ms requests with a one-thread limit: three wait in Apache's gate and
    run one after the other (first answer after ~50 ms; under processor sharing all four would
    finish near 200 ms); with ``--gate-backfill 1`` the oldest waiting one starts early at
    SCHED_IDLE (weight 3/1024: the order stays) and every idle start is promoted on its
    admission; a queue timeout while held ends the held request (503 from the sidecar, the
    module counts it withdrawn) and frees its worker."""
    inst, path = gated
    side = None
    try:
        side = SidecarProc(work, ["--policy", "pi(1)", "--apache", inst.base_url, "--gate", path, "--gate-slots", "4",
                                  "--gate-backfill", str(backfill), "--status-interval", "0.2"], stages=STAGES)
        _wait_metric(side, "overtake_gate_enabled", 1.0)
        assert any(e.get("event") == "gate_on" for e in side.events())
        before = _status(inst)
        done: list[tuple[int, float]] = []
        t0 = time.monotonic()

        def one() -> None:
            code, _, _ = side.request("GET", "/stage1?work=0.05")  # type: ignore[union-attr]
            done.append((code, time.monotonic() - t0))

        ths = [threading.Thread(target=one) for _ in range(4)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(30)
        assert [c for c, _ in done] == [200] * 4
        ends = sorted(t for _, t in done)
        assert ends[0] < 0.13, f"first answer after {ends[0]:.3f} s: the requests shared the CPU ({ends})"
        assert ends[-1] > 0.19
        mid = _status(inst)
        held, idle = mid.gate_held - before.gate_held, mid.gate_idle_starts - before.gate_idle_starts
        if backfill:
            assert idle >= 1 and held + idle >= 2
            assert mid.gate_promotions - before.gate_promotions == idle  # each got its priority back
            assert mid.restore_errors == before.restore_errors
        else:
            assert held >= 2 and idle == 0  # at least the later ones waited in Apache
        assert mid.gate_timeouts == before.gate_timeouts and mid.gate_stale == before.gate_stale
        # a request held past the sidecar's queue timeout (0.4 s) behind a 1 s one
        th = threading.Thread(target=lambda: side.request("GET", "/stage1?work=1.0"))  # type: ignore[union-attr]
        th.start()
        time.sleep(0.1)
        code, _, body = side.request("GET", "/stage1?work=0.001")
        th.join(30)
        assert code == 503 and b"queue timeout" in body
        end = _status(inst)
        if backfill:  # it was started idle: promoted by the cancel, or it ended still idle (1 ms of work)
            assert end.gate_idle_starts > mid.gate_idle_starts
            assert (end.gate_promotions - mid.gate_promotions) + (end.requests[1] - mid.requests[1]) \
                == end.gate_idle_starts - mid.gate_idle_starts
            assert end.restore_errors == mid.restore_errors
        else:  # it was held: the module ended it
            assert end.gate_cancels + end.gate_stale + end.gate_aborts > mid.gate_cancels + mid.gate_stale + mid.gate_aborts
        assert _metric(side, "overtake_gate_slots_in_use") == 0.0
    finally:
        if side is not None:
            side.stop()


def test_sidecar_without_apaches_gate_keeps_requests_itself(
        gated: tuple[apache.ApacheInstance, str], work: Path) -> None:
    inst, _ = gated
    other = f"/dev/shm/overtake-gate-other-{os.getpid()}"
    side = SidecarProc(work, ["--policy", "pi(1)", "--apache", inst.base_url, "--gate", other,
                              "--status-interval", "0.2"], stages=STAGES)
    try:
        time.sleep(0.6)
        assert _metric(side, "overtake_gate_enabled") == 0.0
        off = [e for e in side.events() if e.get("event") == "gate_off"]
        assert off and "another gate file" in off[0]["detail"]
        before = _status(inst)
        assert side.request("GET", "/stage1?work=0.001")[0] == 200
        assert _status(inst).gate_held == before.gate_held
    finally:
        side.stop()
        for p in (other, other + ".key"):  # the sidecar makes both
            Path(p).unlink(missing_ok=True)


@pytest.mark.parametrize("slots", [4, 12])
def test_sidecar_warns_when_held_requests_could_take_every_worker(
        gated: tuple[apache.ApacheInstance, str], work: Path, slots: int) -> None:
    """Apache has 16 workers; max_inflight 8 + 12 gate slots could leave an admitted request none."""
    inst, path = gated
    side = SidecarProc(work, ["--policy", "pi(1)", "--apache", inst.base_url, "--gate", path,
                              "--gate-slots", str(slots)], stages=STAGES)
    try:
        # the start-up checks are logged before the sidecar answers
        warn = [e for e in side.events() if e.get("event") == "config_warning" and "gate_slots" in e.get("detail", "")]
        assert len(warn) == (1 if slots == 12 else 0)
        if warn:
            assert "lower gate_slots to 8" in warn[0]["detail"]
    finally:
        side.stop()


LONG_QUEUE = """stages:
  - {name: stage1, path: "^/stage1$"}
limits: {max_inflight: 8, queue_cap: 200, queue_timeout: 30}
"""


def test_truncating_the_gate_file_under_load_loses_nothing(gated: tuple[apache.ApacheInstance, str],
                                                          work: Path) -> None:
    """``truncate -s 0`` on the gate file while 16 requests are in flight under pi(1), 8 of them
    held in Apache's gate: every request is answered 200, the sidecar and Apache's children live,
    the sidecar says once that it lost the file and keeps the queue itself from then on."""
    inst, path = gated
    err_log = Path(inst.workdir) / "logs" / "error.log"
    crashes = err_log.read_text().count("exit signal")
    side = SidecarProc(work, ["--policy", "pi(1)", "--apache", inst.base_url, "--gate", path, "--gate-slots", "8",
                              "--gate-backfill", "0", "--status-interval", "0.2"], stages=LONG_QUEUE)
    try:
        _wait_metric(side, "overtake_gate_enabled", 1.0)
        codes: list[int] = []

        def one() -> None:
            try:
                codes.append(side.request("GET", "/stage1?work=0.02", timeout=60)[0])
            except OSError:
                codes.append(-1)

        ths = [threading.Thread(target=one) for _ in range(16)]
        for th in ths:
            th.start()
        deadline = time.monotonic() + 10
        while (_metric(side, "overtake_gate_slots_in_use") or 0) < 4:
            assert time.monotonic() < deadline, "no request was held in Apache's gate"
            time.sleep(0.02)
        os.truncate(path, 0)
        for th in ths:
            th.join(60)
        assert side.proc.poll() is None, f"the sidecar died (rc {side.proc.returncode}): {side.text()[-2000:]}"
        assert sorted(codes) == [200] * 16
        assert err_log.read_text().count("exit signal") == crashes, err_log.read_text()[-2000:]
        _wait_metric(side, "overtake_gate_enabled", 0.0)
        lost = [e for e in side.events() if e.get("event") == "gate_lost"]
        assert len(lost) == 1 and "shrank" in lost[0]["detail"], side.text()[-2000:]
        assert side.request("GET", "/stage1?work=0.001")[0] == 200  # the queue is the sidecar's again
    finally:
        side.stop()
