"""The stage gate of mod_overtake_prio seen from a test: its counters, a count table written to the
control file, bursts of requests released together, and how many of them overlapped."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from overtake.controller.harness import apache
from overtake.controller.sidecar.control_file import ControlFile
from overtake.controller.sidecar.count_table import CountTable, from_policy
from overtake.controller.sidecar.policies import BaselinePolicy

__all__ = ["at_once", "config_generation", "max_overlap", "prio_status", "settled", "stages_yaml", "until", "write_policy",
           "write_table"]

J = TypeVar("J")
R = TypeVar("R")


def prio_status(inst: apache.ApacheInstance, timeout: float = 30) -> dict[str, float]:
    """The module's ``/overtake-prio-status``: every ``name value`` line."""
    with urllib.request.urlopen(inst.base_url + "/overtake-prio-status", timeout=timeout) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}


def config_generation(inst: apache.ApacheInstance) -> int:
    """Apache's ``ParentServerConfigGeneration`` (/server-status): one more at each restart."""
    with urllib.request.urlopen(inst.base_url + "/server-status?auto", timeout=30) as r:
        m = re.search(r"^ParentServerConfigGeneration: (\d+)$", r.read().decode(), re.M)
    assert m
    return int(m.group(1))


def settled(inst: apache.ApacheInstance, names: Sequence[str]) -> dict[str, float]:
    """The status once no request of any stage waits or runs (within 10 s): a request ends (its
    count drops) after its response and its log line, which the client may see first."""
    deadline = time.monotonic() + 10
    while True:
        st = prio_status(inst)
        if all(st[f'overtake_stage_{k}{{stage="{s}"}}'] == 0 for s in names for k in ("waiting", "active")) \
                or time.monotonic() > deadline:
            return st


def until(cond: Callable[[], bool], what: str, timeout: float = 10) -> None:
    """Poll ``cond`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.02)


def write_table(path: str, table: CountTable | None) -> int:
    """Write ``table`` (None: no table) to the control file at ``path``; its generation."""
    cf = ControlFile(path)
    try:
        return cf.write(2, None, table.encode() if table is not None else None)
    finally:
        cf.close()


def write_policy(path: str, policy: str, names: tuple[str, ...]) -> int:
    """Write the count table of baseline ``policy`` (``pi(k1,k2)``) for two stages; its generation."""
    return write_table(path, from_policy(BaselinePolicy(policy, 2), names))


def at_once(jobs: Sequence[J], run: Callable[[J], R]) -> list[R]:
    """``run(job)`` for every job, each in its own thread, all released together."""
    go = threading.Barrier(len(jobs))

    def one(job: J) -> R:
        go.wait(timeout=30)
        return run(job)

    with ThreadPoolExecutor(len(jobs)) as ex:
        return list(ex.map(one, jobs))


def max_overlap(spans: Sequence[tuple[float, float]]) -> int:
    """The most of the (begin, end) spans that were open at one instant."""
    events = sorted([(b, 1) for b, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1]))
    now = best = 0
    for _, d in events:
        now += d
        best = max(best, now)
    return best


def stages_yaml(capped: str, free: str) -> str:
    """The stages file of a module-mode sidecar over two stages, ``capped`` and ``free``, on the
    paths these regular expressions match (hidden classifier, 5 ms time unit)."""
    return f"""
stages:
  - name: capped
    path: {json.dumps(capped)}
  - name: free
    path: {json.dumps(free)}
limits: {{max_inflight: 16, queue_cap: 1000, queue_timeout: 30}}
classifier: {{mode: hidden, time_unit: 0.005}}
"""
