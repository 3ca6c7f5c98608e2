"""Module mode across processes: the stage counts live in shared memory every child maps, so the
count table holds whichever child runs a request, and a child that exits leaves no count behind.

Two private Apaches with the Lua stage handler: mpm_prefork (a process per request) and mpm_event
with children of 2 threads (12 requests at once need 6 of them); both with a small
``MaxConnectionsPerChild``, so children exit and are replaced during the bursts (a new child's
first requests arrive together: they must not go on before the child has read the table). A table caps stage
``capped`` at one running request: its requests never overlap in the handler (the handler's own
spans and the PID of the process that ran each), while ``free``'s do; after the bursts no request
is counted waiting or running, none waited ``OvertakeStageHold`` (a leaked running count would make
the capped stage's next requests wait for it), and the requests counted are those answered.

mpm_event itself loses a connection now and then with children this small: a child that reaches
``MaxConnectionsPerChild`` closes its listener while the connection it accepted last may still wait
in its worker queue, and since it counts a connection only once a worker has taken it, its idle
workers may leave first; the connection is then closed unread and the client sees a reset before
any response (plain Apache without the module does the same). The client sends such a request
again, as a client may with an idempotent request (RFC 9110, 9.2.2); that it never reached the
module is checked: the module counts exactly the requests answered, not the attempts.
"""

from __future__ import annotations

import http.client
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from support.control_apache import control_apache
from support.module_stages import at_once, max_overlap, prio_status, settled, write_policy

from overtake.controller.harness import apache
from overtake.controller.harness.apache.lifecycle import pid_alive

NAMES = ("capped", "free")
URL = {"capped": "/stage1", "free": "/stage2"}
HOLD = 5.0
BURSTS, PER_STAGE = 6, 6

SERVERS: dict[str, dict[str, Any]] = {
    "prefork": {"mpm": "prefork", "max_connections_per_child": 2},
    "event-children": {"mpm": "event", "threads_per_child": 2, "max_connections_per_child": 2},
}


@pytest.fixture(scope="module", params=sorted(SERVERS))
def served(request: pytest.FixtureRequest, apache_available: None) -> Iterator[tuple[apache.ApacheInstance, str]]:
    with control_apache(f"module-{request.param}", levels=(0.5,), nice=("idle",), stage_hold=HOLD,
                        stages=(("capped", "^/stage1$"), ("free", "^/stage2$")), **SERVERS[request.param]) as s:
        yield s


def _get(inst: apache.ApacheInstance, path: str) -> tuple[int, str | None, str | None]:
    with urllib.request.urlopen(inst.base_url + path, timeout=60) as r:
        r.read()
        return r.status, r.headers.get("X-Handler-Span-us"), r.headers.get("X-Handler-Pid")


def _get_again_if_reset(inst: apache.ApacheInstance, path: str,
                        resets: list[str]) -> tuple[int, str | None, str | None]:
    """:func:`_get`, sent again (twice at most) after a connection closed before any response;
    each such close appended to ``resets``."""
    for _ in range(2):
        try:
            return _get(inst, path)
        except (ConnectionResetError, http.client.RemoteDisconnected) as e:
            resets.append(f"{path}: {e!r}")
    return _get(inst, path)


def _burst(inst: apache.ApacheInstance, resets: list[str]) -> list[tuple[str, int, int, int]]:
    """PER_STAGE requests of each stage at once: (stage, begin µs, end µs, pid) each."""
    def one(stage: str) -> tuple[str, int, int, int]:
        status, span, pid = _get_again_if_reset(inst, f"{URL[stage]}?work=0.05&trace=1", resets)
        assert status == 200 and span is not None and pid is not None
        b, e = (int(v) for v in span.split())
        return stage, b, e, int(pid)

    return at_once([s for _ in range(PER_STAGE) for s in NAMES], one)


def test_the_table_holds_across_processes_and_exiting_children_leak_no_count(
        served: tuple[apache.ApacheInstance, str]) -> None:
    inst, path = served
    gen = write_policy(path, "pi(1,8)", NAMES)
    deadline = time.monotonic() + 10
    while prio_status(inst)["overtake_stage_table_generation"] != gen:  # the answering child has it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    before = settled(inst, NAMES)
    resets: list[str] = []
    runs = [_burst(inst, resets) for _ in range(BURSTS)]
    free_overlaps = []
    for run in runs:
        assert max_overlap([(b, e) for s, b, e, _ in run if s == "capped"]) == 1, run
        free_overlaps.append(max_overlap([(b, e) for s, b, e, _ in run if s == "free"]))
    assert max(free_overlaps) > 1, free_overlaps  # the other stage is not held
    pids = {pid for run in runs for *_, pid in run}
    assert len(pids) >= 3, pids  # run by several processes ...
    assert any(not pid_alive(p) for p in {pid for *_, pid in runs[0]}), pids  # ... and a child exited
    st = settled(inst, NAMES)
    for s in NAMES:
        assert st[f'overtake_stage_waiting{{stage="{s}"}}'] == 0
        assert st[f'overtake_stage_active{{stage="{s}"}}'] == 0
        counted = st[f'overtake_stage_requests_total{{stage="{s}"}}'] - before[f'overtake_stage_requests_total{{stage="{s}"}}']
        assert counted == BURSTS * PER_STAGE, (s, counted, resets)  # answered ones, not attempts
        assert st[f'overtake_stage_hold_timeouts_total{{stage="{s}"}}'] == before[
            f'overtake_stage_hold_timeouts_total{{stage="{s}"}}']
    assert st['overtake_stage_held_total{stage="capped"}'] > before['overtake_stage_held_total{stage="capped"}']


def test_a_completion_in_a_child_that_missed_a_new_table_decides_by_the_new_one(
        served: tuple[apache.ApacheInstance, str], request: pytest.FixtureRequest) -> None:
    """Under prefork a process runs one request at a time: a long request of ``capped`` started
    under a table that lets 8 of them run ends after a new table caps the stage at one. Five short
    ones arrived meanwhile (held: the long one runs); its process, which started no request since
    the change, decides at its end: by the new table, one starts, not five."""
    if served[0].mpm != "prefork":
        pytest.skip("prefork: the long request's process starts no other request meanwhile")
    inst, path = served
    gen = write_policy(path, "pi(8,1)", NAMES)
    deadline = time.monotonic() + 10
    while prio_status(inst)["overtake_stage_table_generation"] != gen:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with ThreadPoolExecutor(6) as ex:
        long = ex.submit(_get, inst, "/stage1?work=1.5&trace=1")
        time.sleep(0.5)  # it runs
        gen2 = write_policy(path, "pi(1,8)", NAMES)
        while prio_status(inst)["overtake_stage_table_generation"] != gen2:  # a status child reads it
            time.sleep(0.02)
        short = [ex.submit(_get, inst, "/stage1?work=0.1&trace=1") for _ in range(5)]
        spans = [long.result(timeout=60)] + [f.result(timeout=60) for f in short]
    assert all(s == 200 and span for s, span, _ in spans)
    ranges = [tuple(int(v) for v in span.split()) for _, span, _ in spans if span]
    assert max_overlap(ranges[1:]) == 1, ranges  # type: ignore[arg-type]
