"""``lock: auto`` on a real Apache with a real lock: SQLite's write lock (tests/support/sqlite_lock.py),
the real sidecar with ``--online --access-log``, mod_overtake_prio's request-time split.

Before the detector has decided, the stage has no lock: the trial trace (a big request takes the
lock, two more big ones follow, then small ones, as in test_stage_lock_apache) runs as without
one. An open-loop stream to the stage, until the sidecar has learned the lock, lets the detector
find it serialised: the sidecar logs the learned lock, 1, and shows it with its source in
``/-/policy`` and the metrics. The same trials then run with the lock in the sidecar, and the
small requests' mean response time drops (medians over trials with a wide margin, so that a
loaded 2-core machine passes and a missing rule fails).
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from support.service_helpers import SidecarProc

from overtake.controller.harness import apache
from overtake.controller.online.lockwatch import CHECK_INTERVAL

BIG, SMALL = 0.3, 0.005  # thread CPU s inside the lock
SMALLS = 4
TRIALS = 3
STREAM = 300  # requests of the open-loop stream the detector learns from, at most
STAGES = """stages:
  - name: writes
    routes: [{path: "^/locked$", key: ["param:work"]}]
    lock: auto
limits: {max_inflight: 64, queue_cap: 1000, queue_timeout: 60, upstream_timeout: 120}
classifier: {mode: explicit, header: X-Overtake-Phase, time_unit: 0.01}
"""


def _get(side: SidecarProc, work: float, out: list[tuple[float, float]]) -> None:
    t0 = time.monotonic()
    code, _, body = side.request("GET", f"/locked?work={work}", timeout=120)
    assert code == 200, body
    out.append((work, time.monotonic() - t0))


def _trial(side: SidecarProc) -> float:
    """The small requests' mean response time in one run of the trace."""
    out: list[tuple[float, float]] = []
    plan = [(0.0, BIG), (0.02, BIG), (0.04, BIG)] + [(0.06, SMALL)] * SMALLS
    threads = []
    t0 = time.monotonic()
    for at, work in plan:
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        th = threading.Thread(target=_get, args=(side, work, out))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    assert len(out) == len(plan)
    return statistics.fmean(rt for w, rt in out if w == SMALL)


def _learned(side: SidecarProc) -> list[dict[str, Any]]:
    return [e for e in side.events() if e.get("event") == "online_lock_learned"]


def _stream(side: SidecarProc) -> int:
    """Poisson arrivals, 5 ms in the lock each (load ~0.04 of the lock, but SQLite's busy
    handler polls every 0.1 s: waiters pile up), every answer 200; the requests sent. The stream
    ends one verdict interval after the sidecar has learned the lock (its log, looked at once a
    second), so that a verdict on requests sent through the learned lock comes before the trials
    (the lock is said once); it sends ``STREAM`` requests at most."""
    out: list[tuple[float, float]] = []
    threads = []
    at = look = time.monotonic()
    until = math.inf
    for g in np.random.default_rng(1).exponential(0.15, STREAM):
        at += g
        time.sleep(max(0.0, at - time.monotonic()))
        th = threading.Thread(target=_get, args=(side, SMALL, out))
        th.start()
        threads.append(th)
        if time.monotonic() >= until:
            break
        if until == math.inf and time.monotonic() >= look + 1:
            look = time.monotonic()
            if _learned(side):
                until = look + CHECK_INTERVAL + 1
    for th in threads:
        th.join()
    assert len(out) == len(threads)
    return len(threads)


def test_the_learned_lock_serialises_the_stage(lock_apache: apache.ApacheInstance, tmp_path: Path) -> None:
    log = Path(lock_apache.workdir) / "logs" / "access.log"
    side = SidecarProc(tmp_path, ["--policy", "passthrough", "--apache", lock_apache.base_url, "--online",
                                  "--access-log", str(log), "--refit-interval", "3600"], stages=STAGES)
    try:
        before = [_trial(side) for _ in range(TRIALS)]
        assert json.loads(side.request("GET", "/-/policy")[2])["lock"]["writes"]["capacity"] is None
        streamed = _stream(side)
        deadline = time.monotonic() + 60  # the log is polled every second, verdicts every 5 s
        while True:
            learned = _learned(side)
            if learned:
                break
            assert time.monotonic() < deadline, [e for e in side.events() if e.get("event") == "online_serialisation"]
            time.sleep(0.5)
        assert learned[0]["stage"] == "writes" and learned[0]["lock"] == {"capacity": 1, "source": "learned"}, learned
        policy = json.loads(side.request("GET", "/-/policy")[2])
        assert policy["lock"]["writes"]["capacity"] == 1 and policy["lock"]["writes"]["source"] == "learned"
        assert policy["online"]["serialisation"]["writes"]["lock"] == {"capacity": 1, "source": "learned"}
        text = side.request("GET", "/-/metrics")[2].decode()
        assert 'overtake_stage_lock_learned{stage="writes"} 1.0' in text
        warm: list[tuple[float, float]] = []
        for _ in range(2):  # the lock learns its keys' holding times only once it is a lock
            _get(side, BIG, warm)
            _get(side, SMALL, warm)
        after = [_trial(side) for _ in range(TRIALS)]
        detail = (f"small requests' mean response time per trial, s: before the lock {[round(x, 3) for x in before]}, "
                  f"learned lock 1 {[round(x, 3) for x in after]}; learned from a stream of {streamed} requests")
        print(detail)
        assert statistics.median(after) <= 0.8 * statistics.median(before), detail
        assert _learned(side) == learned  # said once
    finally:
        side.stop()
