"""Value of information on van der Weij et al.'s Table 1: what each level of phase knowledge is worth.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/value_of_information.py [--cases 1,2,...] [--tol 0.001]
        [--jobs 2] [--no-route] [--merge] [--record] [--json] [--no-write]

Per case, every E[W] exact (auto-truncation to relative accuracy --tol):

* ``full``  — π* with every request's phase known (van der Weij et al.; ``overtake compare``);
* ``start`` — π* that sees a phase once its thread starts (``--phase-info start``);
* ``route`` — the best observation policy when each request's route is seen (stages with two
  phases only, split below; ``--phase-info route``);
* ``none``  — the best observation policy: waiting and active counts per stage (``--phase-info none``);
* the baselines π(1), π(2), π(∞) (π(4), π(1,1) enter ``none``'s minimum too) and the overtaking
  heuristic (which needs every phase).

``none`` is never worse than a baseline by construction (mdp/observed.py); the table says where it
beats every one of them and by how much: (E W(best baseline) − E W(none)) / E W(none).

Route split of a two-phase (H2) stage with prior α = (a, 1 − a) on its (short, long) phases: route
classes with short-phase shares s_r, the lightest route taking the weight the others leave,
the others equally weighted, so that Σ_r p_r (s_r, 1 − s_r) = α. With one H2 stage: three routes,
99/1, 50/50 and 10/90 (the issue's 90/10 cannot average to a = 0.91); with two H2 stages: two per
stage, 99/1 and 10/90 (three per stage would make the route chain 6 queues wide, beyond the
state budget at Table 1's caps).

``--record`` appends the run to bench/results/value_of_information.jsonl and replaces the
``value-of-information`` section of bench/results/sections.md; ``--json`` prints the run's document. With
``--merge`` the section also shows every Table 1 case this run did not solve, each from the latest
recorded run that has it (the raw run keeps its own cases only; the section names each case's
run), so that cases can be solved one run at a time. ``--no-route`` skips the ``route`` solves (the
slow part; the section says where ``route`` applies but was not run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from _report import add_output_arguments, command_line, machine, publish, read_runs

from overtake.api.scenario import load_scenario
from overtake.mdp import solve
from overtake.mdp.heuristic import evaluate_heuristic
from overtake.mdp.model import TandemModel
from overtake.mdp.observed import solve_observed
from overtake.mdp.routes import RouteSplit

ROOT = Path(__file__).resolve().parents[1]
MIXES_ONE = (("light", 0.99), ("mixed", 0.5), ("heavy", 0.1))
MIXES_TWO = (("light", 0.99), ("heavy", 0.1))
SHOWN = ("pi(1)", "pi(2)", "pi(inf)")


def route_split(model: TandemModel) -> RouteSplit | None:
    """The module docstring's split, or None when no stage has two phases."""
    h2 = [i for i, st in enumerate(model.stages) if st.phases == 2]
    if not h2:
        return None
    mixes = MIXES_ONE if len(h2) == 1 else MIXES_TWO
    routes: list[list[tuple[str, float, list[float]]] | None] = [None] * model.n_stages
    for i in h2:
        st = model.stages[i]
        short = int(np.argmin(st.phase_means()))
        a = float(st.alpha[short])
        (light, s_l), others = mixes[0], mixes[1:]
        x = (s_l - a) / (len(others) * s_l - sum(s for _, s in others))  # weight of each other route
        rs = []
        for name, s_r in mixes:
            alpha = [0.0, 0.0]
            alpha[short], alpha[1 - short] = s_r, 1.0 - s_r
            rs.append((name, 1.0 - len(others) * x if name == light else x, alpha))
        routes[i] = rs
    return RouteSplit.build(model, routes)


