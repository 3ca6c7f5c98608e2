"""A three-stage H2 tandem solved exactly (π*), against the overtaking heuristic on the same caps.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/three_stage.py [--tol 0.005] [--json] [--no-write]

Model: three stages, each van der Weij et al., "Dynamic thread assignment" Table 1's H2 (phase 1 w.p. 0.91 with mean 0.55, phase 2 with
mean 5.45; E S = 1), load ρ = 0.6 — 6 coordinates, 12 state components on the phase-known layout.
π* by auto-truncation (overtake.mdp.solve, Anderson-accelerated RVI) from C = 10, K = 3. The heuristic
(mdp/heuristic.py) is evaluated exactly on the chain of the same request cap and thread cap as
π*'s reported metrics (its uncapped chain outgrows memory); π(1) and π(∞) with their own
auto-truncation. Appends one JSON line to bench/results/solver_speed.jsonl unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np
from _report import append_run

from overtake.mdp import solve
from overtake.mdp.heuristic import overtaking_heuristic
from overtake.mdp.model import Stage, TandemModel
from overtake.mdp.rule_evaluation import evaluate_baseline, evaluate_rule
from overtake.mdp.statespace import Layout, Truncation

ROOT = Path(__file__).resolve().parents[1]


def h2(name: str) -> Stage:
    return Stage(name, np.array([0.91, 0.09]), np.diag([-1 / 0.55, -1 / 5.45]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tol", type=float, default=5e-3, help="auto-truncation tolerance (relative E[W])")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    model = TandemModel(0.6 / 3.0, (h2("s1"), h2("s2"), h2("s3")))
    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]

    def log(msg: str) -> None:
        if "anderson step" not in msg:
            print(f"{time.perf_counter() - t_start:8.1f} s  {msg}", file=sys.stderr, flush=True)

    t0, c0 = time.perf_counter(), time.process_time()
    opt = solve(model, tol=args.tol, start=Truncation(10, 3), progress=log)
    solve_wall, solve_cpu = time.perf_counter() - t0, time.process_time() - c0
    mt = opt.policy.meta.get("metrics_truncation", {"max_requests": opt.truncation.max_requests})
    C, K = int(mt["max_requests"]), opt.truncation.k_max
    h = overtaking_heuristic(model)
    t0 = time.perf_counter()
    hm = evaluate_rule(model, Layout.build(model, "full"), lambda rows: h.actions(rows, max_threads=K),
                       max_requests=C, max_threads=K)
    heur_s = time.perf_counter() - t0
    base = {n: evaluate_baseline(model, n, tol=args.tol).metrics.mean_response_time for n in ("pi(1)", "pi(inf)")}
    star = opt.metrics.mean_response_time
    doc = {
        "bench": "three_stage", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "command": "OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/three_stage.py " + " ".join(sys.argv[1:]),
        "tol": args.tol, "solve_states": opt.solve.space.size,
        "solve_truncation": [opt.truncation.max_requests, K], "evaluation_cap": C,
        "sweeps": opt.sweeps, "solve_wall_s": solve_wall, "solve_cpu_s": solve_cpu,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 / 1024,
        "pi_star_EW": star, "pi_star_states_evaluated": opt.metrics.states,
        "heuristic_EW_same_caps": hm.mean_response_time, "heuristic_states": hm.states, "heuristic_eval_s": heur_s,
        "heuristic_gap": hm.mean_response_time / star - 1,
        "baselines_EW": base, "gain_over": {k: v / star - 1 for k, v in base.items()},
        "heuristic_gain_over": {k: v / hm.mean_response_time - 1 for k, v in base.items()},
        "load_before": load0, "load_after": os.getloadavg()[0],
        "trace": opt.trace,
    }
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"pi*: {opt.solve.space.size:,} states (C = {opt.truncation.max_requests}, K = {K}), {opt.sweeps} sweeps, "
              f"{solve_wall:.0f} s wall / {solve_cpu:.0f} s CPU, peak {doc['peak_rss_gb']:.2f} GB; E[W] {star:.4f} "
              f"(evaluated on cap {C})")
        print(f"heuristic on the same caps: E[W] {hm.mean_response_time:.4f} ({100 * doc['heuristic_gap']:+.2f} % vs pi*)")
        print("baselines: " + ", ".join(f"{k} {v:.4f} (pi* gain {100 * doc['gain_over'][k]:.2f} %, heuristic "
                                        f"{100 * doc['heuristic_gain_over'][k]:.2f} %)" for k, v in base.items()))
    if not args.no_write:
        append_run("solver_speed", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
