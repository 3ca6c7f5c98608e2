"""CPU priority in the model: thresholds chosen by exact analysis and by simulation, Table 1.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/cpu_priority_model.py [--cases 2,3,4,6,7,8,10,11,12]
        [--requests 1000000] [--seeds 2] [--search-requests 300000] [--weight idle]
        [--spawn-cases 4,8,12 [--class-action]] [--json] [--no-write]

Per Table 1 case (π(∞): every request gets a thread at once, as Apache's default does):

* ``ps``: E[W] under plain PS, exact ((E S1 + E S2)/(1 − ρ)) and simulated;
* ``visit``: per-stage age thresholds chosen by the exact analysis of the *visit model* (the stage
  visits as Poisson classes of one M/G/1, strict priority; :func:`overtake.mdp.priority.
  choose_tandem_thresholds`), its predicted E[W], and the simulated E[W] at those thresholds with
  strict priority (the model's own assumption) and with the kernel's weight (``--weight``);
* ``search``: per-stage thresholds chosen by simulation — coordinate search over {¼, ½, 1, 2, 4, 8}
  × the stage mean and ∞ (never demote) from the better of PS and the visit choice, common random
  numbers, ``--search-requests`` per point — then measured on ``--seeds`` fresh seeds;
* ``class``: known-phase short-first (start level by start phase), visit model (strict) and
  simulated at the kernel weight.

``--mg1``: the single-M/G/1 table (Table 1's H2 alone at ρ = 0.6): PS, FB (LAS), the best
two-level age priority and known-phase short-first, each exact (closed form, MLPS analysis, DPS at
finite weights) and simulated (FB as 40 levels of width 0.25).

``--class-action`` (with ``--spawn-cases``): the MDP in which each spawn also picks the thread's
class (:func:`overtake.mdp.priority_classes.class_action_optimum`), solved on ``opt_class``'s truncation; its
average cost against the fixed-class optimum's on the same truncation (how much fixing the class
by the phase costs).

``--spawn-cases``: π* (full phase information) alone against π* with short-first CPU classes,
simulated ("short-first priority plus π*'s spawn rules"), and exact: with hyperexponential
stages the phases do not move, so class priority by start phase is weighted sharing by phase
(``TandemModel.weights``, discriminatory processor sharing), and the MDP gives the exact E[W] of
π(∞) and of π* under it, and the optimal spawn policy with the classes in force: short-first, and
the assignment ``overtake solve --cpu-priority class`` chooses (``opt_class``, :func:`overtake.mdp.priority_classes.choose_classes`).

Pooled over seeds: the mean of the seed means and the half-width sqrt(Σ h²)/k. The raw run is
appended to bench/results/cpu_priority_model.jsonl unless ``--no-write``; BENCHMARKS.md's section is
curated by hand from this output.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _report import append_run, machine

from overtake.api.scenario import load_scenario
from overtake.mdp.mlps import dps_means, fb_mean, mlps_mean
from overtake.mdp.priority import (
    NICE19_WEIGHT,
    CpuPriority,
    age_priority,
    class_priority,
    level_weights,
    short_first_levels,
)
from overtake.mdp.simulation import simulate
from overtake.mdp.thresholds import choose_tandem_thresholds, choose_thresholds, tandem_model_mean

ROOT = Path(__file__).resolve().parents[1]

STRICT = 1e-9
MULTS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


def pooled(model: Any, policy: Any, prio: CpuPriority | None, requests: int, seeds: list[int]) -> dict[str, float]:
    runs = [simulate(model, policy, requests=requests, seed=s, cpu_priority=prio) for s in seeds]
    k = len(runs)
    return {"mean": sum(r.mean_response_time for r in runs) / k,
            "ci95": math.sqrt(sum(r.ci95**2 for r in runs)) / k,
            "seconds": sum(r.seconds for r in runs)}


def fmt(d: dict[str, float]) -> str:
    return f"{d['mean']:.3f} ± {d['ci95']:.3f}"


def search(model: Any, w: float, requests: int, seed: int, start: tuple[float, ...],
           log: Any) -> tuple[tuple[tuple[float], ...], float, int]:
    """Coordinate search of per-stage thresholds by simulation (common random numbers), from the
    better of PS (∞ everywhere) and the visit model's choice ``start``."""
    N = model.n_stages
    grid = [[m * s.mean() for m in MULTS] + [math.inf] for s in model.stages]
    cache: dict[tuple[float, ...], float] = {}

    def ev(th: tuple[float, ...]) -> float:
        if th not in cache:
            prio = age_priority(model, [[x] for x in th], weights=[1.0, w])
            cache[th] = simulate(model, "pi(inf)", requests=requests, seed=seed, cpu_priority=prio).mean_response_time
        return cache[th]

    cur = tuple([math.inf] * N)
    best = ev(cur)
    if ev(start) < best:
        cur, best = start, ev(start)
    for sweep in range(2):
        moved = False
        for i in (list(range(N)) if sweep % 2 == 0 else list(range(N - 1, -1, -1))):
            for x in grid[i]:
                cand = cur[:i] + (x,) + cur[i + 1:]
                v = ev(cand)
                if v < best - 1e-12:
                    best, cur, moved = v, cand, True
        log(f"    sweep {sweep}: {cur} -> {best:.4f} ({len(cache)} points)")
        if not moved:
            break
    return tuple((x,) for x in cur), best, len(cache)


