"""``overtake compare SCENARIO [--json]``: π* against the baselines, gains as fractions."""

from __future__ import annotations

import argparse
import json
from typing import Any

from overtake.api.commands.defaults import DEFAULT_MAX_STATES


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("compare", help="compare the optimal policy with pi(1), pi(4), pi(inf), pi(1,1)")
    p.add_argument("scenario", help="scenario YAML")
    p.add_argument("--json", action="store_true", help="print the JSON document on stdout")
    p.add_argument("--policy", action="append", default=[], metavar="NAME",
                   help='more baselines, e.g. --policy "pi(2)" --policy "pi(2,3)"')
    p.add_argument("--phase-info", choices=("full", "start", "none", "route"), default=None,
                   help="start: also solve the variant where a waiting request's phase is unknown; none: pi* is "
                        "the best policy that sees counts per stage only; route: counts per route "
                        "(stages[].routes). Default: the scenario's phase_info, else full")
    p.add_argument("--method", choices=("anderson", "rvi", "pi"), default="anderson",
                   help="pi*'s solver (phase_info full/start): anderson, relative value iteration with Anderson "
                        "acceleration (default, the fastest measured); rvi: plain; pi: policy iteration")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--max-states", type=int, default=DEFAULT_MAX_STATES, metavar="N",
                   help="refuse (exit 2, before building anything) when pi*'s estimated state space exceeds N; "
                        "the auto-truncation ladder stops at N too (default %(default)s: minutes and a few GB)")
    p.add_argument("--plot", metavar="PNG", help="also write E[W] per policy with the gains (van der Weij et al., Fig. 2)")


def run(args: argparse.Namespace) -> int:
    # the solver's imports only once the options have parsed
    from overtake.api.cli import started
    from overtake.api.progress import progress_bar
    from overtake.api.scenario import load_scenario
    from overtake.mdp.baselines import Baseline
    from overtake.mdp.budget import check_budget
    from overtake.mdp.comparison import compare, default_baselines

    sc, model = load_scenario(args.scenario)
    phase_info = args.phase_info or sc.phase_info
    routes = sc.build_routes(model)
    # before anything is built: a model too large for the machine is refused as one line
    check_budget(model, max_states=args.max_states, truncation=sc.fixed_truncation(), phase_info=phase_info)
    started()  # the collector back on (overtake.api.cli.program held it for the imports)
    steps = ["pi*"] + [Baseline.parse(p, model.n_stages).name
                       for p in dict.fromkeys([*default_baselines(model.n_stages), *args.policy])]
    with progress_bar("compare", steps=steps, quiet=args.quiet) as progress:  # silent when not a terminal
        doc = compare(model, policies=args.policy, phase_info_start=phase_info == "start",
                      tol=sc.tolerance, truncation=sc.fixed_truncation(), progress=progress,
                      phase_info="full" if phase_info == "start" else phase_info, routes=routes,
                      method=args.method, max_states=args.max_states)
    if args.plot:
        from overtake.api.plots import gains_figure

        gains_figure(doc).savefig(args.plot, dpi=100)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    unit = sc.time_unit
    print(f"arrival rate {doc['arrival_rate']:.6g}, load {doc['load']:.4g}; pi*: {doc['states']} states, "
          f"{doc['iterations']} {doc['method']} steps, {doc['seconds']:.1f} s; times in "
          + ("model units (time_unit: model)" if unit == "model" else "seconds" if unit == 1 else f"units of {unit:g} s"))
    if "observation" in doc:
        print(f"pi* sees {phase_info}: the best observation policy is {doc['observation']['source']}")
    print(f"{'policy':<22}{'E[W]':>10}{'E[N]':>10}{'threads':>9}{'blocking':>11}{'gain':>9}")
    for name, m in doc["policies"].items():
        g = doc["gains"].get(name)
        gs = "" if g is None else f"{100 * g:8.2f}%"
        print(f"{name:<22}{m['mean_response_time']:>10.4f}{m['mean_in_system']:>10.4f}"
              f"{m['mean_threads']:>9.3f}{m['blocking_probability']:>11.2e}{gs:>9}")
    return 0