def run_case(c: int, tol: float, route: bool = True) -> dict[str, Any]:
    """One case in its own process: the four information levels (``route`` only if asked and a
    stage has two phases), the baselines and the heuristic; ``seconds`` per solve."""
    _, model = load_scenario(ROOT / "examples" / "table1" / f"case{c:02d}.yaml")

    def log(s: str) -> None:
        print(f"case {c}: {s}", file=sys.stderr, flush=True)

    out: dict[str, Any] = {"case": c, "arrival_rate": model.arrival_rate, "ew": {}, "seconds": {}}
    t = time.perf_counter()
    full = solve(model, tol=tol, progress=log)
    out["ew"]["full"], out["seconds"]["full"] = full.metrics.mean_response_time, time.perf_counter() - t
    t = time.perf_counter()
    start = solve(model, phase_info="start", tol=tol, progress=log)
    out["ew"]["start"], out["seconds"]["start"] = start.metrics.mean_response_time, time.perf_counter() - t
    t = time.perf_counter()
    none = solve_observed(model, tol=tol, progress=log)
    out["ew"]["none"], out["seconds"]["none"] = none.metrics.mean_response_time, time.perf_counter() - t
    out["none"] = _summary(none)
    for name, ev in none.baselines.items():
        out["ew"][name] = ev.metrics.mean_response_time
    split = route_split(model)
    if split is not None and not route:
        out["route_skipped"] = True
    if split is not None and route:
        t = time.perf_counter()
        ro = solve_observed(model, phase_info="route", routes=split, tol=tol, none_optimum=none, progress=log)
        out["ew"]["route"], out["seconds"]["route"] = ro.metrics.mean_response_time, time.perf_counter() - t
        out["route"] = {**_summary(ro), "split": split.to_dict()}
    t = time.perf_counter()
    out["ew"]["heuristic"] = evaluate_heuristic(model, tol=tol).metrics.mean_response_time
    out["seconds"]["heuristic"] = time.perf_counter() - t
    base = {k: v for k, v in out["ew"].items() if k.startswith("pi(")}
    best = min(base, key=lambda k: base[k])
    out["best_baseline"] = best
    out["none_gain_over_best_baseline"] = (base[best] - out["ew"]["none"]) / out["ew"]["none"]
    out["none_gain_over_pi_inf"] = (base["pi(inf)"] - out["ew"]["none"]) / out["ew"]["none"]
    return out


def _summary(opt: Any) -> dict[str, Any]:
    steps = [h for h in opt.solve.history if h.get("accepted")]
    unsettled = [t for t in opt.trace if t.get("settled") is False]
    return {"source": opt.source, "candidates": opt.candidates, "steps": len(steps), "evaluations": opt.solve.sweeps,
            "states": opt.solve.space.size, "solve_cap": opt.truncation.max_requests,
            "threads": opt.truncation.k_max, "unsettled": [t.get("reason") for t in unsettled],
            "trace": [{k: v for k, v in t.items() if k != "starting_gains"} for t in opt.trace]}


ROWS = (("full", "full"), ("start", "start"), ("route", "route"), ("none", "none"), ("pi(1)", "π(1)"),
        ("pi(2)", "π(2)"), ("pi(4)", "π(4)"), ("pi(inf)", "π(∞)"), ("heuristic", "heuristic"))


def _baselines(ew: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in ew.items() if k.startswith("pi(")}


def complete(r: dict[str, Any]) -> dict[str, Any]:
    """A case entry with the fields :func:`section` reads, derived from its ``ew`` where missing
    (the 2026-11-24 record was parsed from logs: ``ew`` only)."""
    r = dict(r)
    base = _baselines(r["ew"])
    best = min(base, key=lambda k: base[k])
    none = r["ew"]["none"]
    r.setdefault("best_baseline", best)
    r.setdefault("none_gain_over_best_baseline", (base[best] - none) / none)
    r.setdefault("none_gain_over_pi_inf", (base["pi(inf)"] - none) / none)
    return r


def merge(cases: dict[int, dict[str, Any]], runs: list[dict[str, Any]], wanted: range = range(1, 13)
          ) -> dict[int, dict[str, Any]]:
    """``cases`` (this run's) and, for every other case in ``wanted``, the entry of the latest
    recorded run that has it (``runs`` oldest first, as :func:`_report.read_runs` returns them),
    each completed (:func:`complete`) and marked with the ``run`` it comes from (date, command,
    tolerance: the record's own, else 0.001, the only one ever used here)."""
    out = {c: complete(r) for c, r in cases.items()}
    for c in wanted:
        if c in out:
            continue
        for rec in reversed(runs):
            got = ((rec.get("figures") or {}).get("cases") or {}).get(str(c))
            if got is not None and "ew" in got:
                run = got.get("run") or {"date": rec["date"], "command": rec.get("command", ""),
                                         "tol": (rec.get("figures") or {}).get("tol", 1e-3)}
                out[c] = {**complete(got), "run": run}
                break
    return out


def with_merged(doc: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """``doc`` with ``merged``: the other Table 1 cases from ``runs`` (:func:`merge`), for :func:`section`."""
    cases = {int(c): r for c, r in doc["cases"].items()}
    merged = merge(cases, runs)
    return {**doc, "merged": {str(c): merged[c] for c in sorted(merged) if c not in cases}}


def _when(date: str) -> str:
    return date[:16].replace("T", " ").rstrip("Z")


def _ranges(cs: list[int]) -> str:
    out: list[str] = []
    for c in sorted(cs):
        if out and out[-1].split("–")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('–')[0]}–{c}"
        else:
            out.append(str(c))
    return ", ".join(out)


