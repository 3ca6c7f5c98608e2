"""Cold start of the CLI: wall time of fresh `overtake` processes, and what they import.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/cli_startup.py [--exe PATH] [--repeat 7] [--json] [--no-write]

Times ``overtake --help`` and ``overtake compare examples/table1/case01.yaml --json`` (455 states:
the cost is start-up, imports and numba's cache, not the solve), ``--repeat`` times each,
alternating, and reports the minimum and the median with the 1-min load average. Also lists which
of the heavy libraries the compare process imported. Appends one JSON line to
bench/results/solver_speed.jsonl unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _report import append_run

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("numba", "scipy.sparse", "scipy.sparse.linalg", "pydantic", "matplotlib", "fastapi", "cvxpy", "tqdm")


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exe", default=str(ROOT / ".venv" / "bin" / "overtake"))
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    case1 = str(ROOT / "examples" / "table1" / "case01.yaml")
    cmds = {"help": [args.exe, "--help"], "compare case01": [args.exe, "compare", case1, "--json"]}
    times: dict[str, list[float]] = {k: [] for k in cmds}
    loads = [os.getloadavg()[0]]
    for _ in range(args.repeat):
        for k, c in cmds.items():
            times[k].append(timed(c))
        loads.append(os.getloadavg()[0])
    python = str(Path(args.exe).with_name("python"))
    probe = (f"import sys; sys.argv = ['overtake', 'compare', {case1!r}, '--json']; import io, contextlib\n"
             "from overtake.api.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()): main()\n"
             f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    imported = subprocess.run([python, "-c", probe], check=True, capture_output=True, text=True).stdout.split()
    doc: dict[str, Any] = {
        "bench": "cli_startup", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}", "exe": args.exe,
        "command": "OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/cli_startup.py " + " ".join(sys.argv[1:]),
        "wall_s": {k: {"min": min(v), "median": statistics.median(v), "all": v} for k, v in times.items()},
        "compare_imports": imported, "load": {"min": min(loads), "max": max(loads)},
    }
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        for k, v in doc["wall_s"].items():
            print(f"{k:16s} min {v['min']:.3f} s  median {v['median']:.3f} s")
        print(f"compare imported: {' '.join(imported) or 'none of ' + ', '.join(HEAVY)}; "
              f"load {min(loads):.2f}-{max(loads):.2f}")
    if not args.no_write:
        append_run("solver_speed", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
