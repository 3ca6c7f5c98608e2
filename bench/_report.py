"""Shared by the bench scripts: the machine line and BENCHMARKS.md's marked sections.

Each script owns one section between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` and
rewrites only that, so scripts run at different times never overwrite each other's figures.
"""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """One line: cores, CPU, Python, and the load average now (the machine is shared)."""
    return (f"{os.cpu_count()} cores, {cpu_model()}, Python {platform.python_version()}, "
            f"load average {os.getloadavg()[0]:.1f}")


def write_section(name: str, text: str, path: Path = BENCHMARKS) -> None:
    """Replace (or append) the section ``name`` of BENCHMARKS.md with ``text``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    cur = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    if begin in cur and end in cur:
        cur = cur[: cur.index(begin)] + block + cur[cur.index(end) + len(end):]
    else:
        cur = cur.rstrip() + "\n\n" + block + "\n"
    path.write_text(cur)


HALT_POLL = Path("/sys/module/haltpoll/parameters")


@contextlib.contextmanager
def halt_polling(ns: int) -> Iterator[int | None]:
    """Let idle vCPUs poll up to ``ns`` before halting (cpuidle-haltpoll), restored on exit.

    Why: on this KVM guest ``guest_halt_poll_ns`` is 0, so a vCPU that idles for a few
    milliseconds halts in the hypervisor and the next wake-up costs ~0.4 ms. In the Table 2
    bench the sidecar's core idles while Apache burns a request, and that wake-up lands between
    a completion and the next release — CPU idle time that only the policies which hold
    requests back pay (measured: 0.6-0.8 ms a release at 0 ns, 0.17 ms at 20 ms of polling).
    Yields the value in effect, or None where the knob is absent or not writable (not root).
    """
    knob, shrink = HALT_POLL / "guest_halt_poll_ns", HALT_POLL / "guest_halt_poll_allow_shrink"
    def restore() -> None:
        knob.write_text(old[0])
        shrink.write_text(old[1])

    try:
        old = (knob.read_text(), shrink.read_text())
    except OSError:
        yield None
        return
    try:
        knob.write_text(f"{int(ns)}\n")
        shrink.write_text("N\n")  # the governor would otherwise shrink the window after misses
    except OSError:
        try:
            restore()  # one of the two may have been written
        except OSError:
            pass
        yield None
        return
    try:
        yield int(knob.read_text())
    finally:
        restore()


def set_sched_slice(pids: list[int], ns: int) -> list[int]:
    """Give every thread of ``pids`` a custom EEVDF slice of ``ns`` (sched_setattr, Linux >= 6.12).

    Why: paper 004's model shares the CPU by processor sharing. The kernel's default slice
    (``se.slice`` 1.4 ms here) lets a woken thread run a whole slice before the others, a
    bias that PS does not have; a smaller slice should be closer to PS (an experiment option of
    bench/apache_table2.py, not used in a recorded run yet).
    Returns the slices in effect afterwards (one per thread, from /proc/<pid>/task/*/sched).
    """
    import ctypes
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    sys_sched_setattr = 314  # x86_64
    # struct sched_attr: size, policy, flags, nice, priority, runtime (= the slice), deadline,
    # period, util_min, util_max; SCHED_NORMAL, nice 0 (autogroups carry the priority)
    attr = ctypes.create_string_buffer(struct.pack("IIQiIQQQII", 56, 0, 0, 0, 0, int(ns), 0, 0, 0, 0))
    out = []
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            if libc.syscall(sys_sched_setattr, int(task.name), attr, 0) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"sched_setattr({task.name}): {os.strerror(err)}")
            for line in (task / "sched").read_text().splitlines():
                if line.startswith("se.slice"):
                    out.append(int(line.split(":")[1]))
    return out