def _cases(cs: list[int]) -> str:
    return "" if not cs else f"case {cs[0]}" if len(cs) == 1 else f"cases {_ranges(cs)}"


def table(cases: dict[int, dict[str, Any]]) -> list[str]:
    """Cases as columns (twelve columns keep the table short): one row per E[W],
    then none against the best baseline."""
    cs = sorted(cases)
    lines = ["| E[W] \\ case | " + " | ".join(map(str, cs)) + " |", "|---|" + "---:|" * len(cs)]
    for key, label in ROWS:
        cells = []
        for c in cs:
            r = cases[c]
            if key in r["ew"]:
                cells.append(f"{r['ew'][key]:.4f}")
            else:
                cells.append("not run" if key == "route" and r.get("route_skipped") else "–")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    verdicts = []
    for c in cs:
        r = cases[c]
        g, b = r["none_gain_over_best_baseline"], r["best_baseline"].replace("pi(inf)", "π(∞)").replace("pi", "π")
        verdicts.append(f"**{100 * g:+.2f} %** vs {b}" if g > r.get("run", {}).get("tol", 1e-3) else f"{100 * g:+.2f} % vs {b}" if g > 5e-5 else f"tie ({b})")
    lines.append("| none vs best baseline | " + " | ".join(verdicts) + " |")
    return lines


def check(cases: dict[int, dict[str, Any]]) -> bool:
    """The issue's invariants on every case: E W(none) ≤ every baseline, full ≤ start ≤ none and,
    where route was run, full ≤ route ≤ none (each to its run's tolerance)."""
    def ok(r: dict[str, Any]) -> bool:
        ew, tol = r["ew"], r.get("run", {}).get("tol", 1e-3)
        return (ew["none"] <= min(_baselines(ew).values()) * (1 + 1e-9)
                and ew["full"] <= ew["start"] * (1 + tol) and ew["start"] <= ew["none"] * (1 + tol)
                and ew.get("route", 0.0) <= ew["none"] * (1 + tol)
                and ew["full"] <= ew.get("route", np.inf) * (1 + tol))
    return all(ok(r) for r in cases.values())


