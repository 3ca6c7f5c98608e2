"""Shared by the controller tests: a real Apache loading mod_overtake_prio's admission gate, and
for the sidecar-as-a-process tests a module-wide scratch directory and stub upstream."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.private_apache import private_apache
from support.service_helpers import StubApache
from support.sqlite_lock import SQLITE_DRIVER, conf_with_lock

from overtake.controller.harness import apache
from overtake.controller.harness.apache.cpu_priority import CpuPriority
from overtake.controller.harness.scratch import free_port, scratch_dir

#: seconds a gated request waits for a gate that never opens (the gate_apache fixture)
GATE_TIMEOUT = 1.5


@pytest.fixture(scope="module")
def gate_apache(apache_available: None) -> Iterator[tuple[apache.ApacheInstance, str]]:
    """A private Apache with mod_overtake_prio's admission gate on a fresh file path (Apache creates
    it empty, and its key; the test's Gate or sidecar writes it), age levels off and an idle level
    for idle starts."""
    if os.geteuid() != 0 or shutil.which("apxs") is None:
        pytest.skip("needs root and apxs (apache2-dev): mod_overtake_prio")
    parent = scratch_dir("overtake-gate-test-")
    path = f"/dev/shm/overtake-gate-test-{os.getpid()}-{free_port()}"
    cores = sorted(os.sched_getaffinity(0))
    inst = apache.start(parent / "wd", f"127.0.0.1:{free_port()}", cpu=cores[-1] if len(cores) > 1 else None,
                        max_workers=16, cpu_priority=CpuPriority(levels=(3600.0,), nice=("idle",), age=False,
                                                                 class_header=None, gate=path, gate_timeout=GATE_TIMEOUT))
    try:
        yield inst, path
    finally:
        apache.stop(inst.workdir, graceful=False)
        for p in (path, path + ".key"):  # the module creates both
            Path(p).unlink(missing_ok=True)
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture(scope="module")
def prio_apache(apache_available: None) -> Iterator[apache.ApacheInstance]:
    """A private Apache with mod_overtake_prio's CPU levels, one per test module: age thresholds far
    above the tests' requests, so that every level change is the class header's."""
    if os.geteuid() != 0 or shutil.which("apxs") is None:
        pytest.skip("needs root and apxs (apache2-dev): the module restores www-data threads")
    with private_apache("overtake-side-prio-", CpuPriority(levels=(30.0,), nice=("idle",)), max_workers=16) as inst:
        yield inst


@pytest.fixture
def lock_apache(apache_available: None) -> Iterator[apache.ApacheInstance]:
    """A private Apache with a real lock (support.sqlite_lock's ``/locked``) and mod_overtake_prio
    logging each request's time inside Apache; one level, no age demotions, no class header."""
    if os.geteuid() != 0 or shutil.which("apxs") is None:
        pytest.skip("needs root and apxs (apache2-dev): mod_overtake_prio")
    if not SQLITE_DRIVER.exists():
        pytest.skip(f"{SQLITE_DRIVER} missing (libaprutil1-dbd-sqlite3): run apache-conf/install-debian-packages.sh")
    prio = CpuPriority(levels=(3600.0,), nice=("idle",), age=False, class_header=None, request_times=True)
    with private_apache("overtake-lock-test-", prio, max_workers=96, conf=conf_with_lock) as inst:
        yield inst


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch directory shared by one test module."""
    return tmp_path_factory.mktemp("work")


@pytest.fixture(scope="module")
def stub() -> Iterator[StubApache]:
    """service_helpers' loopback stand-in for Apache, one per test module."""
    s = StubApache()
    try:
        yield s
    finally:
        s.close()
