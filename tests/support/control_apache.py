"""A private Apache whose mod_overtake_prio reads a control file (the control-file, verification
and module-mode tests share it): the file's path under /dev/shm, removed with its key afterwards."""

from __future__ import annotations

import os
import re
import shutil
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from overtake.controller.harness import apache
from overtake.controller.harness.apache.cpu_priority import CpuPriority
from overtake.controller.harness.scratch import free_port, scratch_dir


@contextmanager
def control_apache(name: str, *, pin: bool = False, **prio: Any) -> Iterator[tuple[apache.ApacheInstance, str]]:
    """Apache (32 workers; ``pin``: on the last core) with ``CpuPriority(class_header=None,
    control_file=PATH, **prio)``; yields it and PATH. Skips without root or apxs. ``mpm``,
    ``threads_per_child``, ``max_connections_per_child``, ``extra_conf``, ``max_workers`` and
    ``conf_dir`` in ``prio`` go to :func:`apache.start` instead."""
    if os.geteuid() != 0 or shutil.which("apxs") is None:
        pytest.skip("needs root and apxs (apache2-dev): mod_overtake_prio")
    parent = scratch_dir(f"overtake-{name}-test-")
    path = f"/dev/shm/overtake-{name}-{os.getpid()}-{free_port()}"
    cores = sorted(os.sched_getaffinity(0))
    extra: dict[str, Any] = {k: prio.pop(k) for k in ("mpm", "threads_per_child", "max_connections_per_child",
                                                       "extra_conf", "max_workers", "conf_dir") if k in prio}
    extra.setdefault("max_workers", 32)
    try:
        inst = apache.start(parent / "wd", f"127.0.0.1:{free_port()}",
                            cpu=cores[-1] if pin and len(cores) > 1 else None,
                            cpu_priority=CpuPriority(class_header=None, control_file=path, **prio), **extra)
        try:
            yield inst, path
        finally:
            apache.stop(inst.workdir, graceful=False)
    finally:
        for p in (path, path + ".key"):
            Path(p).unlink(missing_ok=True)
        shutil.rmtree(parent, ignore_errors=True)


def get(inst: apache.ApacheInstance, path: str, timeout: float = 120,
        headers: dict[str, str] | None = None) -> tuple[int, str]:
    """``GET path`` on the instance (with ``headers``): the status and the body."""
    req = urllib.request.Request(inst.base_url + path, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def prio_counters(inst: apache.ApacheInstance) -> dict[str, float]:
    """The module's counters from its status page (which also judges the control file in the
    answering child)."""
    text = get(inst, "/overtake-prio-status")[1]
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}
