"""overtake_prio, the PHP extension: age priority inside PHP-FPM's workers, where the CPU runs.

A private php-fpm8.2 pool (workers as www-data, as Debian runs them) with the extension built
from apache-conf/php_overtake_prio; requests sent over FastCGI as mod_proxy_fcgi sends them. The
script burns the CPU it is asked for, then reports its own nice value and scheduling policy.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from overtake.controller.errors import SidecarInputError
from overtake.controller.harness import php_fpm as pf
from overtake.controller.harness.scratch import scratch_dir
from overtake.controller.php_prio import read_counts, read_stage_counts

# a real php-fpm whose workers' priorities and timings are checked: in the real-server group, which
# runs with every core at normal priority (tests/conftest.py)
pytestmark = [pytest.mark.skipif(pf.php_available() is not None, reason=str(pf.php_available())), pytest.mark.apache]

BURN = r"""<?php
$ms = (float)($_GET['ms'] ?? 0);
function cpu(): float {
    $t = getrusage();
    return $t['ru_utime.tv_sec'] + $t['ru_utime.tv_usec'] / 1e6 + $t['ru_stime.tv_sec'] + $t['ru_stime.tv_usec'] / 1e6;
}
$stat = explode(' ', file_get_contents('/proc/thread-self/stat'));
$start_nice = (int)$stat[18];
$c0 = cpu();
$x = 0;
do { for ($i = 0; $i < 20000; $i++) { $x += $i; } } while ((cpu() - $c0) * 1000 < $ms);
$stat = explode(' ', file_get_contents('/proc/thread-self/stat'));
echo json_encode(['start_nice' => $start_nice, 'nice' => (int)$stat[18], 'policy' => (int)$stat[40],
                  'demoted' => overtake_prio_demoted()]);