def run_case(c: int, args: argparse.Namespace, w: float, log: Any) -> dict[str, Any]:
    _sc, model = load_scenario(ROOT / "examples" / "table1" / f"case{c:02d}.yaml")
    seeds = [1000 * c + k for k in range(args.seeds)]
    out: dict[str, Any] = {"case": c, "stages": [s.name for s in model.stages],
                           "stage_means": [s.mean() for s in model.stages], "load": model.load}
    t0 = time.perf_counter()
    out["ps"] = {"exact": tandem_model_mean(model), "sim": pooled(model, "pi(inf)", None, args.requests, seeds)}
    ch = choose_tandem_thresholds(model, weights=[1.0, w])
    th = [list(r) for r in ch.priority.thresholds]
    out["visit"] = {
        "thresholds": th, "model_strict": ch.mean_response_time, "evaluations": ch.evaluations,
        "sim_strict": pooled(model, "pi(inf)", age_priority(model, th, weights=[1.0, STRICT]), args.requests, seeds),
        "sim_weight": pooled(model, "pi(inf)", age_priority(model, th, weights=[1.0, w]), args.requests, seeds),
    }
    log(f"  case {c}: PS {out['ps']['exact']:.3f} (sim {fmt(out['ps']['sim'])}); visit model {th} -> "
        f"{ch.mean_response_time:.3f}, sim strict {fmt(out['visit']['sim_strict'])}, "
        f"w {fmt(out['visit']['sim_weight'])}")
    sth, sval, npts = search(model, w, args.search_requests, 7 + c, tuple(r[0] for r in th), log)
    prio = age_priority(model, [list(r) for r in sth], weights=[1.0, w])
    try:
        smodel: float | None = tandem_model_mean(model, age_priority(model, [list(r) for r in sth],
                                                                      weights=[1.0, STRICT]))
    except Exception:  # noqa: BLE001 - a priority the visit model cannot evaluate
        smodel = None
    out["search"] = {"thresholds": [list(r) for r in sth], "search_mean": sval, "points": npts,
                     "model_strict": smodel, "sim_weight": pooled(model, "pi(inf)", prio, args.requests, seeds)}
    log(f"  case {c}: search {out['search']['thresholds']} -> {fmt(out['search']['sim_weight'])} "
        f"(visit model {smodel if smodel is None else round(smodel, 3)})")
    if any(s.phases > 1 for s in model.stages):
        cl = class_priority(model, weights=[1.0, w])
        out["class"] = {"start_levels": [list(r) for r in cl.start_levels or ()],
                        "model_strict": tandem_model_mean(model, class_priority(model, weights=[1.0, STRICT])),
                        "sim_weight": pooled(model, "pi(inf)", cl, args.requests, seeds)}
        log(f"  case {c}: class (short-first) model {out['class']['model_strict']:.3f}, "
            f"sim {fmt(out['class']['sim_weight'])}")
    out["seconds"] = time.perf_counter() - t0
    return out


