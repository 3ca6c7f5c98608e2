"""LP size limit: the occupation-measure LP (mdp.lp, cvxpy + HiGHS) against relative value iteration.

van der Weij et al., "Dynamic thread assignment" Table 1 case 4 (two H2 stages, r = 0.91, means 0.55/5.45, ρ = 0.6), phase-known layout,
on growing truncations. Per size (each in its own process, for its peak RSS): states, LP variables,
cvxpy build, HiGHS solve (IPM + crossover, tolerances 1e-10), exact evaluation of the LP policy,
relative difference of the LP objective and of the LP policy's exactly evaluated cost to RVI's g
(RVI to span 1e-11), and the peak RSS. Writes the `lp` section of bench/results/sections.md with --record.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/lp_bench.py --record
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from _report import write_section

ROOT = Path(__file__).resolve().parents[1]
SIZES = [(6, 3), (8, 4), (10, 3), (10, 4), (12, 3)]


def one(C: int, K: int) -> dict:
    import numpy as np

    from overtake.mdp.average_cost import relative_value_iteration
    from overtake.mdp.lp import cost_rate, occupation_lp
    from overtake.mdp.model import Stage, TandemModel
    from overtake.mdp.statespace import StateSpace, Truncation

    h2 = lambda n: Stage(n, np.array([0.91, 0.09]), np.diag([-1 / 0.55, -1 / 5.45]))  # noqa: E731
    s1, s2 = h2("s1"), h2("s2")
    model = TandemModel(0.6 / (s1.mean() + s2.mean()), (s1, s2))
    space = StateSpace(model, Truncation(C, K))
    t0 = time.perf_counter()
    rvi = relative_value_iteration(space, tol=1e-11)
    t_rvi = time.perf_counter() - t0
    c0 = time.process_time()
    lp = occupation_lp(space)
    lp_cpu = time.process_time() - c0
    exact = float(lp.stationary @ cost_rate(space))
    return {
        "C": C,
        "K": K,
        "states": space.size,
        "variables": lp.variables,
        "rows": lp.info["rows"],
        "rvi_g": rvi.gain,
        "rvi_seconds": t_rvi,
        "rvi_sweeps": rvi.n_iter,
        "lp_objective": lp.objective,
        "lp_exact": exact,
        "rel_obj": (lp.objective - rvi.gain) / rvi.gain,
        "rel_exact": (exact - rvi.gain) / rvi.gain,
        "build_seconds": lp.build_seconds,
        "solve_seconds": lp.solve_seconds,
        "eval_seconds": lp.eval_seconds,
        "lp_cpu_seconds": lp_cpu,
        "E_W": lp.metrics.mean_response_time,
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=2, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per size before giving up")
    ap.add_argument("--record", action="store_true", help="write the lp section of bench/results/sections.md")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*args.one)))
        return 0
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    load0 = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows, stopped = [], None
    for C, K in SIZES:
        try:
            out = subprocess.run([sys.executable, __file__, "--one", str(C), str(K)], env=env, capture_output=True,
                                 text=True, timeout=args.timeout, check=True)
        except subprocess.TimeoutExpired:
            stopped = f"C={C}, K={K}: over {args.timeout:.0f} s, stopped there"
            print(stopped, flush=True)
            break
        except subprocess.CalledProcessError as exc:
            stopped = f"C={C}, K={K}: failed ({exc.stderr.strip().splitlines()[-1]})"
            print(stopped, flush=True)
            break
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(json.dumps(r), flush=True)
    lines = [
        "## mdp/lp.py — occupation-measure LP size limit",
        "",
        f"- Date: {started}; machine: {os.cpu_count()} vCPU, {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}; **shared with other helpers' jobs** (load average {load0:.1f} "
        "at start), so absolute times are ±30 % or worse.",
        "- Command: `OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/lp_bench.py --record` (each size in its own process).",
        "- Instance: van der Weij et al. Table 1 case 4 (two H2 stages, ρ = 0.6), phase-known layout, cost = `space.cost` "
        "(requests + blocking charge, what RVI minimises). LP: cvxpy 1.9 → HiGHS IPM + crossover, primal/dual "
        "feasibility 1e-10. 'exact' = the LP policy's cost from its exact stationary law (P_E·R). RVI to span 1e-11.",
        "- 'LP CPU s' = process CPU time of the whole `occupation_lp` call (cvxpy build, HiGHS, exact evaluation); "
        "wall ≫ CPU is the shared machine; the size limit below is the wall-clock timeout at this load.",
        "",
        "| C | K | states | LP vars | RVI g | LP objective | rel. LP − RVI | rel. exact − RVI | build s | HiGHS s (wall) | LP CPU s | eval s | RVI s | peak MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['C']} | {r['K']} | {r['states']} | {r['variables']} | {r['rvi_g']:.10f} | {r['lp_objective']:.10f} "
            f"| {r['rel_obj']:.1e} | {r['rel_exact']:.1e} | {r['build_seconds']:.2f} | {r['solve_seconds']:.1f} | {r['lp_cpu_seconds']:.1f} "
            f"| {r['eval_seconds']:.2f} | {r['rvi_seconds']:.1f} | {r['peak_mb']:.0f} |"
        )
    if stopped:
        lines += ["", f"Size limit reached: {stopped}."]
    if args.record:
        write_section("lp", "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
