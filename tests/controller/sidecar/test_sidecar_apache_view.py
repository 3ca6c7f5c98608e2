"""What the sidecar says about a real private Apache: its worker limit under both stock MPMs, and
its health when Apache goes down and comes back.

Known answers: an Apache started with MaxRequestWorkers 16 has a 16-slot scoreboard under
event (children of 4 threads, started on demand) and under prefork (5 processes started), while
the processes running at start hold fewer workers than that; the sidecar's start-up warning
names 16, and says nothing when ``limits.max_inflight`` fits; it is logged before the sidecar
answers, even when Apache's status page answers late, and when the status page cannot be read at
start the sidecar says so and warns at the first scrape that reads it. ``/-/healthz`` turns 503
``degraded`` naming Apache's address within a few scrapes of Apache stopping, ``/-/livez``
stays 200, and health returns once Apache is back.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.service_helpers import STAGES, SidecarProc
from support.slow_status import SlowStatus

from overtake.controller.harness import apache
from overtake.controller.harness.scratch import free_port, scratch_dir
from overtake.controller.sidecar.apache_probe import max_request_workers


@pytest.fixture(scope="module")
def parent(apache_available: None) -> Iterator[Path]:
    d = scratch_dir("overtake-admin-view-")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _warnings(s: SidecarProc) -> list[str]:
    return [e["detail"] for e in s.events() if e.get("event") == "config_warning"]


@pytest.mark.parametrize(("mpm", "threads_per_child"), [("event", 4), ("prefork", None)])
def test_worker_limit_comes_from_the_scoreboard(parent: Path, work: Path, mpm: str,
                                                threads_per_child: int | None) -> None:
    """MaxRequestWorkers 16: the scoreboard has 16 slots while BusyWorkers + IdleWorkers (what
    main read) counts only the running processes; the warning names 16 for a hard cap of 20 and
    is absent for 12 (main warned of 4 workers under event, 5 under prefork, in both cases)."""
    inst = apache.start(parent / mpm, f"127.0.0.1:{free_port()}", max_workers=16, mpm=mpm,
                        threads_per_child=threads_per_child, raise_priority=False)
    try:
        st = apache.fetch_status(inst.listen)
        assert st["ServerMPM"] == mpm
        assert max_request_workers(st) == 16, st
        running = int(st["BusyWorkers"]) + int(st["IdleWorkers"])
        assert running < 16, st  # the reading this replaces would be wrong here
        for cap, warned in ((20, True), (12, False)):
            stages = STAGES.replace("max_inflight: 8", f"max_inflight: {cap}")
            s = SidecarProc(work, ["--policy", "pi(1)", "--apache", inst.base_url], stages=stages)
            try:
                found = _warnings(s)
            finally:
                s.stop()
            if warned:
                assert len(found) == 1 and f"limits.max_inflight = {cap} but Apache has 16 workers" in found[0], found
            else:
                assert found == [], found
        print(f"{mpm}: scoreboard 16 slots, {running} workers running at start")
    finally:
        apache.stop(inst.workdir, graceful=False)


@pytest.fixture(scope="module")
def apache16(parent: Path) -> Iterator[apache.ApacheInstance]:
    """An event-MPM Apache with MaxRequestWorkers 16."""
    inst = apache.start(parent / "workers16", f"127.0.0.1:{free_port()}", max_workers=16, raise_priority=False)
    try:
        yield inst
    finally:
        apache.stop(inst.workdir, graceful=False)


@contextlib.contextmanager
def _slow_sidecar(inst: apache.ApacheInstance, work: Path, delay: float) -> Iterator[tuple[SidecarProc, SlowStatus]]:
    """A sidecar allowed 20 in flight, whose first read of Apache's status answers ``delay`` s late."""
    host, port = inst.listen.rsplit(":", 1)
    relay = SlowStatus((host, int(port)), delay)
    try:
        stages = STAGES.replace("max_inflight: 8", "max_inflight: 20")
        s = SidecarProc(work, ["--policy", "pi(1)", "--apache", relay.base_url, "--status-interval", "0.2"],
                        stages=stages)
        try:
            yield s, relay
        finally:
            s.stop()
    finally:
        relay.close()
    assert relay.held == 1


def test_the_worker_warning_is_logged_before_the_sidecar_answers(apache16: apache.ApacheInstance,
                                                                 work: Path) -> None:
    """Apache's status answered 1 s late (within the probe's 2 s): the warning naming 16 workers
    is in the log once the sidecar answers (it used to answer first and check later, so that a
    reader of its log at that moment, or on a loaded machine, saw no warning)."""
    with _slow_sidecar(apache16, work, 1.0) as (s, _):
        found = _warnings(s)
    assert len(found) == 1 and "limits.max_inflight = 20 but Apache has 16 workers" in found[0], found


def test_a_status_page_unread_at_start_is_said_and_checked_later(apache16: apache.ApacheInstance,
                                                                 work: Path) -> None:
    """Apache's first status answer held 5 s (the probe gives up after 2 s): a warning says the
    status could not be read and the worker limit is checked later; a later scrape reads it and
    the warning naming 16 workers follows, once (it used to say only "Apache not reachable at
    start" and never compare the limits)."""
    with _slow_sidecar(apache16, work, 5.0) as (s, _):
        first = _warnings(s)
        assert len(first) == 1, first
        assert "no answer within 2 s" in first[0] and "at the first status scrape that reads it" in first[0], first
        deadline = time.monotonic() + 20
        while len(_warnings(s)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)  # five more scrapes: the warning is not repeated
        found = _warnings(s)
    assert len(found) == 2 and "limits.max_inflight = 20 but Apache has 16 workers" in found[1], found


def _wait(s: SidecarProc, path: str, port: int, code: int, timeout: float = 10) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        got, _, body = s.request("GET", path, port=port, timeout=5)
        if got == code:
            return body
        assert time.monotonic() < deadline, (got, body, s.text()[-2000:])
        time.sleep(0.05)


def test_healthz_says_degraded_while_apache_is_down(parent: Path, work: Path) -> None:
    """Apache stopped under a running sidecar: /-/healthz 503 ``degraded: Apache at ADDR
    unreachable`` on both listeners while /-/livez stays 200; a request gets 502; once Apache
    is started again, /-/healthz is 200 ``ok`` (on main it said ``ok`` throughout)."""
    listen = f"127.0.0.1:{free_port()}"
    inst = apache.start(parent / "health", listen, max_workers=8, raise_priority=False)
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", inst.base_url, "--status-interval", "0.2"])
    try:
        assert s.request("GET", "/-/healthz")[2] == b"ok\n"
        apache.stop(inst.workdir, graceful=False)
        for port in (s.port, s.admin_port):
            body = _wait(s, "/-/healthz", port, 503)
            assert body.startswith(f"degraded: Apache at {listen} unreachable: ".encode()), body
            assert b"since " in body and body.count(b"\n") == 1, body
            assert s.request("GET", "/-/livez", port=port)[:3:2] == (200, b"ok\n")
        assert s.request("GET", "/stage2")[0] == 502
        inst = apache.start(parent / "health", listen, max_workers=8, raise_priority=False)
        assert _wait(s, "/-/healthz", s.port, 200) == b"ok\n"
    finally:
        s.stop()
        apache.stop(inst.workdir, graceful=False)
