"""Thresholds the control file puts in force reach the requests already running.

A request's next check by mod_overtake_prio's monitor is due when the request could first cross a
threshold, computed at its start from the thresholds then in force. Without re-arming, a request
that started under a high threshold kept it until that moment however far the file lowered it
(the old threshold "bled" into the new policy's requests). Here a request starts under a
configured threshold it never reaches (30 s of thread CPU for 1 s of work); while it runs, the
control file lowers the threshold to 0.05 s, which it has passed already. It must end demoted to
level 1 by age: without the re-arm it ends at level 0 (its check stays due 30 s after its start).
An exempt request (the exemption header: it may hold a lock others wait for) is looked at by the
same re-arm and must stay at level 0.
"""

from __future__ import annotations

import threading
import time

import pytest
from support.control_apache import control_apache
from support.control_apache import get as _get
from support.control_apache import prio_counters as _status

from overtake.controller.harness.apache.cpu_priority import DEFAULT_EXEMPT_HEADER
from overtake.controller.sidecar.control_file import ControlFile

CONFIGURED = 30.0  # OvertakePrioLevels: in force at the request's start, never reached by WORK
WORK = 1.0         # seconds of thread CPU the running request burns
LOWERED = 0.05     # the file's threshold, put in force while it runs (below what it has used)
LEVEL1 = 'overtake_cpu_prio_requests_total{level="1"}'
AGE1 = 'overtake_cpu_prio_demotions_total{level="1",cause="age"}'


@pytest.mark.parametrize("exempt", [False, True])
def test_a_lowered_threshold_reaches_a_request_already_running(apache_available: None, exempt: bool) -> None:
    # one child (8 threads, 8 workers): the status page's judgement is in the running request's process
    with control_apache("rearm", pin=True, levels=(CONFIGURED,), nice=(10,), threads_per_child=8,
                        max_workers=8) as (inst, path):
        before = _status(inst)
        assert before['overtake_cpu_prio_level_threshold_seconds{level="1"}'] == pytest.approx(CONFIGURED)
        done: dict[str, int] = {}
        headers = {DEFAULT_EXEMPT_HEADER: "1"} if exempt else None
        t = threading.Thread(target=lambda: done.update(code=_get(inst, f"/stage1?work={WORK}", headers=headers)[0]))
        t.start()
        try:
            deadline = time.monotonic() + 30
            while _status(inst)['overtake_cpu_prio_in_flight{level="0"}'] < 2:  # the status request and it
                assert time.monotonic() < deadline, "the long request never started"
                time.sleep(0.02)
            time.sleep(0.1)  # it has used well over LOWERED of CPU by the time the file says so
            cf = ControlFile(path)
            try:
                cf.write(1, [[LOWERED]])
            finally:
                cf.close()
            mid = _status(inst)
            assert t.is_alive(), "the request ended before the new threshold was in force: raise WORK"
            assert mid["overtake_cpu_prio_control_in_force"] == 1
            assert mid['overtake_cpu_prio_level_threshold_seconds{level="1"}'] == pytest.approx(LOWERED)
        finally:
            t.join(120)
        assert done.get("code") == 200
        after = _status(inst)
        # it ended at level 1, moved there by age: by the new threshold, not the one of its start;
        # exempt, it was looked at by the same re-arm and left alone
        assert after[LEVEL1] - before[LEVEL1] == int(not exempt), (before, after)
        assert after[AGE1] - before[AGE1] == int(not exempt)