def spawn_case(c: int, args: argparse.Namespace, w: float, log: Any) -> dict[str, Any]:
    from overtake.mdp import solve
    from overtake.mdp.priority_classes import choose_classes, class_action_optimum

    sc, model = load_scenario(ROOT / "examples" / "table1" / f"case{c:02d}.yaml")
    t0 = time.perf_counter()
    opt = solve(model, truncation=sc.fixed_truncation(), tol=args.tol)
    solve_s = time.perf_counter() - t0
    seeds = [5000 + 1000 * c + k for k in range(args.seeds)]
    cl = class_priority(model, weights=[1.0, w])
    out = {"case": c, "exact_pi_star": opt.metrics.mean_response_time, "solve_seconds": solve_s,
           "pi_star": pooled(model, opt.policy, None, args.requests, seeds),
           "pi_star_class": pooled(model, opt.policy, cl, args.requests, seeds),
           "pi_inf_class": pooled(model, "pi(inf)", cl, args.requests, seeds)}
    log(f"  spawn case {c}: pi* {fmt(out['pi_star'])}, pi*+class {fmt(out['pi_star_class'])}, "
        f"pi(inf)+class {fmt(out['pi_inf_class'])}")
    # exact: class priority by start phase = weighted sharing by phase (H2 phases do not move)
    from dataclasses import replace

    from overtake.mdp.rule_evaluation import evaluate_baseline, evaluate_rule

    if all(np.allclose(s.T, np.diag(np.diag(s.T))) for s in model.stages):
        weighted = replace(model, weights=tuple(1.0 if lv == 0 else w for s in model.stages
                                                for lv in short_first_levels(s)))
        pol = opt.policy
        ex: dict[str, Any] = {"pi_inf": evaluate_baseline(model, "pi(inf)", tol=1e-5).metrics.mean_response_time,
                              "pi_star": opt.metrics.mean_response_time,
                              "pi_inf_class": evaluate_baseline(weighted, "pi(inf)", tol=1e-5).metrics.mean_response_time}
        ex["pi_star_class"] = [evaluate_rule(weighted, pol.layout, pol.rule(), max_requests=C,
                                             max_threads=pol.max_threads).mean_response_time
                               for C in (pol.max_requests, pol.max_requests + 6)]
        t1 = time.perf_counter()
        # what overtake solve --cpu-priority class does: the best of the candidate assignments
        ch = choose_classes(model, weight=w, truncation=sc.fixed_truncation(), tol=args.tol)
        oc = ch.optimum
        by = {lv: ew for lv, ew in ch.candidates}
        short_first = tuple(short_first_levels(s) for s in model.stages)
        ex.update(opt_class=oc.metrics.mean_response_time, opt_class_seconds=time.perf_counter() - t1,
                  opt_class_gain_bounds=list(oc.solve.gain_bounds), class_levels=[list(r) for r in ch.levels],
                  opt_short_first=by[short_first],
                  class_candidates=[{"levels": [list(r) for r in lv], "mean_response_time": ew} for lv, ew in by.items()])
        ex["gap"] = ex["pi_star_class"][-1] / ex["opt_class"] - 1
        if args.class_action:
            # the class as part of the action, on opt_class's own solve truncation
            act = class_action_optimum(model, oc.solve.space.trunc, weight=w, tol=args.class_action_tol)
            ex["class_action"] = {"truncation": [oc.solve.space.trunc.max_requests, oc.solve.space.trunc.k_max],
                                  "states": act.states, "gain": act.gain, "gain_bounds": list(act.gain_bounds),
                                  "mean_response_time": act.mean_response_time, "fixed_gain": act.fixed_gain,
                                  "fixed_mean_response_time": act.fixed_mean_response_time,
                                  "gain_gap": None if act.fixed_gain is None else act.fixed_gain / act.gain - 1,
                                  "low_share": list(act.low_share), "seconds": act.seconds}
            log(f"  spawn case {c}, class as action on C={oc.solve.space.trunc.max_requests}, "
                f"K={oc.solve.space.trunc.k_max} ({act.states:,} states, {act.seconds:.0f} s): g {act.gain:.7f}, "
                f"fixed classes g {act.fixed_gain:.7f} ({100 * ex['class_action']['gain_gap']:+.5f} %), "
                f"low share by phase {[round(x, 4) for x in act.low_share]}")
        out["exact"] = ex
        log(f"  spawn case {c} exact: pi(inf) {ex['pi_inf']:.4f}, pi* {ex['pi_star']:.4f}, pi(inf)+class "
            f"{ex['pi_inf_class']:.4f}, pi*+class {ex['pi_star_class']}, optimum with short-first classes "
            f"{ex['opt_short_first']:.4f}, with the chosen classes {ex['class_levels']} {ex['opt_class']:.4f} "
            f"(pi*+class {100 * ex['gap']:+.2f} % from it)")
    return out


