"""Module mode as admission against PHP-FPM's pool: a private php-fpm pool behind a private Apache
(mpm_event + ``ProxyPassMatch`` to ``fcgi://``), ``OvertakeStage`` on the two PHP scripts.

The Apache worker that forwards a request to PHP-FPM counts as running in its stage until FPM has
answered, so a count table that caps a stage at one request never lets two of its requests into
FPM's workers at once. Seen from PHP: each script reports its own start and end
(``microtime``) and its worker's PID. With the table's total cap at ``pm.max_children``, FPM's
listen queue stays empty (its status page's ``max listen queue``): the held requests wait in
Apache, not in FPM's FIFO. Without a table (Apache's default) the same burst overlaps in the capped
stage and queues in FPM: the observation can fail.

A third stage (``lua``) is served by Apache's own handler. The module counts where each stage's
work ran (``overtake_stage_served_total{by}``); a module-mode sidecar says per stage where it runs
and which CPU lever reaches it (``/-/policy``'s ``stacks``, its log), warns that
``--cpu-priority age`` cannot reach the PHP stages without the overtake_prio PHP extension, and with
the extension's counters (``--php-stats-file``) shows FPM-side demotions on its ``/-/metrics``, by
the stage Apache matched (``OvertakeStage`` reaches PHP as the FastCGI parameter ``OVERTAKE_STAGE``).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.control_apache import control_apache
from support.module_stages import at_once, max_overlap, stages_yaml, write_policy
from support.service_helpers import SidecarProc

from overtake.controller.harness import apache
from overtake.controller.harness import php_fpm as pf
from overtake.controller.harness.scratch import free_port, scratch_dir

pytestmark = pytest.mark.skipif(pf.php_available() is not None, reason=str(pf.php_available()))

NAMES = ("capped", "free")
CHILDREN = 3  # pm.max_children: the policy pi(1,2)'s total cap
SPAN = r"""<?php
$t0 = microtime(true);
usleep((int)(1e6 * (float)($_GET['s'] ?? 0)));
header(sprintf('X-Php-Span: %.6f %.6f %d', $t0, microtime(true), getmypid()));
echo "ok\n";
"""
BURN = r"""<?php
$c0 = getrusage();
$t = fn($u) => $u['ru_utime.tv_sec'] + $u['ru_utime.tv_usec'] / 1e6;
$x = 0;
do { for ($i = 0; $i < 20000; $i++) { $x += $i; } } while (($t(getrusage()) - $t($c0)) * 1000 < (float)($_GET['ms'] ?? 0));
echo json_encode(['demoted' => overtake_prio_demoted()]);
"""


@pytest.fixture(scope="module")
def fpm_apache(apache_available: None) -> Iterator[tuple[apache.ApacheInstance, str, pf.FpmPool]]:
    work = scratch_dir("overtake-module-fpm-")  # www-data's workers read the scripts
    work.chmod(0o755)
    ext = pf.build_extension(work / "ext")
    pool = pf.start_pool(work / "pool", ext, {"overtake_prio.threshold_ms": "20",
                                              "overtake_prio.stats_file": str(work / "php-stats")},
                         children=CHILDREN, pool={"pm.status_path": "/fpm-status"},
                         scripts={"capped.php": SPAN, "free.php": SPAN, "burn.php": BURN})
    try:
        with control_apache("module-fpm", levels=(0.5,), nice=("idle",), stage_hold=30.0, mpm="event",
                            stages=(("capped", r"^/capped\.php$"), ("free", r"^/free\.php$"),
                                    ("lua", "^/stage1$"), ("burn", r"^/burn\.php$")),
                            extra_conf=pf.proxy_conf(pool)) as (inst, path):
            yield inst, path, pool
    finally:
        pool.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)


def _get(inst: apache.ApacheInstance, path: str) -> tuple[int, str | None]:
    with urllib.request.urlopen(inst.base_url + path, timeout=60) as r:
        r.read()
        return r.status, r.headers.get("X-Php-Span")


def _burst(inst: apache.ApacheInstance, n: int, seconds: float) -> dict[str, list[tuple[float, float]]]:
    """n requests of each stage at once; PHP's own spans per stage."""
    out = at_once([s for _ in range(n) for s in NAMES], lambda stage: (stage, _get(inst, f"/{stage}.php?s={seconds}")))
    spans: dict[str, list[tuple[float, float]]] = {s: [] for s in NAMES}
    for stage, (status, span) in out:
        assert status == 200 and span is not None, (status, span)
        b, e, _ = span.split()
        spans[stage].append((float(b), float(e)))
    return spans