def section(doc: dict[str, Any]) -> str:
    """The write-up: this run's cases and, with ``--merge``, the others' latest runs."""
    results = {int(c): r for c, r in doc["cases"].items()}
    results.update({int(c): r for c, r in doc.get("merged", {}).items()})
    this = [c for c in results if str(c) in doc["cases"]]
    tol = max(r.get("run", {}).get("tol", doc["tol"]) for r in results.values())
    gain = {c: results[c]["none_gain_over_best_baseline"] for c in results}
    wins = [c for c in sorted(results) if gain[c] > tol]
    close = [c for c in sorted(results) if 5e-5 < gain[c] <= tol]
    ties = [c for c in sorted(results) if gain[c] <= 5e-5]
    def above(c: int, a: str, b: str) -> str:
        """'case c: a is x % above b' when it is by more than truncation noise between equal policies."""
        ew = results[c]["ew"]
        if a in ew and b in ew and ew[a] > ew[b] * (1 + 1e-5):
            return f"case {c}: {a} {100 * (ew[a] / ew[b] - 1):.3f} % above {b}"
        return ""

    loose = [x for c in sorted(results) for x in (above(c, "full", "start"), above(c, "start", "none"),
                                                  above(c, "full", "route")) if x]

    def span(cs: list[int]) -> str:
        g = [100 * gain[c] for c in cs]
        return f"{min(g):.2f} %" if len(g) == 1 else f"{min(g):.2f}–{max(g):.2f} %"

    by_run: dict[str, list[int]] = {}
    for c in sorted(results):
        if c not in this:
            by_run.setdefault(results[c]["run"]["date"], []).append(c)
    skipped = [c for c in sorted(results) if results[c].get("route_skipped")]
    prov = [f"{_cases(this)}: `{doc['command']}`, {_when(doc['date'])} UTC, {doc['machine']} at the end, "
            f"{doc['wall_seconds']:.0f} s wall"] if this else []
    for date, cs in by_run.items():
        cmd = results[cs[0]]["run"].get("command", "")
        prov.append(f"{_cases(cs)}: the run of {_when(date)} UTC" + (f" (`{cmd}`)" if cmd else ""))
    routed = [c for c in sorted(results) if "route" in results[c]["ew"]]
    capped = [c for c in routed if isinstance(results[c].get("route"), dict) and results[c]["route"].get("unsettled")]
    caps: dict[tuple[int, int], list[int]] = {}
    for c in capped:
        caps.setdefault((results[c]["route"]["solve_cap"], results[c]["route"]["threads"]), []).append(c)
    untraced = [c for c in routed if not isinstance(results[c].get("route"), dict)]
    return "\n".join([
        "## value-of-information: what each level of phase knowledge is worth, van der Weij et al.'s Table 1",
        f"Conclusion: E W(none) ≤ every baseline and full ≤ start ≤ none (full ≤ route ≤ none) on all {len(results)} cases: "
        f"{'yes' if check(results) else '**no**'}"
        + (f" (within the tolerance: {'; '.join(loose)})" if loose else "")
        + f". `none` beats every baseline by more than the tolerance in {_cases(wins) or 'no case'}"
        + (f" (by {span(wins)})" if wins else "")
        + (f", and by {span(close)}, less than the tolerance, in {_cases(close)}" if close else "")
        + (f"; in {_cases(ties)} its best is a baseline" if ties else "") + ". "
        + (f"`route` where it applies: {_cases(routed)}" if routed else "")
        + (f"; not run in {_cases(skipped)} (the time this session had)" if skipped else "")
        + (" (route tables optimised on "
           + "; ".join(f"request cap {C} with {K} threads in {_cases(cs)}" for (C, K), cs in caps.items())
           + ": a larger solve cap would exceed the 40,000-state budget, so their optimality there is unchecked; "
           "their E[W] is exact all the same" + (f"; {_cases(untraced)}: no solve trace recorded" if untraced else "")
           + ")" if capped else "") + ". "
        f"Every E[W] exact (auto-truncation, tolerance {tol:g}): `full` π* (every phase known; van der Weij et al.), `start` (a "
        "phase seen once its thread starts), `route` (each request's route class seen, not its phase: three classes "
        "with short-phase shares 99/50/10 % on a single H2 stage, two (99/10 %) on each of two), `none` (waiting "
        "and active counts per stage only: a sidecar without a phase header), the best observation policy found by "
        "observation-restricted policy improvement, each step accepted on exact evaluation (mdp/observed.py); "
        "none vs best baseline = (E W(best baseline) − E W(none)) / E W(none), over π(1), π(2), π(4), π(∞), "
        "π(1,1). Runs (`--merge`: each case from the latest run that has it; raw runs in "
        "`bench/results/value_of_information.jsonl`): " + "; ".join(prov) + ".",
        *table(results),
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(str(i) for i in range(1, 13)))
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--jobs", type=int, default=2, help="cases run in parallel, one process each")
    ap.add_argument("--no-route", action="store_true",
                    help="skip the route solves (the slow part); the section says where route was not run")
    ap.add_argument("--merge", action="store_true",
                    help="the section also shows every other Table 1 case, from the latest recorded run that has "
                    "it (bench/results/value_of_information.jsonl); the raw run keeps this run's cases only")
    add_output_arguments(ap)
    args = ap.parse_args()
    cases = [int(x) for x in args.cases.split(",")]
    order = sorted(cases, key=lambda c: -(c in (4, 8, 12)))  # the two-H2 cases are the longest: first
    wall0 = time.perf_counter()
    results: dict[int, dict[str, Any]] = {}
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        n = len(order)
        for r in pool.map(run_case, order, [args.tol] * n, [not args.no_route] * n):
            results[r["case"]] = r
            print(f"case {r['case']} done: " + ", ".join(f"{k} {v:.4f}" for k, v in r["ew"].items())
                  + "; seconds " + ", ".join(f"{k} {v:.0f}" for k, v in r["seconds"].items()),
                  file=sys.stderr, flush=True)
    command = command_line()
    date = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    for r in results.values():
        r["run"] = {"date": date, "command": command, "tol": args.tol}
    doc: dict[str, Any] = {
        "bench": "value_of_information", "date": date,
        "machine": machine(), "load_average_end": os.getloadavg()[0], "command": command, "tol": args.tol,
        "wall_seconds": time.perf_counter() - wall0, "cases": {str(c): results[c] for c in sorted(results)},
    }
    text_doc = with_merged(doc, read_runs("value_of_information")) if args.merge else doc
    if args.merge:
        doc["merged_from"] = {c: r["run"]["date"] for c, r in text_doc["merged"].items()}
    publish(args, "value-of-information", section(text_doc), doc, command=command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
