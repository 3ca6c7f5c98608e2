"""Where the CPU runs (controller.cpu_location): Apache's processes or PHP-FPM's workers."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from overtake.controller.cpu_location import CpuLocation, StackWatch, cpu_by_group, stage_stacks
from overtake.controller.harness import php_fpm as pf
from overtake.controller.harness.scratch import scratch_dir

TICK = os.sysconf("SC_CLK_TCK")


def _proc(root: Path, pid: int, comm: str, utime: float, stime: float = 0.0, cutime: float = 0.0) -> None:
    """A /proc/PID/stat as the kernel writes it (fields 14-17: utime stime cutime cstime, in ticks)."""
    ticks = [round(x * TICK) for x in (utime, stime, cutime, 0.0)]
    rest = ["S", "1", "1", "1", "0", "-1", "4194304", "0", "0", "0", "0", *map(str, ticks), "20", "0", "1", "0"]
    (root / str(pid)).mkdir(parents=True, exist_ok=True)
    (root / str(pid) / "stat").write_text(f"{pid} ({comm}) {' '.join(rest)}\n")


def test_groups_sum_own_and_reaped_children(tmp_path: Path) -> None:
    _proc(tmp_path, 10, "apache2", 1.0, 0.5, cutime=2.0)
    _proc(tmp_path, 11, "apache2", 0.25)
    _proc(tmp_path, 20, "php-fpm8.2", 3.0, 1.0)
    _proc(tmp_path, 30, "python3 (x) y", 9.0)  # a name with parentheses is read to its last ')'
    (tmp_path / "self").mkdir()
    assert cpu_by_group(tmp_path) == {"apache": 3.75, "php-fpm": 4.0}


def _metrics(loc: CpuLocation) -> dict[tuple[str, str], float]:
    reg = CollectorRegistry()
    reg.register(loc)
    return {(s.name, s.labels.get("process", "")): s.value
            for f in text_string_to_metric_families(generate_latest(reg).decode()) for s in f.samples}


def test_the_module_is_said_not_to_reach_php_fpm(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _proc(tmp_path, 10, "apache2", 1.0)
    _proc(tmp_path, 20, "php-fpm8.2", 1.0)
    loc = CpuLocation("age", proc=tmp_path, min_cpu=5.0)
    loc.sample()
    _proc(tmp_path, 20, "php-fpm8.2", 4.0)  # 3 s in FPM, none in Apache: not enough CPU yet
    loc.sample()
    assert loc.module_reaches is None
    _proc(tmp_path, 10, "apache2", 2.0)
    _proc(tmp_path, 20, "php-fpm8.2", 8.0)  # 7 s of 8 in FPM
    with caplog.at_level(logging.WARNING, logger="overtake.sidecar"):
        m = _metrics(loc)
    assert loc.module_reaches is False
    assert m[("overtake_server_cpu_seconds_total", "php-fpm")] == 8.0
    assert m[("overtake_cpu_priority_module_reaches", "")] == 0.0
    said = [r for r in caplog.records if getattr(r, "event", "") == "cpu_priority_unreachable"]
    assert len(said) == 1 and "overtake_prio PHP extension" in said[0].getMessage()
    with caplog.at_level(logging.WARNING, logger="overtake.sidecar"):
        loc.sample()  # said once
    assert len([r for r in caplog.records if getattr(r, "event", "") == "cpu_priority_unreachable"]) == 1


@pytest.mark.parametrize(("priority", "apache", "fpm"), [("age", 9.0, 1.0), ("off", 1.0, 9.0)])
def test_no_warning_when_the_module_reaches_or_is_off(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                      priority: str, apache: float, fpm: float) -> None:
    _proc(tmp_path, 10, "apache2", 0.0)
    _proc(tmp_path, 20, "php-fpm8.2", 0.0)
    loc = CpuLocation(priority, proc=tmp_path)
    loc.sample()
    _proc(tmp_path, 10, "apache2", apache)
    _proc(tmp_path, 20, "php-fpm8.2", fpm)
    with caplog.at_level(logging.WARNING, logger="overtake.sidecar"):
        m = _metrics(loc)
    assert loc.module_reaches is (apache > fpm)
    assert not [r for r in caplog.records if getattr(r, "event", "") == "cpu_priority_unreachable"]
    assert (("overtake_cpu_priority_module_reaches", "") in m) is (priority != "off")


@pytest.mark.skipif(pf.php_available() is not None, reason=str(pf.php_available()))
def test_a_real_php_fpm_pool_is_seen_burning(tmp_path: Path) -> None:
    """From this host's real /proc: a PHP-FPM worker that burns 0.5 s of CPU raises the php-fpm
    group by at least that much (other pools on the host may add to it, never take from it)."""
    work = scratch_dir("overtake-cpu-location-")
    pool = pf.start_pool(work / "pool", None, {}, scripts={
        "burn.php": "<?php function c() { $r = getrusage(); return $r['ru_utime.tv_sec'] + $r['ru_utime.tv_usec'] / 1e6; }"
                    " $t = c(); while (c() - $t < 0.5) {} echo 'ok';"})
    try:
        before = cpu_by_group()["php-fpm"]
        assert pf.fastcgi_get(pool, "burn.php") == (200, b"ok")
        after = cpu_by_group()["php-fpm"]
        assert after - before >= 0.45  # 0.5 s of user CPU, as the worker's own clock counts it
    finally:
        pool.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)


@pytest.mark.parametrize(("reaches", "php_stats_file", "served", "priority"), [
    (None, None, None, "age"), (True, None, None, "age"), (False, None, None, "off"),
    (False, "/run/php/stats", None, "age"),
    # per stage (the module's counters): every stage seen runs in PHP-FPM, out of reach
    (None, None, (0, 5), "off"), (None, "/run/php/stats", (0, 5), "age"), (None, None, (5, 0), "age")])
def test_auto_counts_on_the_module_only_where_it_reaches(reaches: bool | None, php_stats_file: str | None,
                                                         served: tuple[int, int] | None, priority: str) -> None:
    """Auto weighs its candidates with CPU priority only while the module reaches the CPU:
    not when the work runs in PHP-FPM, unless the PHP extension carries it there."""
    from types import SimpleNamespace

    from overtake.controller.sidecar.service import Sidecar

    stacks = StackWatch("age", php_extension=php_stats_file is not None)
    if served is not None:
        stacks.update(_served(*served))
    side = SimpleNamespace(cpu_location=SimpleNamespace(module_reaches=reaches), stacks=stacks,
                           options=SimpleNamespace(apache_side=SimpleNamespace(cpu_priority="age",
                                                                           php_stats_file=php_stats_file)))
    assert Sidecar._cpu_priority_in_reach(side) == priority  # type: ignore[arg-type]


SERVED = """# TYPE overtake_stage_served_total counter
overtake_stage_served_total{{stage="view",by="apache"}} {va}
overtake_stage_served_total{{stage="view",by="fcgi"}} {vf}
overtake_stage_served_total{{stage="view",by="proxy"}} 0
overtake_stage_served_total{{stage="view",by="cgi"}} 0
overtake_stage_served_total{{stage="api",by="apache"}} 0
overtake_stage_served_total{{stage="api",by="fcgi"}} 0
overtake_stage_served_total{{stage="api",by="proxy"}} 0
overtake_stage_served_total{{stage="api",by="cgi"}} 0
"""


def _served(va: int, vf: int) -> list:  # type: ignore[type-arg]
    return list(text_string_to_metric_families(SERVED.format(va=va, vf=vf)))


def test_each_stage_runs_where_most_of_its_requests_ran_and_its_lever_follows(caplog: pytest.LogCaptureFixture) -> None:
    stacks = stage_stacks(_served(3, 7), php_extension=False)
    assert stacks["view"].runs_in == "fcgi" and stacks["view"].lever.startswith("none")
    assert stacks["view"].served == {"apache": 3, "fcgi": 7, "proxy": 0, "cgi": 0}
    assert stacks["api"].runs_in is None  # nothing logged yet: no verdict
    assert stage_stacks(_served(3, 7), php_extension=True)["view"].lever.startswith("the overtake_prio PHP extension")
    assert stage_stacks(_served(8, 7), php_extension=False)["view"].lever.startswith("mod_overtake_prio")

    watch = StackWatch("age", php_extension=False)
    with caplog.at_level(logging.INFO, logger="overtake.sidecar"):
        watch.update(_served(0, 5))
        watch.update(_served(0, 9))  # the same verdict: said once
    warned = [r for r in caplog.records if getattr(r, "event", "") == "cpu_priority_unreachable"]
    said = [r for r in caplog.records if getattr(r, "event", "") == "stage_stack"]
    assert len(warned) == 1 and len(said) == 1 and "view" in warned[0].getMessage()
    assert watch.none_reached()  # auto counts on no CPU priority then
    watch.update(_served(20, 9))
    assert not watch.none_reached() and watch.info()["view"]["runs_in"] == "apache"
    assert not StackWatch("age", php_extension=False).none_reached()  # nothing seen: no verdict
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="overtake.sidecar"):
        StackWatch("off", php_extension=False).update(_served(0, 5))
    assert not [r for r in caplog.records if getattr(r, "event", "") == "cpu_priority_unreachable"]