def _generation(inst: apache.ApacheInstance) -> float:
    with urllib.request.urlopen(inst.base_url + "/overtake-prio-status", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("overtake_stage_table_generation "):
                return float(line.split()[1])
    raise AssertionError("no overtake_stage_table_generation")


def _until_generation(inst: apache.ApacheInstance, gen: int) -> None:
    deadline = time.monotonic() + 10
    while _generation(inst) != gen:
        assert time.monotonic() < deadline, f"generation {gen} not in force"
        time.sleep(0.05)


def test_a_stage_capped_at_one_never_overlaps_in_fpm_and_fpm_never_queues(
        fpm_apache: tuple[apache.ApacheInstance, str, pf.FpmPool]) -> None:
    inst, path, pool = fpm_apache
    _until_generation(inst, write_policy(path, "pi(1,2)", NAMES))
    before = pf.fpm_status(pool)
    assert int(before["max listen queue"]) == 0, before
    spans = _burst(inst, 5, 0.6)
    assert max_overlap(spans["capped"]) == 1, spans["capped"]
    assert max_overlap(spans["free"]) == 2, spans["free"]  # the other stage runs two at once
    after = pf.fpm_status(pool)
    assert int(after["accepted conn"]) - int(before["accepted conn"]) == 10 + 1  # + the status request
    assert int(after["max listen queue"]) == 0, after  # the held requests waited in Apache
    assert int(after["max active processes"]) <= CHILDREN

    # Apache's default (no table): the same burst overlaps in the capped stage and queues in FPM
    write_policy(path, "passthrough", NAMES)
    _until_generation(inst, 0)  # no stage section: no table in force
    spans = _burst(inst, 5, 0.6)
    assert max_overlap(spans["capped"]) > 1, spans["capped"]
    assert int(pf.fpm_status(pool)["max listen queue"]) > 0


def _served(inst: apache.ApacheInstance) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(inst.base_url + "/overtake-prio-status", timeout=10) as r:
        text = r.read().decode()
    return {(m.group(1), m.group(2)): float(m.group(3)) for m in re.finditer(
        r'^overtake_stage_served_total\{stage="([^"]+)",by="([^"]+)"\} (\S+)$', text, re.M)}


def _stacks(side: SidecarProc) -> dict[str, dict[str, str]]:
    """``/-/policy``'s stacks once the sidecar has read the module's counters and logged its start
    (its admin listener answers before)."""
    deadline = time.monotonic() + 30
    while True:
        info = json.loads(side.request("GET", "/-/policy")[2])
        if "stacks" in info and any(e.get("event") == "start" for e in side.events()):
            return info["stacks"]  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, side.text()[-3000:]
        time.sleep(0.2)


def test_where_each_stage_runs_is_counted_said_and_the_unreachable_lever_not_claimed(
        fpm_apache: tuple[apache.ApacheInstance, str, pf.FpmPool], tmp_path: Path) -> None:
    inst, path, pool = fpm_apache
    before = _served(inst)
    for p in ("/capped.php?s=0", "/free.php?s=0", "/stage1?work=0", "/burn.php?ms=60"):
        assert _get(inst, p)[0] == 200
    served = _served(inst)
    for stage, by in (("capped", "fcgi"), ("free", "fcgi"), ("lua", "apache"), ("burn", "fcgi")):
        assert served[(stage, by)] - before.get((stage, by), 0) == 1, served
        assert all(served[(stage, b)] == before.get((stage, b), 0) for b in ("apache", "fcgi", "proxy", "cgi")
                   if b != by), served

    # cpu_priority age without the PHP extension's counters: the PHP stages are out of its reach
    stages = STAGES_ALL
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    admin = free_port()
    side = SidecarProc(tmp_path / "a", ["--policy", "passthrough", "--apache", inst.base_url, "--control-file",
                                        path, "--enforce", "module", "--cpu-priority", "age", "--status-interval",
                                        "0.5", "--admin-listen", f"127.0.0.1:{admin}"], stages=stages,
                       ready_port=admin)
    try:
        stacks = _stacks(side)
        assert stacks["capped"]["runs_in"] == "fcgi" and stacks["capped"]["lever"].startswith("none"), stacks
        assert stacks["lua"]["runs_in"] == "apache" and stacks["lua"]["lever"].startswith("mod_overtake_prio")
        start = next(e for e in side.events() if e.get("event") == "start")
        assert "stage capped: runs in a FastCGI server (PHP-FPM)" in str(start["detail"]), start
        unreachable = {e["detail"]["stage"] for e in side.events()  # type: ignore[index]
                       if e.get("event") == "cpu_priority_unreachable"}
        assert unreachable == {"capped", "free", "burn"}, side.text()[-3000:]
    finally:
        side.stop()

    # with them: the extension reaches the PHP stages, and its demotions are on /-/metrics
    admin = free_port()
    side = SidecarProc(tmp_path / "b", ["--policy", "passthrough", "--apache", inst.base_url, "--control-file",
                                        path, "--enforce", "module", "--cpu-priority", "age", "--php-stats-file",
                                        pool.settings["overtake_prio.stats_file"], "--status-interval", "0.5",
                                        "--admin-listen", f"127.0.0.1:{admin}"], stages=stages, ready_port=admin)
    try:
        stacks = _stacks(side)
        assert stacks["capped"]["lever"].startswith("the overtake_prio PHP extension"), stacks
        assert not [e for e in side.events() if e.get("event") == "cpu_priority_unreachable"], side.text()[-3000:]
        metrics = side.request("GET", "/-/metrics")[2].decode()
        # by the stage Apache matched: OvertakeStage reaches PHP as OVERTAKE_STAGE
        m = re.search(r'^overtake_php_demotions_total\{stage="burn"\} (\S+)$', metrics, re.M)
        assert m and float(m.group(1)) >= 1, metrics[-3000:]
        assert 'overtake_stage_served_total{by="fcgi",stage="capped"}' in metrics \
            or 'overtake_stage_served_total{stage="capped",by="fcgi"}' in metrics
    finally:
        side.stop()


STAGES = stages_yaml(r"^/capped\.php$", r"^/free\.php$")


def test_a_module_mode_sidecar_warns_when_the_pool_is_smaller_than_the_policy(
        fpm_apache: tuple[apache.ApacheInstance, str, pf.FpmPool], tmp_path: Path) -> None:
    """``--fpm-pool-config``: pi(1,8) may run 9 requests, the pool has 3 workers: a warning naming
    pm.max_children at start; a PUT of pi(1,2) (3 at once) gives none."""
    inst, path, pool = fpm_apache
    admin = free_port()
    side = SidecarProc(tmp_path, ["--policy", "pi(1,8)", "--apache", inst.base_url, "--control-file", path,
                                  "--enforce", "module", "--fpm-pool-config", str(pool.workdir / "php-fpm.conf"),
                                  "--admin-listen", f"127.0.0.1:{admin}"], stages=STAGES, ready_port=admin)
    try:
        warned = [e for e in side.events() if e.get("event") == "config_warning" and "pm.max_children" in str(e)]
        assert len(warned) == 1, side.text()[-3000:]
        assert "pm.max_children = 3" in str(warned[0]["detail"]) and "raise pm.max_children to 9" in str(warned[0])
        assert side.request("PUT", "/-/policy", body=b"pi(1,2)")[0] == 200
        time.sleep(0.5)
        assert len([e for e in side.events() if e.get("event") == "config_warning"
                    and "pm.max_children" in str(e)]) == 1
    finally:
        side.stop()


STAGES_ALL = STAGES.replace("limits:", """  - name: lua
    path: "^/stage1$"
  - name: burn
    path: "^/burn\\\\.php$"
limits:""")
