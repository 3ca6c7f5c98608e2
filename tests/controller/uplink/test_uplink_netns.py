"""Uplink SRPT end to end on real qdiscs: two namespaces, a shaped veth, real TCP.

The server (bench/uplink/server.py, writing through overtake.controller.uplink) runs in the server
namespace, the client (bench/uplink/client.py) in the client namespace; both are the
benchmark's own programs. Known answers: a small download beside a bulk one finishes within
1.2x its solo time under SRPT (a 1 MB high-priority download beside a 4 MB low one was measured
at 1.01-1.05x on a 10 Mbit/s HTB uplink), while under FAIR the same download is slowed well
beyond that (FIFO sharing: 4.7x in the same measurement).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.bench import bench_module

_tb = bench_module("uplink.testbed")

REPO = Path(__file__).resolve().parents[3]

Testbed = _tb.Testbed
Testbed.__test__ = False  # not a test class (pytest collects names starting with Test)

SERVER = REPO / "bench" / "uplink" / "server.py"
CLIENT = REPO / "bench" / "uplink" / "client.py"
BIG, SMALL = 4_000_000, 500_000

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: network namespaces, qdiscs")


@pytest.fixture(scope="module", params=["htb", "tbf"])
def testbed(request: pytest.FixtureRequest) -> Iterator[Testbed]:
    tb = Testbed.up(rate="10mbit", mode=request.param)
    try:
        yield tb
    finally:
        tb.down()


def _raised() -> None:
    """In the server and the client before they start: their own session, its autogroup at nice
    -20, the normal policy. The test times their transfers, and every session is one scheduling
    group that shares a core by its autogroup nice (sched(7)); so without this, other load on the
    machine (or the suite's other worker, whose children are at nice 19 and SCHED_IDLE while the
    apache tests run: tests/conftest.py) stretches the two-flow run, whose server writes twice as
    much, more than the solo one and inflates the ratio. The private Apache is raised the same way."""
    Path("/proc/self/autogroup").write_text("-20\n")
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


#: Popen arguments of a timed process (root: the test needs it for the namespaces anyway)
TIMED: dict = {"start_new_session": True, "preexec_fn": _raised}


def _serve(tb: Testbed, uplink: str, stats: Path, *extra: str) -> subprocess.Popen[str]:
    bands = "htb" if tb.mode == "htb" else "pfifo_fast"
    p = subprocess.Popen(
        [*tb.exec_prefix(tb.srv_ns), sys.executable, str(SERVER), "--listen", f"{tb.srv_ip}:8080",
         "--uplink", uplink, "--bands", bands, "--stats-out", str(stats), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **TIMED,
    )  # fmt: skip
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.startswith("serving"), line + (p.stderr.read() if p.stderr else "")
    return p


def _stop(p: subprocess.Popen[str]) -> None:
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=20)  # also closes the pipes


def _times(tb: Testbed, sched: list[tuple[float, int]], tmp: Path) -> dict[int, float]:
    sp, rp = tmp / "s.json", tmp / "r.json"
    sp.write_text(json.dumps(sched))
    subprocess.run(
        [*tb.exec_prefix(tb.cli_ns), sys.executable, str(CLIENT), "--server", f"{tb.srv_ip}:8080",
         "--schedule", str(sp), "--out", str(rp), "--timeout", "60"],
        check=True, timeout=90, **TIMED,
    )  # fmt: skip
    res = json.loads(rp.read_text())
    assert all(r[6] is None and r[5] >= r[4] for r in res), res
    return {r[4]: r[3] - r[0] for r in res}


def _run(tb: Testbed, uplink: str, sched: list[tuple[float, int]], *extra: str) -> tuple[dict[int, float], dict]:
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        p = _serve(tb, uplink, tmp / "stats.json", *extra)
        try:
            t = _times(tb, sched, tmp)
        finally:
            _stop(p)
        return t, json.loads((tmp / "stats.json").read_text())


def _small_beside_bulk(tb: Testbed, uplink: str, bound: float, *extra: str) -> tuple[float, list[float], dict, dict, dict]:
    """The 500 KB download's time beside a 4 MB one over its solo time, best of up to three tries:
    CPU contention from other jobs only ever adds time to a transfer, so the best try measures
    the scheduling (the issue's bound), not the machine's load at that moment."""
    tries: list[float] = []
    for _ in range(3):
        solo, _ = _run(tb, uplink, [(0.0, SMALL)], *extra)
        both, st = _run(tb, uplink, [(0.0, BIG), (0.3, SMALL)], *extra)
        tries.append(both[SMALL] / solo[SMALL])
        if tries[-1] <= bound:
            break
    return min(tries), tries, solo, both, st


def test_small_download_preempts_bulk_under_srpt(testbed: Testbed) -> None:
    # SRPT bands: 500 KB -> top data band, 4 MB -> below the 2M cutoff (htb) / the 600K one (tbf)
    cut = ("--cutoffs", "600K,1M,2M") if testbed.mode == "htb" else ("--cutoffs", "600K")
    ratio, tries, solo, both, st = _small_beside_bulk(testbed, "srpt", 1.2, *cut)
    fair, _ = _run(testbed, "fair", [(0.0, BIG), (0.3, SMALL)])
    fair_ratio = fair[SMALL] / solo[SMALL]
    assert ratio <= 1.2, (testbed.mode, tries, solo, both)
    assert fair_ratio >= 1.5, (testbed.mode, solo, fair)  # the test can tell SRPT from FAIR
    # the bulk flow is not starved: it finishes about when the link has carried both
    link = 10e6 / 8 * 0.94
    assert both[BIG] <= 1.25 * (BIG + SMALL) / link + 0.5
    # every priority the server set is one of the configured data bands (never the control band)
    n_data = 7 if testbed.mode == "htb" else 2
    used = {int(b) for b in st["bands"]["flows_opened"]}
    assert used and used <= set(range(n_data))


def test_remaining_bytes_raise_the_priority_as_they_drain(testbed: Testbed) -> None:
    # one 4 MB flow alone starts in the band of 4 MB and climbs one band per cutoff it passes
    cut, start = ("1M,2M,3M", 3) if testbed.mode == "htb" else ("1M", 1)
    t, st = _run(testbed, "srpt", [(0.0, BIG)], "--cutoffs", cut)
    bands = st["bands"]
    assert bands["flows_opened"] == {str(start): 1}
    assert bands["priority_changes"] == start  # e.g. 3 -> 2 -> 1 -> 0, never back down
    assert t[BIG] == pytest.approx(BIG / (10e6 / 8 * 0.95), rel=0.25)


def test_app_level_ordering_lets_a_small_download_pass_bulk(testbed: Testbed) -> None:
    # Crovella et al.'s fallback, no kernel bands: one writer at a time, 16 KB quanta, smallest
    # remaining first; the small download needs ~0.4 s alone and enters 0.3 s into the bulk one
    if testbed.mode != "htb":
        pytest.skip("one qdisc suffices: the app-level scheduler never touches the bands")
    app = ("--concurrency", "1", "--max-pacing-rate", str(10_000_000 // 8))
    ratio, tries, solo, both, _ = _small_beside_bulk(testbed, "app", 1.3, *app)
    fair, _ = _run(testbed, "fair", [(0.0, BIG), (0.3, SMALL)])
    assert ratio <= 1.3, (tries, solo, both)
    assert fair[SMALL] / solo[SMALL] >= 1.5, (solo, fair)
    # holding the backlog in the server costs little throughput: the link carries both in time
    link = 10e6 / 8 * 0.94
    assert both[BIG] <= 1.25 * (BIG + SMALL) / link + 0.5


def test_floor_keeps_the_lowest_band_moving(testbed: Testbed) -> None:
    # SRPT puts the 4 MB flow in the lowest of 7 data bands (1:17) and the 500 KB one in band 4:
    # strictly, the small one takes the whole link (<= 1.2x solo, as above); with half the link
    # guaranteed to 1:17 the bulk flow keeps moving and the small one gets only the other half.
    if testbed.mode != "htb":
        pytest.skip("a floor is an HTB class rate; pfifo_fast bands are strict")
    floor, cut = 0.5, ("--cutoffs", "100K,200K,300K,400K,500K,3M")
    try:
        testbed.set_floor(floor)
        # the fastest of two solo runs: load only adds time, and an inflated solo time would hide
        # the floor's share (a ratio test failed in CI that way: solo 0.54 s instead of ~0.45 s)
        solo = min(_run(testbed, "srpt", [(0.0, SMALL)], *cut)[0][SMALL] for _ in range(2))
        both, st = _run(testbed, "srpt", [(0.0, BIG), (0.3, SMALL)], *cut)
    finally:
        testbed.set_floor(0.0)
    assert st["bands"]["flows_opened"] == {"4": 1, "6": 1}  # small in band 4, big in the lowest
    # handshake and slow start cost the same with or without the bulk flow, so the floor shows as
    # added time: the small flow's bytes at (1 - floor) of the link instead of all of it, i.e.
    # S/rate * floor/(1 - floor) = 0.4 s here; strict priority adds <= 0.2 x solo (~0.08 s)
    added = SMALL * 8 / 10e6 * floor / (1 - floor)
    assert both[SMALL] - solo >= 0.5 * added, (solo, both, added)
    # and the small flow still outranks the bulk one for the other half (only the bulk flow's
    # already queued packets go first); FIFO sharing would add several times as much
    assert both[SMALL] - solo <= 3.0 * added, (solo, both, added)
    strict, _ = _small_beside_bulk(testbed, "srpt", 1.2, *cut)[:2]
    assert strict <= 1.2, strict


# both downloads above every cutoff, so both start in the lowest band (band 6, class 1:17); the
# 1 MB one stays there for all but its last 60 KB
MID, LOW_CUTS = 1_000_000, ("--cutoffs", "10K,20K,30K,40K,50K,60K")
# both in the second-lowest band (band 5: 50K-5M), ordered only with --ordered-bands 2
SECOND_CUTS = ("--cutoffs", "10K,20K,30K,40K,50K,5M")


@pytest.mark.parametrize(
    "cuts, order, band",
    [(LOW_CUTS, (), "6"), (SECOND_CUTS, ("--ordered-bands", "2"), "5")],
    ids=["lowest-band", "second-lowest-band"],
)
def test_lowest_writers_keep_a_larger_newcomer_out_of_the_lowest_band(
    testbed: Testbed, cuts: tuple[str, ...], order: tuple[str, ...], band: str
) -> None:
    # HTB has 8 levels and SRPT uses them all, so the largest responses share the lowest band's
    # FIFO: a 4 MB download arriving 0.1 s into a 1 MB one takes a share TCP gives it there
    # (BBR's start-up takes more than half, so well above the 1 MB one's solo time). With
    # one lowest-band writer the 4 MB one waits in the server until the 1 MB one has climbed out
    # of the band (its last 60 KB), so the 1 MB one takes about its solo time.
    # Preempting a flow that is already sending is weaker: what it has queued in the kernel
    # (~240 KB at 0.3 s, BBR start-up) drains first and the newcomer ramps up behind it
    # (gated and FIFO overlap), so the known answer is this order.
    if testbed.mode != "htb":
        pytest.skip("the lowest of two pfifo_fast bands is the same mechanism; HTB suffices")
    # The second case is the same answer one band up (--ordered-bands 2): under overload the
    # lowest few bands are the ones that starve, so ordering them all is the useful setting.
    sched = [(0.0, MID), (0.1, BIG)]
    solo = min(_run(testbed, "srpt", [(0.0, MID)], *cuts)[0][MID] for _ in range(2))
    fifo_tries = []
    for _ in range(3):  # the FIFO's slowdown is what the gate is told from: retried like the gate's
        fifo, st_fifo = _run(testbed, "srpt", sched, *cuts)
        fifo_tries.append(fifo[MID] / solo)
        if fifo_tries[-1] >= 1.25:
            break
    tries = []
    for _ in range(3):
        gated, st = _run(testbed, "srpt", sched, *cuts, "--lowest-writers", "1", *order)
        tries.append(gated[MID] / solo)
        if tries[-1] <= 1.15:
            break
    assert st_fifo["bands"]["flows_opened"] == {band: 2} == st["bands"]["flows_opened"]
    assert st_fifo["bands"]["turn_waits"] == {}
    assert st["bands"]["turn_waits"] == {band: 1}, st  # the 4 MB flow waited, once
    assert min(tries) <= 1.15, (solo, tries, gated)
    assert max(fifo_tries) >= 1.25, (solo, fifo_tries)  # the test can tell the gate from the FIFO
    # holding the 4 MB flow back costs no throughput: it ends when the link has carried both
    link = 10e6 / 8 * 0.94
    assert gated[BIG] + 0.1 <= 1.1 * (BIG + MID) / link + 0.3, gated


_STALLED_CLIENT = """
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # window closes after a few KB
s.connect((sys.argv[1], 8080))
s.sendall(b"GET /%d HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n" % int(sys.argv[2]))
print("sent", flush=True)
time.sleep(float(sys.argv[3]))  # never reads: the server's writes to it stall
"""


def test_a_stalled_lowest_band_writer_passes_its_turn_on(testbed: Testbed) -> None:
    # a client that stops reading holds the lowest band's only turn (its 1 MB is the smaller
    # remaining); the 4 MB download behind it must not wait for it: after _GATE_STALL_S (1 s)
    # without an acknowledged byte the turn passes on, so 4 MB takes its solo time + ~1 s,
    # not the 20 s the stalled client sleeps.
    if testbed.mode != "htb":
        pytest.skip("HTB suffices: the gate is the same code for both band layouts")
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        p = _serve(testbed, "srpt", tmp / "stats.json", *LOW_CUTS, "--lowest-writers", "1")
        stalled = subprocess.Popen(
            [*testbed.exec_prefix(testbed.cli_ns), sys.executable, "-c", _STALLED_CLIENT,
             testbed.srv_ip, str(MID), "20"], stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert stalled.stdout is not None and stalled.stdout.readline().startswith("sent")
            t = _times(testbed, [(0.3, BIG)], tmp)
        finally:
            stalled.kill()
            stalled.communicate()  # also closes its pipe
            _stop(p)
        st = json.loads((tmp / "stats.json").read_text())
    link = 10e6 / 8 * 0.94
    assert st["bands"]["turn_waits"].get("6", 0) >= 1, st  # the 4 MB flow did queue behind the stalled one
    assert t[BIG] <= BIG / link + 1.0 + 1.5, t  # solo ~3.4 s + the 1 s stall + slack, not 20 s
