"""The value of modelling the correlation between a transaction's stages.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/coupled_policy.py [--cases h2[,herl]] [--tol 1e-4]
        [--record] [--json] [--no-write]

A transaction is a preview then a view of one article, and a big article is expensive in both.
Each case is a two-stage tandem at load 0.6 whose stages are mixtures of a small and a big class,
the class kept from stage 1 to stage 2 (routing R = I between the class phases,
:attr:`overtake.mdp.model.TandemModel.routing`):

* ``h2``: each stage H2, 0.8 of mean 0.5 and 0.2 of mean 3 (scv 3). Correlation 1/3: a
  two-phase stage's exponential classes keep at most p/(1 + p) of the variance between classes.
* ``herl``: each stage 0.9 exponential of mean 0.5 and 0.1 Erlang-2 of mean 5.5 (scv 4, three
  phases); the Erlang big class halves the variance within it: correlation 0.56. A correlation of
  0.9 with scv ≈ 3 needs Erlang branches of order ~9, beyond an exact solve's state budget. Its
  solves have some 2·10⁶ states each: opt-in (``--cases h2,herl``), the default runs ``h2``.

Per case, every E[W] exact in the coupled model: π*(coupled), the coupled model's own optimum;
π*(independent), the optimum of the model that draws each stage's start phase independently,
evaluated in the coupled model (the policy an operator gets without modelling the correlation),
with the gap between the two; what the independent model predicts for its own optimum; and the
baselines π(1), π(2), π(∞) in the coupled model. Both optima are auto-truncated to ``--tol`` and
evaluated on one common truncation.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import time
from typing import Any

import numpy as np
from _report import add_output_arguments, command_line, machine, publish

from overtake.fitting.coupled import CoupledPH
from overtake.fitting.phase_type import PhaseType
from overtake.mdp import Stage, TandemModel, solve
from overtake.mdp.rule_evaluation import evaluate_baseline, evaluate_rule
from overtake.mdp.statespace import Layout

LOAD = 0.6
BASELINES = ("pi(1)", "pi(2)", "pi(inf)")


def stage(name: str, case: str) -> Stage:
    if case == "h2":
        return Stage(name, np.array([0.8, 0.2]), np.diag([-2.0, -1.0 / 3.0]))
    # 0.9 × Exp(mean 0.5), 0.1 × Erlang-2 of mean 5.5 (two phases of rate 2/5.5)
    r = 2.0 / 5.5
    T = np.array([[-2.0, 0.0, 0.0], [0.0, -r, r], [0.0, 0.0, -r]])
    return Stage(name, np.array([0.9, 0.1, 0.0]), T)


def routing(case: str) -> np.ndarray:
    """Keep the class: the small phase starts the small phase, the big class's exit starts the big class."""
    if case == "h2":
        return np.eye(2)
    return np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])  # row 1 never exits (Erlang's first)


def run_case(case: str, tol: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    a, b = stage("preview", case), stage("view", case)
    lam = LOAD / (a.mean() + b.mean())
    ind = TandemModel(lam, (a, b))
    cpl = TandemModel(lam, (a, b), routing=[routing(case)])
    corr = CoupledPH.build(PhaseType(a.alpha, a.T), b.T, routing(case)).correlation()
    scv = [s.second_moment() / s.mean() ** 2 - 1 for s in (a, b)]
    oi = solve(ind, tol=tol)
    oc = solve(cpl, tol=tol)
    C = 2 * max(oi.truncation.max_requests, oc.truncation.max_requests)
    K = max(oi.truncation.k_max, oc.truncation.k_max)
    lay = Layout.build(cpl, "full")
    ew_ind = evaluate_rule(cpl, lay, oi.policy.actions, max_requests=C, max_threads=K).mean_response_time
    ew_cpl = evaluate_rule(cpl, lay, oc.policy.actions, max_requests=C, max_threads=K).mean_response_time
    ew: dict[str, float] = {"pi*(coupled)": ew_cpl, "pi*(independent)": ew_ind}
    for name in BASELINES:
        ew[name] = evaluate_baseline(cpl, name, tol=tol).metrics.mean_response_time
    return {
        "case": case, "load": LOAD, "correlation": corr, "scv": scv,
        "truncation": {"coupled": [oc.truncation.max_requests, oc.truncation.k_max],
                       "independent": [oi.truncation.max_requests, oi.truncation.k_max], "evaluated": [C, K]},
        "states": {"coupled": oc.solve.space.size, "independent": oi.solve.space.size},
        "ew": ew, "gap": (ew_ind - ew_cpl) / ew_cpl,
        "independent_prediction": oi.metrics.mean_response_time,
        "prediction_error": (oi.metrics.mean_response_time - ew_ind) / ew_ind,
        "seconds": time.perf_counter() - t0,
    }


def section(doc: dict[str, Any]) -> str:
    lines = [
        "## coupled-policy: the value of modelling the correlation between stages", "",
        f"`{doc['command']}` ({doc['date']}; {doc['machine']}). E[W] exact in the coupled model; gap = "
        "(E W(π*(independent)) − E W(π*(coupled))) / E W(π*(coupled)); prediction = what the independent "
        "model predicts for its own optimum.", "",
        "| case | corr | scv | π*(coupled) | π*(independent) | gap | prediction (error) | π(1) | π(2) | π(∞) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["cases"].values():
        e = r["ew"]
        lines.append(
            f"| {r['case']} | {r['correlation']:.2f} | {r['scv'][0]:.2f} | {e['pi*(coupled)']:.4f} | "
            f"{e['pi*(independent)']:.4f} | {100 * r['gap']:+.2f} % | {r['independent_prediction']:.4f} "
            f"({100 * r['prediction_error']:+.1f} %) | {e['pi(1)']:.4f} | {e['pi(2)']:.4f} | {e['pi(inf)']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="h2", help="comma-separated: h2 (default), herl (some 2e6 states a solve)")
    ap.add_argument("--tol", type=float, default=1e-4, help="relative accuracy of each E[W]")
    add_output_arguments(ap)
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in ("h2", "herl")]
    if bad:
        ap.error(f"--cases: unknown case(s) {bad}; choose from h2, herl")
    t0 = time.perf_counter()
    command = command_line()
    doc: dict[str, Any] = {
        "bench": "coupled_policy", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(), "command": command, "tol": args.tol,
        "cases": {c: run_case(c, args.tol) for c in cases},
    }
    doc["wall_seconds"] = time.perf_counter() - t0
    doc["load_average_end"] = os.getloadavg()[0]
    publish(args, "coupled-policy", section(doc), doc, command=command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
