"""Shared by the bench scripts: the machine line, raw-run records and their full write-ups.

A bench's ``--record`` does two things, and nothing else:

* it appends its raw run, one JSON object on one line, to ``bench/results/<bench>.jsonl``
  (append-only: every run ever measured stays there with its date, command, machine and
  figures; see bench/results/README.md);
* it replaces its own section of ``bench/results/sections.md``, the text between
  ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``: the full write-up of the latest recorded run
  (a section not in the file yet is added once, at its end).

BENCHMARKS.md is written by hand from those write-ups: one short table and conclusion per claim,
with a provenance line that links here. No script writes to it, so it cannot grow by appended runs.

``--no-write`` writes neither, ``--json`` prints the run as JSON instead of the section
(:func:`add_output_arguments`, :func:`publish`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "BENCHMARKS",
    "RESULTS",
    "ROOT",
    "SECTIONS",
    "add_output_arguments",
    "append_run",
    "command_line",
    "cpu_model",
    "halt_polling",
    "machine",
    "publish",
    "read_runs",
    "replace_section",
    "run_record",
    "set_sched_slice",
    "write_section",
]

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"  # the curated document (by hand; no bench writes it)
RESULTS = ROOT / "bench" / "results"
SECTIONS = RESULTS / "sections.md"  # the benches' full write-ups, one section each

_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """One line: cores, CPU, Python, and the load average now (the machine is shared)."""
    return (f"{os.cpu_count()} cores, {cpu_model()}, Python {platform.python_version()}, "
            f"load average {os.getloadavg()[0]:.1f}")


def autogroup_nice(pid: int | str = "self") -> int | None:
    """The nice value of a process's scheduler autogroup; None where the kernel has no autogroups
    (the file is absent or empty, as on some CI runners)."""
    try:
        fields = Path(f"/proc/{pid}/autogroup").read_text().split()
        return int(fields[-1])
    except (OSError, IndexError, ValueError):
        return None


def command_line(argv: list[str] | None = None) -> str:
    """The command as a reader would retype it: ``python bench/<script> <args>``."""
    script = Path(sys.argv[0])
    name = f"bench/{script.name}" if script.parent.name == "bench" else script.name
    return " ".join(["python", name, *(sys.argv[1:] if argv is None else argv)])


def _bench_name() -> str:
    """The running script's stem (``uplink_srpt``), the default name of its results file."""
    return Path(sys.argv[0]).stem or "bench"


def _check_name(kind: str, name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"{kind}: {name!r} must be lower-case letters, digits, '_', '.', '-' "
                         "(it names a marker or a file)")


