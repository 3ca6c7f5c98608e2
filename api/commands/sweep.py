"""``overtake sweep GRID.yaml --out results.csv``: solve a grid of scenarios on Dask (mdp.sweep)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from overtake import install_hint
from overtake.mdp.errors import ModelError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("sweep", help="solve pi* and the baselines on a grid of scenarios with Dask")
    p.add_argument("grid", help="grid YAML: base scenario + axes (load, cores, overhead, STAGE.mean, STAGE.scv)")
    p.add_argument("--out", required=True, help="results table, .csv or .parquet (a row per point and policy)")
    p.add_argument("--plot", metavar="PNG", help="also plot the gain of pi* vs load per policy")
    p.add_argument("--scheduler", metavar="tcp://HOST:8786", help="a running Dask scheduler (default: a LocalCluster)")
    p.add_argument("--workers", type=int, help="LocalCluster worker processes (default: CPU count)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def run(args: argparse.Namespace) -> int:
    low = args.out.lower()
    if not (low.endswith(".csv") or low.endswith(".parquet") or low.endswith(".pq")):
        raise ModelError(f"--out {args.out}: use a .csv or .parquet file name")
    if args.workers is not None and args.workers < 1:
        raise ModelError(f"--workers must be >= 1, got {args.workers}")
    if args.scheduler and args.workers is not None:
        raise ModelError("--workers applies to the local cluster; drop it when giving --scheduler")
    # Dask, pandas and the solver only once the options are good
    try:
        import dask.distributed  # noqa: F401
    except ImportError:
        raise ModelError(f"overtake sweep needs Dask: {install_hint('sweep')}") from None
    import yaml

    from overtake.api.progress import progress_bar
    from overtake.mdp.sweep import parse_grid, plot_gains, run_sweep, write_table

    path = Path(args.grid)
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ModelError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    points = parse_grid(doc)
    try:
        # a bar over the points on a terminal, silent in a pipe or CI (api/progress.py)
        with progress_bar(f"sweep ({len(points)} points)", quiet=args.quiet) as progress:
            df = run_sweep(points, scheduler=args.scheduler, workers=args.workers, progress=progress)
    except OSError as exc:  # scheduler unreachable
        raise ModelError(f"--scheduler {args.scheduler}: cannot connect ({exc}); start `dask scheduler` "
                         "there or drop --scheduler for a local cluster") from None
    write_table(df, args.out)
    if args.plot:
        plot_gains(df, args.plot)
    failed = int(df["error"].notna().sum())
    print(json.dumps({"out": args.out, "points": len(points), "rows": len(df), "failed_points": failed,
                      "plot": args.plot}, indent=2))
    return 0 if failed == 0 else 1
