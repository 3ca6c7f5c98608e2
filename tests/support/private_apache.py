"""A private Apache loading mod_overtake_prio for one fixture: in a scratch folder, on the last
core when there are two or more (the tests' clients run on the others), stopped and removed after."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from overtake.controller.harness import apache
from overtake.controller.harness.apache.cpu_priority import CpuPriority
from overtake.controller.harness.scratch import free_port, scratch_dir

__all__ = ["last_core", "private_apache"]


def last_core() -> int | None:
    """The core a private Apache is pinned to: the last one, or None on a one-core machine."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[-1] if len(cores) > 1 else None


@contextmanager
def private_apache(prefix: str, cpu_priority: CpuPriority, *, max_workers: int,
                   conf: Callable[[Path], Path] | None = None) -> Iterator[apache.ApacheInstance]:
    """Apache in ``scratch_dir(prefix)`` with ``cpu_priority``; ``conf(parent)`` makes its
    templates folder (default: apache-conf/ as it is)."""
    parent = scratch_dir(prefix)
    inst = apache.start(parent / "wd", f"127.0.0.1:{free_port()}", cpu=last_core(), max_workers=max_workers,
                        conf_dir=None if conf is None else conf(parent), cpu_priority=cpu_priority)
    try:
        yield inst
    finally:
        apache.stop(inst.workdir, graceful=False)
        shutil.rmtree(parent, ignore_errors=True)