"""
SCHED_OTHER, SCHED_IDLE = 0, 5


@pytest.fixture(scope="module")
def extension() -> Iterator[Path]:
    d = scratch_dir("overtake-php-prio-")
    yield pf.build_extension(d)
    subprocess.run(["rm", "-rf", str(d)], check=False)


@pytest.fixture
def work() -> Iterator[Path]:
    """A scratch directory www-data's workers can read (pytest's own is private to root)."""
    d = scratch_dir("overtake-php-pool-")
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def _pool(extension: Path, tmp: Path, **settings: str) -> pf.FpmPool:
    tmp.mkdir(mode=0o755, exist_ok=True)
    ini = {"overtake_prio.threshold_ms": "20", "overtake_prio.stats_file": str(tmp / "stats"), **settings}
    return pf.start_pool(tmp / "pool", extension, ini, scripts={"burn.php": BURN})


def _run(pool: pf.FpmPool, ms: float, method: str = "GET", headers: dict[str, str] | None = None,
         stage: str | None = None) -> dict[str, int | bool]:
    status, body = pf.fastcgi_get(pool, "burn.php", f"ms={ms}", method=method, body=b"x=1" if method == "POST" else b"",
                                  headers=headers, params={"OVERTAKE_STAGE": stage} if stage is not None else None)
    assert status == 200, body
    out: dict[str, int | bool] = json.loads(body)
    return out


def test_a_long_request_is_demoted_and_its_worker_restored(extension: Path, work: Path) -> None:
    """A www-data worker lowers itself past the threshold and is back at nice 0 for the next
    request: it cannot raise its own priority, the extension's restorer (root, started with the
    master) does it for exactly that worker."""
    pool = _pool(extension, work)
    try:
        (worker,) = pool.worker_pids()
        assert _run(pool, 150) == {"start_nice": 0, "nice": 10, "policy": SCHED_OTHER, "demoted": True}
        assert pf.process_nice(worker) == 0
        assert _run(pool, 2) == {"start_nice": 0, "nice": 0, "policy": SCHED_OTHER, "demoted": False}
        assert pool.worker_pids() == [worker]  # the same worker served both
        c = read_counts(work / "stats")
        assert c is not None
        assert (c.requests, c.demoted, c.restore_errors, c.unreachable) == (2, 1, 0, 0)
    finally:
        pool.stop()


def test_exempt_methods_are_never_demoted(extension: Path, work: Path) -> None:
    """POST is exempt by default (on SQLite a wiki's POST holds the write lock others wait for);
    the operator's list replaces the default; the sidecar's X-Overtake-Exempt exempts too."""
    pool = _pool(extension, work)
    try:
        assert _run(pool, 100, "POST")["demoted"] is False
        assert _run(pool, 100, "GET")["demoted"] is True
        c = read_counts(work / "stats")
        assert c is not None and (c.exempt, c.demoted) == (1, 1)
    finally:
        pool.stop()
    pool = _pool(extension, work / "b", **{"overtake_prio.exempt_methods": "GET"})
    try:
        assert _run(pool, 100, "POST")["demoted"] is True
        assert _run(pool, 100, "GET")["demoted"] is False
        # a stage's cpu_exempt: the sidecar's header, as for mod_overtake_prio
        assert _run(pool, 100, "POST", {"X-Overtake-Exempt": "1"})["demoted"] is False
        assert _run(pool, 100, "POST", {"X-Overtake-Exempt": "0"})["demoted"] is True
    finally:
        pool.stop()


def test_the_sidecars_size_class_starts_a_request_low(extension: Path, work: Path) -> None:
    """With class_header on, X-Overtake-Class: 1 (the sidecar's --cpu-priority class) starts the
    request at the low level, no CPU threshold needed; exempt methods stay exempt; the worker is
    restored after it; without the setting the header is ignored."""
    pool = _pool(extension, work, **{"overtake_prio.threshold_ms": "0", "overtake_prio.class_header": "1",
                                     "overtake_prio.nice": "19"})
    try:
        (worker,) = pool.worker_pids()
        low = _run(pool, 5, headers={"X-Overtake-Class": "1"})
        assert low == {"start_nice": 19, "nice": 19, "policy": SCHED_OTHER, "demoted": True}
        assert pf.process_nice(worker) == 0
        assert _run(pool, 100, headers={"X-Overtake-Class": "0"})["demoted"] is False  # no age threshold
        assert _run(pool, 5, "POST", {"X-Overtake-Class": "1"})["demoted"] is False  # exempt first
        c = read_counts(work / "stats")
        assert c is not None and (c.requests, c.class_low, c.demoted, c.exempt) == (3, 1, 0, 1)
    finally:
        pool.stop()
    pool = _pool(extension, work / "b")  # age priority only: the header changes nothing
    try:
        assert _run(pool, 5, headers={"X-Overtake-Class": "1"})["start_nice"] == 0
    finally:
        pool.stop()


def test_idle_level_and_bounded_demotion(extension: Path, work: Path) -> None:
    """``idle`` demotes to SCHED_IDLE and back; ``max_demoted_ms`` promotes a request back after
    that much wall time at the low level, so a request that holds something finishes at normal
    priority."""
    pool = _pool(extension, work, **{"overtake_prio.idle": "1"})
    try:
        r = _run(pool, 100)
        assert (r["policy"], r["demoted"]) == (SCHED_IDLE, True)
        assert _run(pool, 1)["policy"] == SCHED_OTHER
    finally:
        pool.stop()
    pool = _pool(extension, work / "b", **{"overtake_prio.max_demoted_ms": "20"})
    try:
        r = _run(pool, 300)  # at least 280 ms of wall time after the demotion
        assert (r["nice"], r["demoted"]) == (0, False)
        c = read_counts(work / "b" / "stats")
        assert c is not None and (c.demoted, c.promoted) == (1, 1)
    finally:
        pool.stop()


@pytest.mark.parametrize(("setting", "message"), [
    ("overtake_prio.nice=25", 'overtake_prio.nice must be a whole number within 1..19 (the demoted nice level), got "25"'),
    ("overtake_prio.threshold_ms=-5", "overtake_prio.threshold_ms must be a whole number within 0..3600000"),
    ("overtake_prio.threshold_ms=40ms", 'got "40ms"'),
    ("overtake_prio.max_demoted_ms=-1", "overtake_prio.max_demoted_ms must be a whole number within 0..3600000"),
])
def test_bad_settings_name_the_setting_and_the_fix(extension: Path, setting: str, message: str) -> None:
    run = subprocess.run(["php", "-n", "-d", f"extension={extension}", "-d", setting, "-r", "echo 'ran';"],
                         capture_output=True, text=True, check=False, env={"PHP_INI_SCAN_DIR": ""})
    assert message in run.stdout + run.stderr
    assert "ran" in run.stdout  # PHP keeps the default and runs: the warning is the error


def test_the_stats_file_is_checked(work: Path) -> None:
    assert read_counts(work / "absent") is None
    (work / "short").write_bytes(b"x" * 10)
    with pytest.raises(SidecarInputError, match="not overtake_prio's stats file"):
        read_counts(work / "short")
    (work / "other").write_bytes(b"\0" * 200)
    with pytest.raises(SidecarInputError, match="magic 0x0"):
        read_counts(work / "other")
    # the layouts before this one (1: no class counter, 2: no class counter in the stage rows),
    # refused rather than misread
    for old in (1, 2):
        (work / f"v{old}").write_bytes(b"overtake"[::-1] + old.to_bytes(8, "little") + b"\0" * 2000)
        with pytest.raises(SidecarInputError, match=f"version {old}, expected 3"):
            read_stage_counts(work / f"v{old}")
        with pytest.raises(SidecarInputError, match=f"version {old}, expected 3"):
            read_counts(work / f"v{old}")


def test_the_counters_reach_the_sidecars_metrics(extension: Path, work: Path) -> None:
    """The sidecar's registry (``php_stats_file``) exports what PHP-FPM's workers did."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from overtake.controller.php_prio import PhpPrioCollector

    registry = CollectorRegistry()
    registry.register(PhpPrioCollector(work / "stats"))
    assert generate_latest(registry) == b""  # PHP-FPM not started yet: nothing, no error
    pool = _pool(extension, work)
    try:
        _run(pool, 100)
        _run(pool, 100, "POST")
        _run(pool, 1)
    finally:
        pool.stop()
    got = {(s.name, s.labels.get("stage")): s.value
           for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    assert got[("overtake_php_requests_total", "none")] == 3  # no OVERTAKE_STAGE: the stage "none"
    assert got[("overtake_php_demotions_total", "none")] == 1
    assert got[("overtake_php_exempt_requests_total", "none")] == 1
    assert got[("overtake_php_unreachable_requests_total", "none")] == 0
    assert got[("overtake_php_class_low_requests_total", "none")] == 0


def test_demotions_are_counted_by_the_stage_apache_names(extension: Path, work: Path) -> None:
    """OVERTAKE_STAGE (the FastCGI parameter mod_overtake_prio's OvertakeStage sets) labels each
    request's counters; a client's header of that name, a name OvertakeStage would refuse and no
    name count as ``none``; the stages' counts add up to the totals, and /-/metrics shows them
    with the ``stage`` label."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from overtake.controller.php_prio import PhpPrioCollector

    pool = _pool(extension, work)
    try:
        assert _run(pool, 100, stage="view")["demoted"]
        assert _run(pool, 100, stage="view")["demoted"]
        assert not _run(pool, 1, stage="edit")["demoted"]
        assert _run(pool, 100, "POST", stage="edit")["demoted"] is False  # exempt method
        assert _run(pool, 100)["demoted"]  # no stage
        assert _run(pool, 100, headers={"Overtake-Stage": "edit"})["demoted"]  # HTTP_OVERTAKE_STAGE: no stage
        assert _run(pool, 100, stage="not a name")["demoted"]
    finally:
        pool.stop()
    stages = read_stage_counts(work / "stats")
    assert stages is not None and set(stages) == {"none", "view", "edit"}, stages
    assert (stages["view"].requests, stages["view"].demoted) == (2, 2)
    assert (stages["edit"].requests, stages["edit"].demoted, stages["edit"].exempt) == (2, 0, 1)
    assert (stages["none"].requests, stages["none"].demoted) == (3, 3)
    total = read_counts(work / "stats")
    assert total is not None
    for field in ("requests", "demoted", "exempt", "promoted", "restore_errors", "unreachable", "class_low"):
        assert sum(getattr(c, field) for c in stages.values()) == getattr(total, field), field
    registry = CollectorRegistry()
    registry.register(PhpPrioCollector(work / "stats"))
    got = {(s.name, s.labels["stage"]): s.value
           for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    assert got[("overtake_php_demotions_total", "view")] == 2
    assert got[("overtake_php_demotions_total", "edit")] == 0
    assert got[("overtake_php_demotions_total", "none")] == 3


def test_the_sidecar_config_key(work: Path) -> None:
    from overtake.controller.sidecar.config import load_config, to_options

    f = work / "sidecar.yaml"
    f.write_text("apache: 127.0.0.1:8080\nlisten: 127.0.0.1:8081\nstages: stages.yaml\npolicy: pi(1)\n"
                 "php_stats_file: php-stats\n")
    assert to_options(load_config(f, {})).apache_side.php_stats_file == str(work / "php-stats")


LOCKED = r"""<?php
// A wiki edit in miniature: take SQLite's write lock (BEGIN IMMEDIATE, as MediaWiki does for
// every POST), spend CPU holding it, commit. Reports how long it waited for the lock.
function cpu(): float {
    $t = getrusage();
    return $t['ru_utime.tv_sec'] + $t['ru_utime.tv_usec'] / 1e6 + $t['ru_stime.tv_sec'] + $t['ru_stime.tv_usec'] / 1e6;
}
$db = new SQLite3($_GET['db']);
$db->busyTimeout(20000);
$t0 = microtime(true);
$db->exec('BEGIN IMMEDIATE');
$waited = microtime(true) - $t0;
$c0 = cpu();
$x = 0;
do { for ($i = 0; $i < 20000; $i++) { $x += $i; } } while ((cpu() - $c0) * 1000 < (float)$_GET['ms']);
$db->exec('INSERT INTO t VALUES (1)');
$db->exec('COMMIT');
echo json_encode(['waited' => $waited, 'demoted' => overtake_prio_demoted()]);
"""


def _lock_wait(extension: Path, work: Path, **settings: str) -> tuple[float, bool, int]:
    """Short GETs (15 ms of CPU, under the threshold) keep the pool's core busy from two clients;
    a GET takes the write lock and needs 60 ms of CPU holding it; 10 ms later an exempt POST asks
    for the lock. Returns how long the POST waited, whether the holder was demoted at its end and
    how many requests were promoted back (max_demoted_ms)."""
    import sqlite3
    import threading

    work.mkdir(mode=0o755, exist_ok=True)
    db = work / "wiki.db"
    with sqlite3.connect(db) as c:
        c.execute("CREATE TABLE t (x)")
    subprocess.run(["chown", "-R", "www-data:www-data", str(work)], check=True)
    ini = {"overtake_prio.threshold_ms": "20", "overtake_prio.idle": "1", "extension": "sqlite3",
           "overtake_prio.stats_file": str(work / "stats"), **settings}
    pool = pf.start_pool(work / "pool", extension, ini, children=4, scripts={"locked.php": LOCKED, "burn.php": BURN},
                         cpu=max(os.sched_getaffinity(0)), autogroup_nice=-20)
    stop = time.monotonic() + 2.5

    def short_requests() -> None:
        while time.monotonic() < stop:
            pf.fastcgi_get(pool, "burn.php", "ms=15")

    load = [threading.Thread(target=short_requests) for _ in range(2)]
    try:
        for t in load:
            t.start()
        time.sleep(0.2)
        holder: dict[str, Any] = {}
        t = threading.Thread(target=lambda: holder.update(json.loads(
            pf.fastcgi_get(pool, "locked.php", f"db={db}&ms=60")[1])))
        t.start()
        time.sleep(0.01)
        status, body = pf.fastcgi_get(pool, "locked.php", f"db={db}&ms=1", method="POST", body=b"x=1")
        t.join()
        assert status == 200, body
        for t in load:
            t.join()
        counts = read_counts(work / "stats")
        return float(json.loads(body)["waited"]), bool(holder["demoted"]), counts.promoted if counts else -1
    finally:
        for t in load:
            t.join()
        pool.stop()


def test_priority_inversion_on_a_real_lock_and_its_guard(extension: Path, work: Path) -> None:
    """The case where age priority hurts, then the guard. A lock holder demoted to SCHED_IDLE
    while short requests keep the pool busy barely runs, and a request waiting for its lock
    waits with it: here until the short requests stop. Bounding the demotion (max_demoted_ms)
    returns the holder to normal priority, and the waiter waits about what it waits without the
    extension. The bound is kept by the restorer: the demoted holder, at SCHED_IDLE beside busy
    workers, could not end its demotion itself in time."""
    off, _, _ = _lock_wait(extension, work / "off", **{"overtake_prio.threshold_ms": "0"})
    inverted, demoted, _ = _lock_wait(extension, work / "inverted")
    guarded, still_low, promoted = _lock_wait(extension, work / "guarded", **{"overtake_prio.max_demoted_ms": "20"})
    assert demoted
    assert inverted > 1.0 and off < 0.6, (off, inverted)  # the inversion
    assert guarded < 0.6, (off, guarded)  # the guard
    assert not still_low and promoted >= 1, (still_low, promoted)
