"""``overtake solve SCENARIO --out POLICY``: solve π* and write the policy artifact."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from overtake import install_hint
from overtake.api.commands.defaults import DEFAULT_MAX_STATES
from overtake.mdp.errors import ModelError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("solve", help="solve the optimal thread policy and write it as a file")
    p.add_argument("scenario", help="scenario YAML")
    p.add_argument("--out", help="policy file to write (.npz); required unless a constraint is given")
    p.add_argument("--phase-info", choices=("full", "start", "none", "route"), default=None,
                   help="what the policy sees: full, a waiting request's phase (van der Weij et al.); start, the phase "
                        "once its thread starts; none, counts per stage only; route, counts per route "
                        "(stages[].routes). Default: the scenario's phase_info, else full")
    p.add_argument("--method", choices=("anderson", "rvi", "pi"), default="anderson",
                   help="anderson: relative value iteration with Anderson acceleration (default, the fastest "
                        "measured); rvi: plain; pi: policy iteration")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--max-states", type=int, default=DEFAULT_MAX_STATES, metavar="N",
                   help="refuse (exit 2, before building anything) when pi*'s estimated state space exceeds N; "
                        "the auto-truncation ladder stops at N too (default %(default)s: minutes and a few GB)")
    p.add_argument("--cpu-priority", choices=("age", "class"), default=None,
                   help="mod_overtake_prio's CPU priority in Apache: age (also predict the policy, and "
                   "pi(inf), with age priority, simulated; a stage with a lock is exempt, never demoted) or "
                   "class (two CPU classes by phase, by expected "
                   "remaining work: the spawn policy optimal under each candidate assignment, the best kept; "
                   "exact for hyperexponential stages); stored in the "
                   "policy file for the sidecar's auto mode")
    p.add_argument("--plot", metavar="PNG", help="also write the policy as heatmaps over the two stages' queues")
    p.add_argument("--max-mean-threads", type=float, metavar="T",
                   help="constrained optimum (LP): mean active threads at most T (a memory budget)")
    p.add_argument("--stage-sla", action="append", default=[], metavar="STAGE=SECONDS",
                   help="constrained optimum (LP): mean sojourn at STAGE at most SECONDS; repeatable")


def run(args: argparse.Namespace) -> int:
    # the solver's imports only once the options have parsed
    from overtake.api.cli import started
    from overtake.api.scenario import load_scenario
    from overtake.mdp.budget import check_budget

    sc, model = load_scenario(args.scenario)
    args.phase_info = args.phase_info or sc.phase_info
    if model.coupled and args.phase_info != "full":
        raise ValueError(f"--phase-info {args.phase_info}: a scenario with routing (coupled stages) writes a policy "
                         "for phase_info full only (a phase-blind policy of coupled stages queues by routing row, "
                         "which the sidecar does not see); use --phase-info full or drop routing")
    routes = sc.build_routes(model)
    # before anything is built: a model too large for the machine is refused as one line
    check_budget(model, max_states=args.max_states, truncation=sc.fixed_truncation(), phase_info=args.phase_info)
    started()  # the collector back on (overtake.api.cli.program held it for the imports)
    if args.max_mean_threads is not None or args.stage_sla:
        if args.phase_info in ("none", "route"):
            raise ValueError(f"--phase-info {args.phase_info}: the constrained optimum (--max-mean-threads, "
                             "--stage-sla) needs full or start")
        return _run_constrained(args, sc, model)
    if args.out is None:
        raise ValueError("--out: give the policy file to write, e.g. --out policy.npz")
    if args.cpu_priority == "class":
        _check_class_priority(args, model)
    after = _After(args, model)
    opt, choice = _solve_pi_star(args, sc, model, routes, after.start)
    pol = opt.policy
    rules, prio = after.finish(opt, choice)
    meta = _policy_meta(args, sc, model, opt, rules)
    pol.meta.update(meta)
    if prio is not None:
        pol.meta["cpu_priority"] = prio
    pol.save(args.out)
    if args.plot:
        from overtake.api.plots import policy_figure

        policy_figure(pol).savefig(args.plot, dpi=100)
    print(json.dumps(_document(args, sc, model, opt), indent=2))
    if not args.quiet:
        print(phases_text(model, sc.time_unit), file=sys.stderr)
    if "rules" in meta and not args.quiet:
        print(f"overtaking rules (agree with pi* on {meta['rules']['agreement']:.1%} of decisions):", file=sys.stderr)
        for line in meta["rules"]["text"]:
            print("  " + line, file=sys.stderr)
    return 0


#: the policy's states from which its overtaking rules go to the second core: below it they take
#: less than the worker's start (the fork, its answer pickled back, its exit), e.g. those of Table
#: 1's full-information policies (up to about a hundred thousand states: measured, the crossover
#: is near twenty thousand)
RULES_BESIDE_MIN_STATES = 20_000


def _rules_beside(policy: Any) -> bool:
    return int(policy.keys.size) >= RULES_BESIDE_MIN_STATES


class _After:
    """What the command does with the solved policy besides saving it: its overtaking rules (full
    information) and its CPU-priority prediction.

    Each runs on the second core (:mod:`overtake.api.beside`): the age thresholds and π(∞) with
    them from the start (they need no policy); the rules and the policy's simulation as soon as the
    solve has the policy it will most likely return (:meth:`start`, the solve's ``candidate``),
    kept when it is returned; otherwise (or without that candidate) after the solve, the rules
    beside the simulation. The rules of a policy below :data:`RULES_BESIDE_MIN_STATES` states are
    extracted here after the solve instead. Every figure is the one computed in order in one process.
    """

    def __init__(self, args: argparse.Namespace, model: Any) -> None:
        from overtake.api.beside import start

        self.args, self.model = args, model
        self._passthrough: Any = None
        self._pt_value: Any = None
        if args.cpu_priority == "age":  # the thresholds and pi(inf) with them need no policy
            from overtake.mdp.priority_prediction import age_passthrough

            self._passthrough = start(age_passthrough, model)
        self._policy: Any = None
        self._rules: Any = None
        self._prio: Any = None

    def passthrough(self) -> Any:
        if self._passthrough is not None and self._pt_value is None:
            self._pt_value = self._passthrough.result()
        return self._pt_value

    def start(self, policy: Any, result: Any) -> None:
        """Start the rules and the age prediction of ``policy`` (the solve's candidate) beside it."""
        from overtake.api.beside import start
        from overtake.mdp.rules import overtaking_rule

        self._policy = policy
        if self.args.phase_info == "full" and _rules_beside(policy):
            self._rules = start(overtaking_rule, result, policy)
        if self.args.cpu_priority == "age":
            self._prio = start(_cpu_priority_meta, "age", self.model, policy, None, self.passthrough(), False)

    def finish(self, opt: Any, choice: Any) -> tuple[Any, Any]:
        """The rules (None without full information, or when too small to go beside: then they
        are extracted here, by :func:`_policy_meta`) and the CPU-priority record (None without)."""
        from overtake.api.beside import start
        from overtake.mdp.rules import overtaking_rule

        if self._policy is not opt.policy:  # no candidate, or not the answer: the work starts now
            for pending in (self._rules, self._prio):
                if pending is not None:
                    pending.cancel()
            self._rules = start(overtaking_rule, opt.solve, opt.policy) if (
                self.args.phase_info == "full" and _rules_beside(opt.policy)) else None
            self._prio = None
        prio = self._prio.result() if self._prio is not None else (
            _cpu_priority_meta(self.args.cpu_priority, self.model, opt.policy, choice, self.passthrough())
            if self.args.cpu_priority else None)
        return (None if self._rules is None else self._rules.result()), prio


def _check_class_priority(args: argparse.Namespace, model: Any) -> None:
    if args.phase_info != "full":
        raise ValueError(f"--cpu-priority class: classes by phase need the phases; --phase-info "
                         f"{args.phase_info} does not see them (use age)")
    from overtake.mdp.priority_classes import class_model

    try:
        class_model(model)  # the classes as CPU weights by phase: exact only where phases stay
    except ModelError as exc:
        raise ValueError(f"--cpu-priority class: {exc}") from None


def _solve_pi_star(args: argparse.Namespace, sc: Any, model: Any, routes: Any, candidate: Any = None) -> tuple[Any, Any]:
    """The optimum, and with class priority the choice among class assignments it came from
    (``candidate``: :func:`overtake.mdp.optimum.solve_mdp`'s)."""
    from overtake.api.progress import progress_bar
    from overtake.mdp import solve

    with progress_bar("solve pi*", quiet=args.quiet) as progress:  # a bar on a terminal, silent otherwise
        if args.cpu_priority == "class":
            # the spawn optimum under each candidate class assignment, exact; the best is kept
            choice = solve(model, cpu_priority="class", truncation=sc.fixed_truncation(), tol=sc.tolerance,
                           method=args.method, progress=progress)
            return choice.optimum, choice
        if args.phase_info in ("full", "start"):
            from overtake.api.beside import start

            # the first policy's evaluation ladder on the second core while the next cap is solved
            return solve(model, phase_info=args.phase_info, truncation=sc.fixed_truncation(), tol=sc.tolerance,
                         method=args.method, progress=progress, max_states=args.max_states, beside=start,
                         candidate=candidate), None
        from overtake.api.beside import start

        # the first table's evaluation ladder on the second core while the next cap is searched
        return solve(model, phase_info=args.phase_info, truncation=sc.fixed_truncation(),
                     tol=sc.tolerance, method=args.method, progress=progress, routes=routes,
                     max_states=args.max_states, beside=start), None


def _policy_meta(args: argparse.Namespace, sc: Any, model: Any, opt: Any, rules: Any = None) -> dict[str, Any]:
    """The policy file's record of the solve: metrics, trace, time unit, Apache's default, rules
    (``rules``: the overtaking rules when already extracted)."""
    from overtake.mdp.rule_evaluation import evaluate_baseline
    from overtake.mdp.rules import overtaking_rule

    meta: dict[str, Any] = {
        "metrics": opt.metrics.to_dict(),
        "gain_bounds": list(opt.solve.gain_bounds),
        "truncation_trace": opt.trace,
        "method": opt.solve.method,
        # seconds per model time unit, or "model": the sidecar converts with it (controller.sidecar.units)
        "time_unit": sc.time_unit,
    }
    source = getattr(opt, "source", None)  # observation policies: the improved table or a baseline
    if source is not None:
        meta["observation"] = {"source": source, "candidates": opt.candidates,
                               "history": opt.solve.history}
    # Apache's default, exactly evaluated: the sidecar's auto mode weighs every policy against it
    done = getattr(opt, "baselines", {})
    ps = done["pi(inf)"].metrics if "pi(inf)" in done else evaluate_baseline(model, "pi(inf)", tol=sc.tolerance).metrics
    meta["baselines"] = {"pi(inf)": ps.mean_response_time}
    if args.phase_info == "full":
        meta["rules"] = (rules if rules is not None else overtaking_rule(opt.solve, opt.policy)).to_dict()
    return meta


def _cpu_priority_meta(kind: str, model: Any, pol: Any, choice: Any, passthrough: Any = None,
                       paired: bool = True) -> dict[str, Any]:
    """The CPU-priority predictions the policy file carries (``age`` or ``class``); ``paired``: the
    age prediction's runs two at a time (:func:`overtake.mdp.priority_prediction.predict_priority`)."""
    from overtake.mdp.priority_prediction import predict_priority

    if kind == "age":
        from overtake.api.beside import start

        return {"age": predict_priority(model, pol, "age", passthrough=passthrough,
                                        beside=start if paired else None).to_meta()}
    from overtake.mdp.rule_evaluation import evaluate_rule

    # the policy is the optimum with the classes; its E[W] without them, for the record
    meta = predict_priority(model, pol, "class").to_meta() | {"solved": True}
    plain = evaluate_rule(model, pol.layout, pol.actions, max_requests=pol.max_requests, max_threads=pol.max_threads)
    meta["without_lever"] = plain.mean_response_time
    assert choice is not None
    meta["candidates"] = [{"start_levels": [list(r) for r in lv], "mean_response_time": ew}
                          for lv, ew in choice.candidates]
    return {"class": meta}


def _document(args: argparse.Namespace, sc: Any, model: Any, opt: Any) -> dict[str, Any]:
    """The JSON document ``overtake solve`` prints."""
    pol, m = opt.policy, opt.metrics
    doc = {"out": args.out, "states": pol.keys.size, "hash": pol.digest(), "phase_info": pol.phase_info,
           "mean_response_time": m.mean_response_time, "blocking_probability": m.blocking_probability,
           "max_requests": pol.max_requests, "max_threads": pol.max_threads, **unit_fields(sc, model, m)}
    source = getattr(opt, "source", None)
    if source is not None:
        doc["source"] = source
    if args.cpu_priority:
        doc["cpu_priority"] = {k: {"mean_response_time": v["mean_response_time"], "ci95": v["ci95"],
                                   "exact": v["exact"], "passthrough": v["passthrough"], "thresholds": v["thresholds"],
                                   "start_levels": v["start_levels"], "solved": v.get("solved", False),
                                   "passthrough_ci95": v["passthrough_ci95"], "requests": v["requests"],
                                   "seeds": v["seeds"], "passthrough_seeds": v.get("passthrough_seeds", 0),
                                   "visit_model": v["visit_model"],
                                   "exempt_stages": v.get("exempt_stages", [])}
                               for k, v in pol.meta["cpu_priority"].items()}
    return doc


def unit_fields(sc: Any, model: Any, metrics: Any) -> dict[str, Any]:
    """The solve document's unit and phase fields: ``time_unit`` (seconds per model unit, or
    "model"), ``mean_response_time_seconds`` (None in model units) and each stage's phases by
    index with their names (:mod:`overtake.phases`), start probabilities and means."""
    u = sc.time_unit
    return {"time_unit": u,
            "mean_response_time_seconds": None if u == "model" else metrics.mean_response_time * u,
            "phases": {st.name: st.describe_phases() for st in model.stages}}


def phases_text(model: Any, time_unit: float | str) -> str:
    """One line per stage: its phases with their names, e.g. ``stage1: phase 1 short (starts
    93.3 %, mean 0.0134 s), phase 2 long (...)``; says when a stage's numbers do not follow the means."""

    def mean(m: float) -> str:
        return f"{m:.4g} model units" if time_unit == "model" else f"{m * float(time_unit):.4g} s"

    lines = ["phases (X-Overtake-Phase takes the number or the name):"]
    for st in model.stages:
        ph = st.describe_phases()
        parts = [f"phase {p['phase']}" + (f" {p['name']}" if not p["name"].isdigit() else "")
                 + f" (starts {100 * p['start']:.1f} %, mean {mean(p['mean'])})" for p in ph]
        ranked = [p["name"] for p in ph] in (["short", "long"], [str(j + 1) for j in range(len(ph))])
        lines.append(f"  {st.name}: " + ", ".join(parts)
                     + ("" if ranked else "  [numbered as the scenario lists them; the names follow the means]"))
    return "\n".join(lines)


def _run_constrained(args: argparse.Namespace, sc: Any, model: Any) -> int:
    """Constrained optimum by the occupation-measure LP (mdp.constrained); JSON on stdout."""
    try:
        import cvxpy  # noqa: F401
    except ImportError:
        raise ValueError(f"--max-mean-threads/--stage-sla need cvxpy: {install_hint('convex')}") from None
    from overtake.mdp.constrained import Constraints, solve_constrained

    cons = Constraints.parse(model, args.max_mean_threads, args.stage_sla)
    progress = None if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    co = solve_constrained(model, cons, phase_info=args.phase_info, truncation=sc.fixed_truncation(),
                           tol=sc.tolerance, progress=progress)
    doc = co.to_dict()
    if args.out is not None:
        co.policy.meta["truncation_trace"] = co.trace
        co.policy.save(args.out)
        doc.update(out=args.out, hash=co.policy.digest())
    print(json.dumps(doc, indent=2))
    return 0
