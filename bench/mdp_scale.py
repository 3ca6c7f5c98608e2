"""How large a tandem MDP fits in 8 GB and 10 minutes: π* on growing truncations.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/mdp_scale.py --case 4 --sizes 20x4,30x4,40x4
        [--method anderson|rvi] [--json] [--no-write] [--results]

Each size runs in its own process (so its peak RSS is its own, read with wait4): build the state
space and event matrix, solve by ``--method`` (Anderson-accelerated RVI by default, plain RVI as
the reference) to span ≤ 1e-5·g (the product's default for a 0.1% auto-truncation), report
states, sweeps, seconds (wall and CPU), peak memory. Writes the ``mdp-scale`` section of
bench/results/sections.md unless ``--no-write``; ``--results`` appends the rows as one JSON line to
bench/results/solver_speed.jsonl instead (with the load average before and after each size).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(case: int, C: int, K: int, method: str) -> None:
    from overtake.api.scenario import load_scenario
    from overtake.mdp.average_cost import anderson_rvi, relative_value_iteration
    from overtake.mdp.statespace import StateSpace, Truncation

    _, model = load_scenario(ROOT / "examples" / "table1" / f"case{case:02d}.yaml")
    w0, c0 = time.perf_counter(), time.process_time()
    space = StateSpace(model, Truncation(C, K))
    _ = space.event_matrix  # built here, so the solve's timing excludes it
    build = time.perf_counter() - w0
    solver = anderson_rvi if method == "anderson" else relative_value_iteration
    res = solver(space, tol=1e-5, max_iter=100_000)
    print(json.dumps({"method": method,
        "states": space.size, "nnz": int(space.event_matrix.nnz), "sweeps": res.sweeps, "converged": res.converged,
        "build_s": build, "wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0,
        "gain_bounds": list(res.gain_bounds),
    }))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", type=int, default=4)
    ap.add_argument("--sizes", default="20x4,30x4,40x4")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--method", choices=("anderson", "rvi"), default="anderson")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON document")
    ap.add_argument("--results", action="store_true", help="append one JSON line to bench/results/solver_speed.jsonl")
    ap.add_argument("--note", default="", help="a sentence appended to the section (e.g. a run stopped by hand)")
    args = ap.parse_args()
    if args.one:
        C, K = (int(x) for x in args.one.split("x"))
        one(args.case, C, K, args.method)
        return 0
    from _report import append_run, cpu_model, write_section

    rows = ["| cap C / K_max | states | nnz(P_E) | sweeps | build s | wall s | CPU s | peak RSS GB | g bounds |",
            "|---|---|---|---|---|---|---|---|---|"]
    records = []
    for size in args.sizes.split(","):
        load0 = os.getloadavg()[0]
        proc = subprocess.Popen([sys.executable, __file__, "--case", str(args.case), "--method", args.method, "--one", size],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        assert proc.stdout is not None
        out = proc.stdout.read()
        _, wstatus, ru = os.wait4(proc.pid, 0)
        proc.returncode = status = os.waitstatus_to_exitcode(wstatus)
        peak = ru.ru_maxrss / 1024 / 1024  # this child's own peak RSS
        if status != 0:
            rows.append(f"| {size.replace('x', ' / ')} | failed (exit {status}) | | | | | | {peak:.2f} | |")
            print(rows[-1], flush=True)
            records.append({"size": size, "failed": status, "peak_rss_gb": peak})
            break
        d = json.loads(out.strip().splitlines()[-1])
        records.append({"size": size, **d, "peak_rss_gb": peak, "load_before": load0, "load_after": os.getloadavg()[0]})
        rows.append(
            f"| {size.replace('x', ' / ')} | {d['states']:,} | {d['nnz']:,} | {d['sweeps']}{'' if d['converged'] else ' (not converged)'} | "
            f"{d['build_s']:.1f} | {d['wall_s']:.1f} | {d['cpu_s']:.1f} | {peak:.2f} | "
            f"[{d['gain_bounds'][0]:.6f}, {d['gain_bounds'][1]:.6f}] |"
        )
        print(rows[-1], flush=True)
    cmd = (f"OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/mdp_scale.py --case {args.case} --sizes {args.sizes} "
           f"--method {args.method}")
    doc = {"bench": "mdp_scale", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           "machine": f"{os.cpu_count()} cores, {cpu_model()}, Python {platform.python_version()}", "command": cmd,
           "rows": records}
    if args.json:
        print(json.dumps(doc, indent=1))
    if args.results:
        append_run("solver_speed", doc)
    text = "\n".join([
        "## Largest MDP in 8 GB and 10 minutes (mdp/)", "",
        f"Date {dt.date.today()}, machine: {os.cpu_count()} cores, {cpu_model()}, Python {platform.python_version()}; "
        f"command: `{cmd}`. "
        f"Table 1 case {args.case}, {args.method} to span ≤ 1e-5·g, one process per size (peak RSS of that process).", "",
        *rows,
        *(["", args.note] if args.note else []),
    ])
    if not args.json:
        print(text)
    if not args.no_write:
        write_section("mdp-scale", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
