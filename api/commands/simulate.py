"""``overtake simulate SCENARIO --policy NAME``: the discrete-event simulator (mdp.simulate).

NAME is a policy file (``overtake solve --out``), ``pi*`` (solved first), ``heuristic`` (the
overtaking heuristic) or a baseline ``pi(k)``, ``pi(k1,...,kN)``, ``pi(inf)``. With
``--service-from`` the stages' service times come from a distribution or a sample instead of the
scenario's PH; the policy then sees the fitted PH's posterior phase (oracle) and, as a second
run, only the prior (realistic) — both are reported.

``--cpu-priority age|class`` puts CPU priority in the model (mdp.priority): threads
demoted by attained service at the stage (``--thresholds auto`` chooses them by the exact
M/G/1 analysis, the tandem through its visit model) or classed by start phase (known-phase
short-first), sharing the CPU by ``--level-weights`` (default: the kernel's nice 0 : SCHED_IDLE
weights, 1024 : 3). The visit model's strict-priority E[W] is reported next to the simulation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from overtake.mdp.errors import ModelError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("simulate", help="simulate a policy: mean response time with 95%% CI, per stage, tails")
    p.add_argument("scenario", help="scenario YAML")
    p.add_argument("--policy", required=True, metavar="NAME",
                   help='policy file (.npz), "pi*", "heuristic", or a baseline "pi(1)", "pi(2,3)", "pi(inf)"')
    p.add_argument("--service-from", action="append", default=[], metavar="[STAGE=]FILE_OR_DIST",
                   help="service times from a file of durations or a scipy.stats spec such as "
                        "'lognorm(s=1)', 'pareto(b=2.5)', 'truncpareto(b=1.2,c=1000)', 'weibull_min(c=0.5)', "
                        "'bimodal(p=0.9,ratio=10)' (rescaled to the stage's mean); once for all stages or per stage")
    p.add_argument("--phase-info", choices=("oracle", "prior", "both", "none", "route"), default="both",
                   help="non-PH service: policy phase from the PH posterior given the work (oracle), "
                        "from the prior only (prior), or both (default). none / route: pi* is the best policy "
                        "that sees counts per stage (per route, stages[].routes) only")
    p.add_argument("--requests", type=int, default=100_000, help="measured requests (default 100000)")
    p.add_argument("--warmup", type=float, default=0.1, help="discarded warm-up, as a fraction of --requests")
    p.add_argument("--batches", type=int, default=30, help="batches for the batch-means CI (default 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-priority", choices=("off", "age", "class"), default="off",
                   help="CPU priority levels: age (demote by attained service at the stage), class "
                        "(known-phase short-first), off (plain PS, default)")
    p.add_argument("--thresholds", metavar="auto|T1[,T2..][;..]", default=None,
                   help="age thresholds in seconds of attained service at the stage: auto (default: exact "
                        "M/G/1 analysis / visit model), one list for all stages, or one per stage separated by ';'")
    p.add_argument("--level-weights", metavar="W0,W1,..", default=None,
                   help="CPU weight per level, numbers or niceN/idle (default nice0,idle = 1, 3/1024 by the "
                        "kernel's tables; give the measured ratio)")
    p.add_argument("--json", action="store_true", help="print the JSON document on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _policy(name: str, sc: Any, model: Any, progress: Any, phase_info: str = "full") -> Any:
    from overtake.mdp import solve
    from overtake.mdp.policy import Policy

    if name.strip() in ("pi*", "π*"):
        return solve(model, truncation=sc.fixed_truncation(), tol=sc.tolerance, progress=progress,
                     phase_info=phase_info, routes=sc.build_routes(model)).policy
    path = Path(name)
    if path.suffix == ".npz" or path.exists():
        if not path.exists():
            raise ModelError(f"--policy: policy file {name} does not exist (write one with `overtake solve --out`)")
        return Policy.load(path)
    return name


def _services(specs: list[str], model: Any) -> list[Any] | None:
    from overtake.mdp.simulation import service_from_spec

    if not specs:
        return None
    names = [s.name for s in model.stages]
    per: dict[int, str] = {}
    for spec in specs:
        head, sep, rest = spec.partition("=")
        if sep and head.strip() in names and "(" not in head:
            per[names.index(head.strip())] = rest
        elif len(specs) == 1:
            per = {i: spec for i in range(len(names))}
        else:
            raise ModelError(f"--service-from {spec!r}: with several --service-from give STAGE=SPEC, STAGE one of {names}")
    missing = [names[i] for i in range(len(names)) if i not in per]
    if missing:
        raise ModelError(f"--service-from: no service given for stage(s) {missing}; give STAGE=SPEC for each")
    return [service_from_spec(per[i], model.stages[i].mean()) for i in range(len(names))]


def _priority(args: argparse.Namespace, model: Any, progress: Any) -> tuple[Any, float | None]:
    """The CPU priority from the flags, and the visit model's E[W] for it (or None)."""
    from overtake.mdp import priority as pr
    from overtake.mdp import thresholds as th

    if args.cpu_priority == "off":
        if args.thresholds is not None or args.level_weights is not None:
            raise ModelError("--thresholds/--level-weights need --cpu-priority age or class")
        return None, None
    weights = pr.level_weights(args.level_weights) if args.level_weights is not None else None
    spec = (args.thresholds or "auto").strip()
    rows: list[list[float]] | None = None
    if spec != "auto":
        try:
            rows = [[float(x) for x in part.split(",")] for part in spec.split(";")]
        except ValueError:
            raise ModelError(f"--thresholds: give auto, T1,T2,.. or one list per stage separated by ';', "
                             f"got {spec!r}") from None
        if len(rows) == 1:
            rows = rows * model.n_stages
        elif len(rows) != model.n_stages:
            raise ModelError(f"--thresholds: {len(rows)} lists for {model.n_stages} stages")
    levels = len(weights) if weights is not None else (len(rows[0]) + 1 if rows else 2)
    if args.cpu_priority == "class":
        prio = pr.class_priority(model, weights=weights)
        if rows is not None:
            prio = pr.CpuPriority(prio.weights, tuple(tuple(r) for r in rows), prio.start_levels,
                                  prio.name + " + age")
    elif rows is None:
        if progress:
            progress("choosing age thresholds by the exact analysis ...")
        if model.n_stages == 1:
            ch = th.choose_thresholds(model.stages[0], model.arrival_rate, levels=levels)
            prio = pr.age_priority(model, ch.thresholds, weights=weights)
        else:
            prio = th.choose_tandem_thresholds(model, levels=levels, weights=weights).priority
    else:
        prio = pr.age_priority(model, rows, weights=weights)
    try:
        predicted: float | None = th.tandem_model_mean(model, prio)
    except ModelError:
        predicted = None
    return prio, predicted


