"""Sweep scaling: one vs two local Dask workers on the 24-point examples/sweep/grid.yaml.

Each configuration gets a fresh LocalCluster of single-threaded worker processes
(OPENBLAS/OMP/MKL/NUMBA threads = 1); every worker first runs one small warm-up point (imports,
numba cache), then the 24 points are timed from submission to the last result. Configurations
alternate 1, 2, 1, 2 (``--rounds``) so drifting background load hits both; throughput =
points / wall seconds; the ratio uses the best round of each. Also checks that both give the same
table. Writes the `sweep` section of bench/results/sections.md with --record.

    setsid bash -c 'echo -20 > /proc/self/autogroup; OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 \
        exec .venv/bin/python bench/sweep_bench.py --record'

With the kernel's autogroup scheduling, all processes of one session share one CPU share: on a
machine busy with other sessions, a second worker in the same session adds little. The bench is
therefore run in its own session at autogroup nice -20 (as the other benches here), and reports
the CPU seconds the workers got (Σ task CPU / wall = cores effectively used).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from _report import autogroup_nice, write_section

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")


def run(points, warm, workers: int):  # type: ignore[no-untyped-def]
    from dask.distributed import Client

    from overtake.mdp.sweep import local_cluster, run_sweep, solve_point

    cluster = local_cluster(workers)
    client = Client(cluster)
    try:
        addrs = list(client.scheduler_info()["workers"])
        client.gather([client.submit(solve_point, warm, pure=False, workers=[a]) for a in addrs])
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        df = run_sweep(points, client=client)
        wall = time.perf_counter() - t0
    finally:
        client.close()
        cluster.close()
    return df, wall, load


def main() -> int:
    import numpy as np
    import yaml

    from overtake.mdp.sweep import SweepPoint, estimated_states, parse_grid

    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", default=str(ROOT / "examples/sweep/grid.yaml"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    points = parse_grid(yaml.safe_load(Path(args.grid).read_text()))
    warm_doc = yaml.safe_load(Path(args.grid).read_text())
    warm_doc["grid"] = {"load": [0.2]}
    warm: SweepPoint = parse_grid(warm_doc)[0]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load0 = os.getloadavg()[0]
    results: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
    tables = {}
    for r in range(args.rounds):
        for w in (1, 2):
            df, wall, load = run(points, warm, w)
            assert df["error"].isna().all(), df[df["error"].notna()]
            results[w].append((wall, load))
            tables[w] = df
            print(f"round {r + 1}, {w} worker(s): {len(points)} points in {wall:.1f} s "
                  f"({len(points) / wall * 60:.1f} points/min), load average {load:.1f}", flush=True)
    a, b = (tables[w].sort_values(["point", "policy"]).reset_index(drop=True) for w in (1, 2))
    same = bool(np.allclose(a["mean_response_time"], b["mean_response_time"], rtol=1e-12, atol=0))
    best1 = min(x[0] for x in results[1])
    best2 = min(x[0] for x in results[2])
    ratio = best1 / best2
    per_point = a.groupby("point")["seconds"].first()
    cpu = {w: tables[w].groupby("point")["cpu_seconds"].first().sum() for w in (1, 2)}
    nice = autogroup_nice()
    autogroup = "n/a" if nice is None else f"nice {nice}"
    states = sorted(estimated_states(p) for p in points)
    lines = [
        "## mdp/sweep.py — `overtake sweep` on Dask, 1 vs 2 local workers",
        "",
        f"- Date: {started}; machine: {os.cpu_count()} vCPU, {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}; load average {load0:.1f} at start (per run below; the machine is "
        "shared, and two workers compete with any other job for the second core).",
        f"- Command: `OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 .venv/bin/python bench/sweep_bench.py "
        f"{' '.join(sys.argv[1:])}`, run in autogroup `{autogroup}` (see the module docstring on autogroups); "
        "LocalCluster, single-threaded worker processes, one warm-up point per worker, timed from submission "
        "to the last result (cluster start-up excluded).",
        f"- Grid: `examples/sweep/grid.yaml`, {len(points)} points (load × stage SCVs × stage-2 mean), "
        f"π* + 5 baselines per point via `overtake.mdp.compare`; π* MDP {states[0]}–{states[-1]} states; "
        f"one point alone took {per_point.min():.1f}–{per_point.max():.1f} s (median {per_point.median():.1f} s) "
        "inside the 1-worker run. Points are submitted largest first.",
        "",
        "| round | workers | wall s | points/min | load average |",
        "|---|---|---|---|---|",
    ]
    for r in range(args.rounds):
        for w in (1, 2):
            wall, load = results[w][r]
            lines.append(f"| {r + 1} | {w} | {wall:.1f} | {len(points) / wall * 60:.1f} | {load:.1f} |")
    lines += [
        "",
        f"Throughput ratio 2 workers / 1 worker (best round each): **{ratio:.2f}×** "
        f"(target ≥ 1.7×: {'met' if ratio >= 1.7 else 'NOT met'}). "
        f"Same table from both runs (E[W] to 1e-12): {same}. Task CPU in the last round: "
        f"{cpu[1]:.1f} s (1 worker), {cpu[2]:.1f} s (2 workers) → cores effectively used "
        f"{cpu[1] / results[1][-1][0]:.2f} and {cpu[2] / results[2][-1][0]:.2f}.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.record:
        write_section("sweep", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
