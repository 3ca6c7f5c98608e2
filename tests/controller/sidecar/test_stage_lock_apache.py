"""``lock: 1`` on a real Apache with a real lock: SQLite's write lock (``BEGIN IMMEDIATE`` in a
mod_lua handler, through apr_dbd's sqlite3 driver, Debian's libaprutil1-dbd-sqlite3).

The handler reports when it entered and left (Apache's wall clock, µs), so the test counts the
requests of the stage inside Apache together. A busy ``BEGIN`` sleeps in the driver and retries
(every 0.1 s), as a PHP process does in SQLite's busy handler: without the rule, requests that
arrive while the lock is held wait inside Apache and the lock idles between holders.

One trace, several trials per arm, the sidecar running ``passthrough`` (π(∞)) in both: a big
request takes the lock, two more big ones follow, then small ones. With ``lock: 1`` and
``key: [body_size]`` no two requests are ever inside the handler together, the small ones (a key
learned short in the warm-up) go before the later big ones, and their mean response time drops
against the same stages file without ``lock``. The assertions are medians over trials with wide
margins, so that a loaded 2-core machine passes and a missing rule fails.
"""

from __future__ import annotations

import shutil
import sqlite3
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.service_helpers import SidecarProc

from overtake.controller.harness import apache
from overtake.controller.harness.scratch import free_port, scratch_dir

SQLITE_DRIVER = Path("/usr/lib/x86_64-linux-gnu/apr-util-1/apr_dbd_sqlite3-1.so")
BIG, SMALL = 0.3, 0.005  # s the handler holds the lock (wall clock)
BIG_BODY, SMALL_BODY = 16384, 64  # bytes: the stage's key (body_size bins)
SMALLS = 4
TRIALS = 5
QUEUED_BY = 0.05  # s before the first big request releases the lock

# POST /locked?hold=S: BEGIN IMMEDIATE, S s of wall clock holding the lock, UPDATE, COMMIT; the
# body says when the handler was entered and left (µs).
LOCKED_LUA = """local DB = "@DB@"
local WAIT_S = 60

function handle(r)
    local t_in = r:clock()
    local hold = tonumber(r:parseargs().hold or "0") or 0
    local db, err = r:dbacquire("sqlite3", DB)
    if not db then
        r.status = 500
        r:puts("cannot open ", DB, ": ", tostring(err), "\\n")
        return apache2.OK
    end
    local deadline = os.time() + WAIT_S
    local ok, qerr = db:query(r, "BEGIN IMMEDIATE")
    while not ok and os.time() <= deadline do
        ok, qerr = db:query(r, "BEGIN IMMEDIATE")
    end
    if not ok then
        db:close()
        r.status = 500
        r:puts("no write lock: ", tostring(qerr), "\\n")
        return apache2.OK
    end
    local until_us = r:clock() + math.floor(hold * 1e6)
    local x = 0
    while r:clock() < until_us do for i = 1, 200 do x = x + (i % 7) end end
    ok = db:query(r, "UPDATE tx SET n = n + 1")
    db:query(r, ok and "COMMIT" or "ROLLBACK")
    db:close()
    r.content_type = "text/plain"
    r:puts(string.format("%d %d\\n", t_in, r:clock()))
    return apache2.OK
end
"""


def _stages(lock: bool) -> str:
    return ("stages:\n"
            "  - name: write\n"
            "    routes: [{path: '^/locked$', methods: [POST], key: [body_size]}]\n"
            + ("    lock: 1\n" if lock else "")
            + "limits: {max_inflight: 64, queue_cap: 100, queue_timeout: 60, upstream_timeout: 120}\n")


@pytest.fixture(scope="module")
def locked_apache(apache_available: None) -> Iterator[apache.ApacheInstance]:
    if not SQLITE_DRIVER.exists():
        pytest.skip(f"{SQLITE_DRIVER} missing (libaprutil1-dbd-sqlite3): run apache-conf/install-debian-packages.sh")
    parent = scratch_dir("overtake-stage-lock-")
    conf = parent / "conf"
    shutil.copytree(apache.DEFAULT_CONF_DIR, conf, ignore=shutil.ignore_patterns("__pycache__"))
    dbdir = parent / "db"
    dbdir.mkdir()
    db = dbdir / "lock.sqlite"
    c = sqlite3.connect(db)
    with c:
        c.execute("CREATE TABLE tx (n INTEGER)")
        c.execute("INSERT INTO tx VALUES (0)")
    c.close()
    try:
        for p in (dbdir, db):  # SQLite writes its journal next to the database
            shutil.chown(p, "www-data", "www-data")
    except (PermissionError, LookupError):
        pass  # Apache runs as this user
    (conf / "lua" / "locked.lua").write_text(LOCKED_LUA.replace("@DB@", str(db)))
    with (conf / "httpd.conf.in").open("a") as f:
        f.write('\nLuaMapHandler "^/locked$" "@APACHE_DIR@/lua/locked.lua" handle\n')
    inst = apache.start(parent / "wd", f"127.0.0.1:{free_port()}", max_workers=32, conf_dir=conf)
    try:
        yield inst
    finally:
        apache.stop(inst.workdir, graceful=False)
        shutil.rmtree(parent, ignore_errors=True)


