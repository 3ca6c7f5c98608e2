"""bench/handover.py on a real Apache and sidecar, briefly: each mode's wall time per request
exceeds the thread CPU the stage handler burns (the handler really burns it, and the cycle is
measured from the clients' side), the gated sidecar's requests go through Apache's gate, and the
bench gives the caller its cores back. The hand-over
figure itself is a measurement: it lives in the bench's results, not in a test."""

from __future__ import annotations

import argparse
import math
import os

from support.bench import bench_module

run = bench_module("handover").run


def test_every_mode_costs_more_than_the_work_and_cores_are_restored(apache_available: None) -> None:
    cores = os.sched_getaffinity(0)
    try:
        res = run(argparse.Namespace(work=0.005, requests=8, clients=2, rounds=1, gate_backfill=1))
        restored = os.sched_getaffinity(0)
    finally:
        os.sched_setaffinity(0, cores)
    assert restored == cores
    assert set(res["median_ms"]) == {"sidecar-pi1", "sidecar-gate-pi1", "direct-ps", "direct-serial"}
    for mode, ms in res["median_ms"].items():
        assert 0.0 < ms < 50.0, (mode, ms)  # beyond the 5 ms of work: Apache's and HTTP's own cost
    assert math.isfinite(res["handover_ms"]) and len(res["handover_ms_per_round"]) == 1
    assert math.isfinite(res["handover_gate_ms"]) and res["gate"]["timeouts"] == 0
    # the gated sidecar really used Apache's gate: every early start got its priority back
    assert res["gate"]["held"] + res["gate"]["idle_starts"] > 0
    assert res["gate"]["promotions"] <= res["gate"]["idle_starts"]