def _jsonable(x: Any) -> Any:
    """``json.dumps`` default: numpy scalars and arrays, paths, sets."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, (set, frozenset, tuple)):
        return list(x)
    raise TypeError(f"{type(x).__name__} is not JSON serialisable: {x!r}")


def run_record(figures: Mapping[str, Any] | None = None, *, bench: str | None = None,
               section: str | None = None, command: str | None = None,
               markdown: str | None = None, date: str | None = None) -> dict[str, Any]:
    """One raw run as a JSON object: ``date`` (UTC), ``bench``, ``command``, ``machine``,
    ``section`` (its section of bench/results/sections.md), ``figures`` (the bench's own result document) and,
    when given, ``markdown`` (the section text the run produced)."""
    rec: dict[str, Any] = {
        "date": date or dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "bench": bench or _bench_name(),
        "command": command or command_line(),
        "machine": machine(),
        "section": section,
        "figures": dict(figures) if figures is not None else None,
    }
    if markdown is not None:
        rec["markdown"] = markdown
    return rec


def append_run(bench: str, record: Mapping[str, Any], results: Path = RESULTS) -> Path:
    """Append ``record`` as one line to ``results/<bench>.jsonl`` (created if missing); return the path."""
    _check_name("bench", bench)
    line = json.dumps(record, default=_jsonable, ensure_ascii=False, allow_nan=False)
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{bench}.jsonl"
    with path.open("a", encoding="utf-8") as f:
        f.write(line + "\n")
    return path


def read_runs(bench: str, results: Path = RESULTS) -> list[dict[str, Any]]:
    """Every run recorded in ``results/<bench>.jsonl``, oldest first ([] if none)."""
    _check_name("bench", bench)
    path = results / f"{bench}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def replace_section(name: str, text: str, path: Path = SECTIONS) -> None:
    """Replace the section ``name`` of ``path`` (default bench/results/sections.md) with ``text``
    (added once at the end if absent)."""
    _check_name("section", name)
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    cur = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark write-ups\n"
    block = f"{begin}\n{text.strip()}\n{end}"
    if cur.count(begin) > 1 or cur.count(end) > 1:
        raise ValueError(f"{path}: section {name!r} is marked more than once; keep one "
                         f"{begin} ... {end} block")
    if begin in cur and end in cur:
        a, b = cur.index(begin), cur.index(end) + len(end)
        if b < a:
            raise ValueError(f"{path}: {end} comes before {begin}; put the markers in order")
        cur = cur[:a] + block + cur[b:]
    else:
        cur = cur.rstrip() + "\n\n" + block + "\n"
    path.write_text(cur, encoding="utf-8")


def write_section(name: str, text: str, path: Path = SECTIONS, *,
                  run: Mapping[str, Any] | None = None, bench: str | None = None,
                  command: str | None = None, results: Path | None = None) -> Path:
    """Record one run: append it to ``results/<bench>.jsonl``, then replace section ``name``.

    Parameters
    ----------
    name, text
        The section and its new text (a ``## `` heading first).
    path
        The write-ups file (tests pass a temporary one).
    run
        The bench's result document (its ``--json`` output), stored as the record's
        ``figures``; without it the record keeps the section text only.
    bench
        Name of the results file; default the running script's stem.
    command
        The command line; default this process's, as ``python bench/<script> ...``.
    results
        Directory of the ``.jsonl`` files; default ``bench/results`` (for another ``path``:
        ``bench/results`` beside it).

    Returns
    -------
    Path
        The ``.jsonl`` file the run went to.
    """
    bench = bench or _bench_name()
    rec = run_record(run, bench=bench, section=name, command=command, markdown=text.strip())
    if results is None:
        results = RESULTS if path == SECTIONS else path.parent / "bench" / "results"
    out = append_run(bench, rec, results)
    replace_section(name, text, path)
    return out


def add_output_arguments(ap: argparse.ArgumentParser) -> None:
    """The three output flags every bench takes: ``--record``, ``--no-write``, ``--json``."""
    ap.add_argument("--record", action="store_true",
                    help="append the run to bench/results/<bench>.jsonl and replace its "
                    "write-up in bench/results/sections.md")
    ap.add_argument("--no-write", action="store_true",
                    help="write nothing (overrides --record)")
    ap.add_argument("--json", action="store_true", help="print the run as JSON on stdout")


def publish(args: argparse.Namespace, name: str, text: str, run: Mapping[str, Any], *,
            bench: str | None = None, command: str | None = None,
            path: Path = SECTIONS, results: Path | None = None) -> Path | None:
    """Print the run (JSON with ``--json``, else the section) and record it with ``--record``
    unless ``--no-write``; return the ``.jsonl`` written to, or None."""
    if getattr(args, "json", False):
        print(json.dumps(run, indent=1, default=_jsonable))
    else:
        print(text)
    if getattr(args, "no_write", False) or not getattr(args, "record", False):
        return None
    return write_section(name, text, path, run=run, bench=bench, command=command, results=results)


HALT_POLL = Path("/sys/module/haltpoll/parameters")


@contextlib.contextmanager
def halt_polling(ns: int) -> Iterator[int | None]:
    """Let idle vCPUs poll up to ``ns`` before halting (cpuidle-haltpoll), restored on exit.

    Why: on this KVM guest ``guest_halt_poll_ns`` is 0, so a vCPU that idles for a few
    milliseconds halts in the hypervisor and the next wake-up costs ~0.4 ms. In the Table 2
    bench the sidecar's core idles while Apache burns a request, and that wake-up lands between
    a completion and the next release — CPU idle time that only the policies which hold
    requests back pay; polling for a while before halting keeps the vCPU awake for it.
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

    Why: van der Weij et al.'s model shares the CPU by processor sharing. The kernel's default slice
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
