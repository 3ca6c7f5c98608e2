"""Cold start of the CLI: wall and CPU time of fresh `overtake` processes, and what they import.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/cli_startup.py [--exe PATH] [--repeat 7] [--fit-samples 100000]
                                                                 [--json] [--no-write]

Times ``overtake --version``, ``overtake --help``, ``overtake fit --help``, ``overtake solve --help``,
two argument errors (``overtake solve`` without
its scenario, ``overtake fit FILE --order x``), ``overtake compare examples/table1/case01.yaml --json``
(455 states: the cost is start-up, imports and numba's cache, not the solve) and ``overtake fit`` of
``--fit-samples`` Lognormal(0, 1) durations as CF1(4) (``numpy.random.default_rng(20240601)``;
0 skips it), ``--repeat`` times each, alternating. Reports the minimum and the median of the wall
time and of the CPU time (user + sys of the child), with the 1-min load average; a fit's CPU
beyond ``fit --help`` is the fit itself. Also lists which of the heavy libraries the compare and
the fit processes imported. Appends one JSON line to bench/results/solver_speed.jsonl unless
``--no-write``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _report import append_run

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("numpy", "numba", "scipy", "scipy.linalg", "scipy.sparse", "scipy.sparse.linalg", "yaml", "pydantic",
         "matplotlib", "fastapi", "cvxpy", "tqdm", "overtake.mdp")


def timed(cmd: list[str], expect: int = 0) -> tuple[float, float]:
    """Wall and CPU (user + sys) seconds of one run of ``cmd``, which must exit with ``expect``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != expect:
        raise SystemExit(f"{' '.join(cmd)}: exit {proc.returncode}, expected {expect}: {proc.stderr.decode()[-300:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def imported(python: str, argv: list[str]) -> list[str]:
    """Which of HEAVY a process running ``overtake ARGV`` has imported when the command returns."""
    probe = (f"import sys, io, contextlib\nsys.argv = ['overtake', *{argv!r}]\n"
             "from overtake.api.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit): main()\n"
             f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    return subprocess.run([python, "-c", probe], check=True, capture_output=True, text=True).stdout.split()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exe", default=str(ROOT / ".venv" / "bin" / "overtake"))
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--fit-samples", type=int, default=100_000, help="Lognormal(0,1) durations to fit (0: no fit)")
    args = ap.parse_args()
    case1 = str(ROOT / "examples" / "table1" / "case01.yaml")
    tmp = Path(tempfile.mkdtemp(prefix="cli_startup_"))
    data = tmp / "durations.txt"
    data.write_text("1.0\n2.0\n")
    cmds: dict[str, tuple[list[str], int]] = {
        "version": ([args.exe, "--version"], 0),
        "help": ([args.exe, "--help"], 0),
        "fit --help": ([args.exe, "fit", "--help"], 0),
        "solve --help": ([args.exe, "solve", "--help"], 0),
        "solve, no scenario": ([args.exe, "solve"], 2),
        "fit --order x": ([args.exe, "fit", str(data), "--order", "x"], 2),
        "compare case01": ([args.exe, "compare", case1, "--json"], 0),
    }
    fit_argv: list[str] = []
    if args.fit_samples > 0:
        import numpy as np

        x = np.random.default_rng(20240601).lognormal(0.0, 1.0, args.fit_samples)
        sample = tmp / f"lognormal{args.fit_samples}.txt"
        np.savetxt(sample, x, fmt="%.17g")
        fit_argv = ["fit", str(sample), "--structure", "cf1", "--order", "4", "--out", str(tmp / "out")]
        cmds[f"fit {args.fit_samples} CF1(4)"] = ([args.exe, *fit_argv], 0)
    wall: dict[str, list[float]] = {k: [] for k in cmds}
    cpu: dict[str, list[float]] = {k: [] for k in cmds}
    loads = [os.getloadavg()[0]]
    for _ in range(args.repeat):
        for k, (c, expect) in cmds.items():
            w, u = timed(c, expect)
            wall[k].append(w)
            cpu[k].append(u)
        loads.append(os.getloadavg()[0])
    python = str(Path(args.exe).with_name("python"))
    doc: dict[str, Any] = {
        "bench": "cli_startup", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}", "exe": args.exe,
        "command": "OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/cli_startup.py " + " ".join(sys.argv[1:]),
        "wall_s": {k: {"min": min(v), "median": statistics.median(v), "all": v} for k, v in wall.items()},
        "cpu_s": {k: {"min": min(v), "median": statistics.median(v), "all": v} for k, v in cpu.items()},
        "version_imports": imported(python, ["--version"]),
        "compare_imports": imported(python, ["compare", case1, "--json"]),
        "fit_imports": imported(python, fit_argv) if fit_argv else None,
        "load": {"min": min(loads), "max": max(loads)},
    }
    shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        for k, v in doc["wall_s"].items():
            c = doc["cpu_s"][k]
            print(f"{k:22s} wall min {v['min']:.3f} s  median {v['median']:.3f} s   "
                  f"cpu min {c['min']:.3f} s  median {c['median']:.3f} s")
        print(f"--version imported: {' '.join(doc['version_imports']) or 'none of ' + ', '.join(HEAVY)}")
        print(f"compare imported: {' '.join(doc['compare_imports']) or 'none of ' + ', '.join(HEAVY)}")
        if doc["fit_imports"] is not None:
            print(f"fit imported: {' '.join(doc['fit_imports']) or 'none of ' + ', '.join(HEAVY)}")
        print(f"load {min(loads):.2f}-{max(loads):.2f}")
    if not args.no_write:
        append_run("solver_speed", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