def mg1_table(args: argparse.Namespace, w: float, log: Any) -> dict[str, Any]:
    """The single-M/G/1 table: one M/G/1 with Table 1's H2 at ρ = 0.6, exact and simulated."""
    from overtake.mdp.model import Stage, TandemModel

    h2 = Stage("h2", np.array([0.91, 0.09]), np.diag([-1 / 0.55, -1 / 5.45]))
    model = TandemModel(0.6 / h2.mean(), (h2,))
    lam = model.arrival_rate
    seeds = [90 + k for k in range(args.seeds)]
    ch = choose_thresholds(h2, lam)
    a = list(ch.thresholds)
    thin = [0.25 * k for k in range(1, 41)]
    rows: dict[str, Any] = {"threshold": a[0]}

    def dps(g: float) -> float:
        t = dps_means([lam * 0.91, lam * 0.09], [1 / 0.55, 1 / 5.45], [1.0, g])
        return float(0.91 * t[0] + 0.09 * t[1])

    spec = [("PS", ch.ps, None),
            ("LAS (FB); sim: 40 levels of 0.25", fb_mean(h2, lam),
             age_priority(model, thin, weights=[1e-6**k for k in range(41)])),
            ("two-level age, strict", ch.mean_response_time, age_priority(model, a, weights=[1.0, STRICT])),
            ("two-level age, SCHED_IDLE 3/1024", None, age_priority(model, a, weights=[1.0, w])),
            ("two-level age, nice 19 15/1024", None, age_priority(model, a, weights=[1.0, NICE19_WEIGHT])),
            ("short-first, strict", dps(STRICT), class_priority(model, weights=[1.0, STRICT])),
            ("short-first, SCHED_IDLE 3/1024", dps(w), class_priority(model, weights=[1.0, w])),
            ("short-first, nice 19 15/1024", dps(NICE19_WEIGHT), class_priority(model, weights=[1.0, NICE19_WEIGHT]))]
    for name, exact, prio in spec:
        rows[name] = {"exact": exact, "sim": pooled(model, "pi(inf)", prio, args.mg1_requests, seeds)}
        log(f"  M/G/1 {name}: exact {exact if exact is None else round(exact, 4)}, sim {fmt(rows[name]['sim'])}")
    rows["thin_levels_exact"] = mlps_mean(h2, lam, thin)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="2,3,4,6,7,8,10,11,12")
    ap.add_argument("--requests", type=int, default=1_000_000, help="measured requests per seed per figure")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--search-requests", type=int, default=500_000)
    ap.add_argument("--weight", default="idle", help="weight of the demoted level: a number, niceN or idle "
                    "(default idle = 3/1024, the kernel's table; nice19 = 15/1024)")
    ap.add_argument("--spawn-cases", default="", help="cases for pi* with and without short-first classes")
    ap.add_argument("--mg1", action="store_true", help="the single-M/G/1 table (Table 1's H2 alone at rho = 0.6)")
    ap.add_argument("--mg1-requests", type=int, default=2_000_000)
    ap.add_argument("--tol", type=float, default=1e-3, help="pi* solver tolerance (--spawn-cases)")
    ap.add_argument("--class-action", action="store_true",
                    help="--spawn-cases: also solve the MDP with the CPU class as part of the spawn action")
    ap.add_argument("--class-action-tol", type=float, default=1e-7, help="its RVI span tolerance (relative to g)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    w = level_weights(f"1,{args.weight}" if not args.weight.startswith("nice") and args.weight != "idle"
                      else f"nice0,{args.weight}")[1]

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    doc: dict[str, Any] = {"bench": "cpu_priority_model", "date": dt.datetime.now().isoformat(timespec="seconds"),
                           "machine": machine(), "weight": w, "requests": args.requests, "seeds": args.seeds,
                           "search_requests": args.search_requests, "cases": [], "spawn": []}
    log(f"cpu priority model bench, demoted weight {w:.5g}, {machine()}")
    simulate(load_scenario(ROOT / "examples" / "table1" / "case01.yaml")[1], "pi(inf)", requests=1000)  # numba
    for c in [int(x) for x in args.cases.split(",") if x]:
        doc["cases"].append(run_case(c, args, w, log))
    if args.mg1:
        doc["mg1"] = mg1_table(args, w, log)
    for c in [int(x) for x in args.spawn_cases.split(",") if x]:
        doc["spawn"].append(spawn_case(c, args, w, log))
    doc["seconds"] = time.perf_counter() - t0
    if not args.no_write:
        append_run("cpu_priority_model", doc)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print("| case | PS exact | visit thresholds | visit model (strict) | sim strict | sim w | "
              "search thresholds | sim w | short-first model | sim w |")
        for d in doc["cases"]:
            v, s, cl = d["visit"], d["search"], d.get("class")

            def th(t: Any) -> str:
                return "; ".join(",".join("inf" if math.isinf(x) else f"{x:.3g}" for x in r) for r in t)

            print(f"| {d['case']} | {d['ps']['exact']:.3f} | {th(v['thresholds'])} | {v['model_strict']:.3f} | "
                  f"{fmt(v['sim_strict'])} | {fmt(v['sim_weight'])} | {th(s['thresholds'])} | {fmt(s['sim_weight'])} | "
                  + (f"{cl['model_strict']:.3f} | {fmt(cl['sim_weight'])} |" if cl else "- | - |"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
