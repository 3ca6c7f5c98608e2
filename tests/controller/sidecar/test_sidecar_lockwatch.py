"""The sidecar learns that a stage is serialised and exempts it from CPU demotion: a real Apache, a
real lock, the real sidecar with ``--online --access-log``.

Apache (mod_overtake_prio with ``OvertakeRequestTimes On``) serves ``/locked`` (SQLite's write
lock, tests/support/sqlite_lock.py) and ``/stage1`` (CPU only). An open-loop Poisson stream to
each goes through the sidecar (passthrough policy, stage ``writes`` = /locked, ``cpu`` = /stage1):
/locked at about 7 per second with 20 ms of CPU in the lock (SQLite's busy handler sleeps 0.1 s
between tries: waiters pile up fast on a busy machine), /stage1 at 25 per second with 10 ms.
Known answers: the sidecar logs ``writes`` serialised with lock capacity 1 and ``cpu`` not, exports
``overtake_stage_serialised``, and from then on sends /locked with ``X-Overtake-Exempt`` (counted by
the sidecar and by the module as header exemptions) and /stage1 without. (The verdict may come while the stream still
runs: the exemptions are counted from after it.)
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import numpy as np
from support.service_helpers import SidecarProc

from overtake.controller.harness import apache
from overtake.controller.harness.apache.cpu_priority import fetch_prio_status

N = 300
STAGES = """stages:
  - {name: writes, path: "^/locked$"}
  - {name: cpu, path: "^/stage1$"}
limits: {max_inflight: 64, queue_cap: 1000, queue_timeout: 60}
classifier: {mode: explicit, header: X-Overtake-Phase, time_unit: 0.01}
"""


def _poisson(side: SidecarProc, target: str, gap: float, seed: int, codes: list[int]) -> None:
    rng = np.random.default_rng(seed)
    threads = []
    at = time.monotonic()
    for g in rng.exponential(gap, N):
        at += g
        time.sleep(max(0.0, at - time.monotonic()))
        th = threading.Thread(target=lambda: codes.append(side.request("GET", target)[0]))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()


def _exempt_sent(side: SidecarProc) -> dict[str, float]:
    """``overtake_stage_cpu_exempt_total`` by stage (requests the sidecar sent with X-Overtake-Exempt)."""
    text = side.request("GET", "/-/metrics")[2].decode()
    return {m[1]: float(m[2]) for m in re.finditer(r'^overtake_stage_cpu_exempt_total\{stage="([^"]+)"\} (\S+)$',
                                                   text, re.MULTILINE)}


def test_a_serialised_stage_is_learned_and_exempted(lock_apache: apache.ApacheInstance, tmp_path: Path) -> None:
    log = Path(lock_apache.workdir) / "logs" / "access.log"
    side = SidecarProc(tmp_path, ["--policy", "passthrough", "--apache", lock_apache.base_url, "--online",
                                  "--access-log", str(log), "--refit-interval", "3600"], stages=STAGES)
    try:
        codes: list[int] = []
        feeders = [threading.Thread(target=_poisson, args=(side, t, g, s, codes))
                   for t, g, s in (("/locked?work=0.02", 0.15, 1), ("/stage1?work=0.01", 0.04, 2))]
        for f in feeders:
            f.start()
        for f in feeders:
            f.join()
        # every answer: mpm_event closes idle kept-alive connections when its workers are all busy
        # (they are, queued at the lock); the sidecar's pool must not lose a request to them
        assert len(codes) == 2 * N and codes.count(200) == 2 * N, \
            [e for e in side.events() if e.get("level") != "info"][:5]
        deadline = time.monotonic() + 30  # the log is polled every second, verdicts every 5 s
        while True:
            said = {e["stage"]: e["verdict"] for e in side.events() if e.get("event") == "online_serialisation"}
            if said.get("writes", {}).get("serialising") is not None and "cpu" in said:
                break
            assert time.monotonic() < deadline, said
            time.sleep(0.5)
        assert said["writes"]["serialising"] is True and said["writes"]["lock_capacity"] == 1, said
        assert said["cpu"]["serialising"] is False, said
        text = side.request("GET", "/-/metrics")[2].decode()
        assert 'overtake_stage_serialised{stage="writes"} 1.0' in text
        assert 'overtake_stage_serialised{stage="cpu"} 0.0' in text
        host, port = apache.parse_listen(lock_apache.listen)
        before, sent = fetch_prio_status(host, port), _exempt_sent(side)
        for target in ("/locked?work=0", "/stage1?work=0", "/locked?work=0"):
            assert side.request("GET", target)[0] == 200
        after = fetch_prio_status(host, port)
        assert after.exempt_header - before.exempt_header == 2  # the two /locked, not /stage1
        now = _exempt_sent(side)
        assert now["writes"] - sent["writes"] == 2 and "cpu" not in now, now
    finally:
        side.stop()