def _post(side: SidecarProc, hold: float, size: int, out: list[tuple[float, float, float, float, float]]) -> None:
    """One locked request: (hold, response time s, handler entry µs, handler exit µs, sent µs)."""
    sent = time.time() * 1e6  # the handler's clock: wall-clock microseconds
    t0 = time.monotonic()
    code, _, body = side.request("POST", f"/locked?hold={hold}", body=b"x" * size, timeout=60)
    rt = time.monotonic() - t0
    assert code == 200, body
    t_in, t_out = (float(v) for v in body.split())
    out.append((hold, rt, t_in, t_out, sent))


def _trial(side: SidecarProc) -> list[tuple[float, float, float, float, float]]:
    """The trace: big ones at 0, 0.02 and 0.04 s, SMALLS small ones at 0.06 s (all while the first
    holds the lock)."""
    out: list[tuple[float, float, float, float, float]] = []
    plan = [(0.0, BIG, BIG_BODY), (0.02, BIG, BIG_BODY), (0.04, BIG, BIG_BODY)] + [(0.06, SMALL, SMALL_BODY)] * SMALLS
    threads = []
    t0 = time.monotonic()
    for at, hold, size in plan:
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        th = threading.Thread(target=_post, args=(side, hold, size, out))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    assert len(out) == len(plan)
    return out


def _inside_together(rows: list[tuple[float, float, float, float, float]]) -> int:
    """Most handler executions overlapping at one instant."""
    events = sorted([(r[2], 1) for r in rows] + [(r[3], -1) for r in rows], key=lambda e: (e[0], e[1]))
    n = most = 0
    for _, d in events:
        n += d
        most = max(most, n)
    return most


def _run_arm(tmp: Path, apache_url: str, lock: bool) -> tuple[list[float], list[int], list[bool | None], str]:
    side = SidecarProc(tmp, ["--policy", "passthrough", "--apache", apache_url], stages=_stages(lock))
    try:
        warm: list[tuple[float, float, float, float, float]] = []
        for _ in range(2):  # teaches the keys their holding times
            _post(side, BIG, BIG_BODY, warm)
            _post(side, SMALL, SMALL_BODY, warm)
        small_means: list[float] = []
        together: list[int] = []
        smalls_first: list[bool | None] = []
        for _ in range(TRIALS):
            rows = _trial(side)
            small_means.append(statistics.fmean(r[1] for r in rows if r[0] == SMALL))
            together.append(_inside_together(rows))
            bigs = sorted((r[2], r[3]) for r in rows if r[0] == BIG)
            smalls = [r for r in rows if r[0] == SMALL]
            # only a trial whose small requests were all sent while the first big one still held the
            # lock (by QUEUED_BY s) has an order to check: one the client sent late has nothing to overtake
            if max(r[4] for r in smalls) <= bigs[0][1] - QUEUED_BY * 1e6:
                smalls_first.append(all(r[3] <= min(b[0] for b in bigs[1:]) for r in smalls))
            else:
                smalls_first.append(None)
        metrics = side.request("GET", "/-/metrics")[2].decode()
        return small_means, together, smalls_first, metrics
    finally:
        side.stop()


def test_lock_one_serialises_the_stage_in_the_sidecar(locked_apache: apache.ApacheInstance, tmp_path: Path) -> None:
    plain = _run_arm(tmp_path, locked_apache.base_url, lock=False)
    locked = _run_arm(tmp_path, locked_apache.base_url, lock=True)
    detail = (f"small requests' mean response time per trial, s: no lock {[round(x, 3) for x in plain[0]]}, "
              f"lock: 1 {[round(x, 3) for x in locked[0]]}; most inside together: no lock {plain[1]}, "
              f"lock: 1 {locked[1]}; smalls before the later bigs: {locked[2]}")
    print(detail)
    # without the rule the requests wait for the lock inside Apache ...
    assert max(plain[1]) > 1, detail
    # ... with it never two in the handler at once, and the short ones go first
    assert locked[1] == [1] * TRIALS, detail
    checked = [first for first in locked[2] if first is not None]
    assert len(checked) >= TRIALS - 2 and all(checked), detail
    assert statistics.median(locked[0]) <= 0.8 * statistics.median(plain[0]), detail
    waited = [line for line in locked[3].splitlines()
              if line.startswith('overtake_stage_lock_wait_seconds_total{stage="write"}')]
    assert waited and float(waited[0].rsplit(" ", 1)[1]) > 0, locked[3][-2000:]
