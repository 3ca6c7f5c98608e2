"""Robustness: a policy solved on a fitted PH, run on the true (non-PH) service in the simulator.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/robustness.py [--requests 2000000] [--no-write]

For each service family (same mean and c² = 5 as Table 1's H2 stages: lognormal σ = 1.3386;
Pareto II / Lomax shape 2.5; the fitted PH itself is simulated too, as a check of the method):

1. draw 10^5 service times, fit an H2 by EM (:func:`overtake.fitting.fit`, ``structure="hyperexp"``);
2. two stages with that fit, ρ = 0.6 (Table 1 case 4's layout); solve π* and evaluate π(1), π(4),
   π(∞) and the heuristic exactly on the PH model — the *predicted* figures;
3. simulate every policy with service drawn from the true family, rescaled to the fitted mean, with
   the policy's phase label from the fitted PH's posterior given the work (oracle) and from the prior
   (what a server knows at arrival); baselines are phase-blind.

A gain is "kept" when the simulated gain minus its 95% uncertainty is > 0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import sys
import time
from pathlib import Path

import numpy as np
from sim_bench import git_rev, machine, write_section

from overtake.fitting import fit
from overtake.mdp import solve
from overtake.mdp.comparison import compare
from overtake.mdp.heuristic import evaluate_heuristic
from overtake.mdp.model import Stage, TandemModel
from overtake.mdp.simulation import SimulationResult, service_from_spec, simulate

ROOT = Path(__file__).resolve().parents[1]

FAMILIES = {
    "lognormal σ=1.3386 (c²=5)": "lognorm(s=1.3386)",
    "Pareto II (Lomax) shape 2.5 (c²=5)": "lomax(c=2.5)",
}


def gain(b: SimulationResult, s: SimulationResult) -> tuple[float, float]:
    """(E W(b)/E W(s) − 1, its 95% half-width by the delta method for independent runs)."""
    g = b.mean_response_time / s.mean_response_time - 1
    rel = math.hypot(b.ci95 / b.mean_response_time, s.ci95 / s.mean_response_time)
    return g, (1 + g) * rel


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2_000_000)
    ap.add_argument("--fit-samples", type=int, default=100_000)
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    log = lambda s: print(s, flush=True)  # noqa: E731
    blocks = []
    summary = []
    rng = np.random.default_rng(20261121)
    for fam, spec in FAMILIES.items():
        true = service_from_spec(spec, mean=1.0)
        x = true.rvs(args.fit_samples, rng)
        t0 = time.perf_counter()
        ph = fit(x, structure="hyperexp", order=2, preserve_mean=True, random_state=1).ph
        fit_s = time.perf_counter() - t0
        st1 = Stage("stage1", ph.alpha, ph.T)
        st2 = Stage("stage2", ph.alpha, ph.T)
        model = TandemModel(0.6 / (st1.mean() + st2.mean()), (st1, st2))
        t0 = time.perf_counter()
        opt = solve(model, tol=args.tol)
        doc = compare(model, tol=args.tol, optimum=opt)
        heur = evaluate_heuristic(model, tol=args.tol).metrics.mean_response_time
        solve_s = time.perf_counter() - t0
        pred = {k: v["mean_response_time"] for k, v in doc["policies"].items()}
        pred["heuristic"] = heur
        log(f"{fam}: fit {ph.alpha} means {1 / -np.diag(ph.T)}, predicted {pred}")
        services = {"PH": None, "true": [service_from_spec(spec, mean=s.mean()) for s in model.stages]}
        runs: dict[tuple[str, str], SimulationResult] = {}
        seed = 500
        for pol_name, pol in [("pi*", opt.policy), ("heuristic", "heuristic")]:
            for phase in ("oracle", "prior"):
                seed += 1
                runs[(pol_name, phase)] = simulate(model, pol, requests=args.requests, seed=seed,
                                                   service=services["true"], phase=phase)  # type: ignore[arg-type]
            seed += 1
            runs[(pol_name, "PH")] = simulate(model, pol, requests=args.requests, seed=seed)
        for b in ("pi(1)", "pi(4)", "pi(inf)"):
            seed += 1
            runs[(b, "blind")] = simulate(model, b, requests=args.requests, seed=seed, service=services["true"])  # type: ignore[arg-type]
            seed += 1
            runs[(b, "PH")] = simulate(model, b, requests=args.requests, seed=seed)
        rows = []
        for pol_name in ("pi*", "heuristic", "pi(1)", "pi(4)", "pi(inf)"):
            ph_run = runs[(pol_name, "PH")]
            if pol_name in ("pi*", "heuristic"):
                o, p = runs[(pol_name, "oracle")], runs[(pol_name, "prior")]
                cells = (f"{o.mean_response_time:.3f} ± {o.ci95:.3f} | {p.mean_response_time:.3f} ± {p.ci95:.3f} | "
                         f"{o.percentiles['p99']:.1f} / {p.percentiles['p99']:.1f}")
            else:
                o = runs[(pol_name, "blind")]
                cells = f"{o.mean_response_time:.3f} ± {o.ci95:.3f} | (phase-blind) | {o.percentiles['p99']:.1f}"
            rows.append(f"| {pol_name} | {pred[pol_name]:.3f} | {ph_run.mean_response_time:.3f} ± {ph_run.ci95:.3f} | {cells} |")
        gl = []
        for pol_name in ("pi*", "heuristic"):
            for base in ("pi(1)", "pi(inf)"):
                pg = pred[base] / pred[pol_name] - 1
                out = [f"{100 * pg:.1f}"]
                for phase in ("oracle", "prior"):
                    g, h = gain(runs[(base, "blind")], runs[(pol_name, phase)])
                    verdict = "kept" if g - h > 0 else ("lost" if g + h < 0 else "not significant")
                    out.append(f"{100 * g:.1f} ± {100 * h:.1f} ({verdict})")
                gl.append(f"| {pol_name} over {base} | " + " | ".join(out) + " |")
                summary.append(f"{fam}: {pol_name} over {base}: predicted {out[0]}%, oracle {out[1]}, prior {out[2]}")
        blocks += [
            f"### {fam}: `--service-from '{spec}'`",
            "",
            f"Fitted H2: α = [{ph.alpha[0]:.4f}, {ph.alpha[1]:.4f}], phase means [{1 / -ph.T[0, 0]:.4f}, {1 / -ph.T[1, 1]:.4f}], "
            f"mean {ph.mean():.4f}, c² {ph.scv():.3f} (sample c² {x.var() / x.mean() ** 2:.3f}); fit {fit_s:.1f} s; "
            f"π* on the fit: {doc['states']} states, solve + exact baselines + heuristic {solve_s:.0f} s.",
            "",
            "| policy | predicted E[W] (PH model, exact) | simulated on PH | simulated on true service, oracle phase | prior phase | p99 oracle / prior |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            "| gain % | predicted (PH) | true service, oracle phase | true service, prior phase |",
            "|---|---|---|---|",
            *gl,
            "",
        ]
        for line in blocks[-12:]:
            log(line)
    cmd = "OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/robustness.py " + " ".join(sys.argv[1:])
    text = "\n".join([
        "## Robustness: policy solved on a fitted PH, run on lognormal and Pareto service",
        "",
        f"Date {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, commit {git_rev()}; machine: {machine()}.",
        f"Command: `{cmd}`. {args.requests:,} measured requests per simulation (batch-means 95% CI); "
        f"exact evaluation tolerance {args.tol}. Two stages with the same service family, ρ = 0.6 on the fitted means.",
        "",
        "Oracle phase = the fitted H2's posterior phase given the request's actual work; prior phase = drawn from α "
        "(the policy runs on noise labels). Baselines are phase-blind, so one run serves both.",
        "",
        *blocks,
    ])
    if not args.no_write:
        write_section("robustness", text)
    for s in summary:
        log(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