def _print(doc: dict[str, Any]) -> None:
    print(f"{doc['policy']} on {doc['service']} (policy phase: {doc['phase_info']}): "
          f"E[W] = {doc['mean_response_time']:.4f} ± {doc['ci95']:.4f} (95% CI, {doc['batches']} batch means), "
          f"{doc['requests']} requests, {doc['seconds']:.2f} s")
    pc = "  ".join(f"{k} {v:.3f}" for k, v in doc["percentiles"].items())
    print(f"  response time: {pc}")
    print(f"  mean threads {doc['mean_threads']:.3f}, mean in system {doc['mean_in_system']:.4f} "
          f"(Little residual {doc['little_residual']:+.4f})")
    for s in doc["stages"]:
        print(f"  {s['name']:<12} sojourn {s['mean_sojourn']:.4f}  waiting {s['mean_waiting']:.4f}  "
              f"threads {s['mean_threads']:.3f}")
    cp = doc.get("extra", {}).get("cpu_priority")
    if cp:
        th = "; ".join(",".join(f"{x:.4g}" for x in r) for r in cp["thresholds"])
        print(f"  cpu priority: {cp['name']}, weights {', '.join(f'{w:.4g}' for w in cp['weights'])}, "
              f"thresholds {th or '-'}; threads per level "
              + ", ".join(f"{x:.3f}" for x in doc["extra"]["mean_threads_per_level"]))
        if doc["extra"].get("model_mean_response_time") is not None:
            print(f"  visit model (strict priority, pi(inf)): E[W] = {doc['extra']['model_mean_response_time']:.4f}")


def run(args: argparse.Namespace) -> int:
    if args.requests < 1:
        raise ModelError(f"--requests must be >= 1, got {args.requests}")
    # the solver's imports only once the options have parsed
    from overtake.api.cli import started
    from overtake.api.scenario import load_scenario
    from overtake.mdp.baselines import Baseline
    from overtake.mdp.policy import Policy
    from overtake.mdp.simulation import simulate

    sc, model = load_scenario(args.scenario)
    started()  # the collector back on (overtake.api.cli.program held it for the imports)
    progress = None if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    observed = args.phase_info in ("none", "route")
    policy = _policy(args.policy, sc, model, progress, args.phase_info if observed else "full")
    service = _services(args.service_from, model)
    prio, predicted = _priority(args, model, progress)
    kw = {"requests": args.requests, "seed": args.seed, "warmup": args.warmup, "batches": args.batches,
          "cpu_priority": prio}
    if service is None:
        doc = simulate(model, policy, **kw).to_dict()
        docs = [doc]
    else:
        blind = isinstance(policy, str) and not policy.strip().startswith("heuristic")
        counts_only = isinstance(policy, Policy) and policy.observed
        modes = ["oracle", "prior"] if args.phase_info in ("both", "none", "route") else [args.phase_info]
        if blind:
            Baseline.parse(policy, model.n_stages)  # phase-blind: one run answers both modes
        if blind or counts_only:
            modes = modes[:1]
        runs = [simulate(model, policy, service=service, phase=m, **kw).to_dict() for m in modes]  # type: ignore[arg-type]
        doc = runs[0]
        if blind:
            doc["phase_info"] = "not used (phase-blind baseline)"
        elif counts_only:
            doc["phase_info"] = f"not used (the policy sees counts only: {policy.phase_info})"
        if len(runs) > 1:
            doc["prior_phase"] = runs[1]
        docs = runs
    if prio is not None:
        for d in docs:
            d["extra"]["model_mean_response_time"] = predicted
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    for d in docs:
        _print(d)
    return 0
