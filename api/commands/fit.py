"""``overtake fit``: phase-type distributions per request stage, as the solver's JSON.

::

    overtake fit (FILE [--column COL] | --apache-log LOG --log-format FMT --stage NAME=REGEX ...)
                 [--structure cf1|coxian|general|hyperexp|hypererlang] [--order N|auto]
                 [--max-states N] [--shift auto|SECONDS] [--censor-at T] [--preserve-mean]
                 [--out DIR] [--plot] [--seed N]

Writes ``DIR/<stage>.json`` (``{"alpha": [...], "T": [[...]], "time_unit": 1, "phases": [...], ...}``,
what a scenario's ``{file: stage1.json}`` points at; times in seconds, phases from the shortest mean
to the longest, see :mod:`overtake.phases`) and, with ``--plot``, ``DIR/<stage>.png``. Prints one block of
diagnostics per stage.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from overtake.api.commands.defaults import DEFAULT_MAX_STATES
from overtake.api.errors import FitUsageError
from overtake.fitting.errors import FittingInputError

if TYPE_CHECKING:
    import numpy as np

    from overtake.fitting import FitResult, Observations

#: overtake.fitting.em's STRUCTURES and MAX_AUTO_ORDER, written out so that parsing and checking the
#: options imports neither numpy nor the EM (tests/fitting/test_cli.py checks they agree)
STRUCTURES = ("cf1", "coxian", "general", "hyperexp", "hypererlang")
MAX_AUTO_ORDER = 12


def register(subparsers: Any) -> None:
    """Add the ``fit`` sub-command."""
    p = subparsers.add_parser(
        "fit",
        help="fit phase-type service-time distributions from durations or an Apache log",
        description="Fit phase-type distributions by EM to measured durations (seconds). "
        "Input: FILE with one duration per line or a CSV column, or an Apache access log "
        "whose requests are mapped to stages by URL regexes.",
    )
    p.add_argument("file", nargs="?", help="durations: one per line, or CSV with --column")
    p.add_argument("--column", help="CSV column (header name or 0-based index)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply FILE values to get seconds (e.g. 1e-3 for ms)")
    p.add_argument("--name", help="stage name for FILE input (default: the file's stem)")
    p.add_argument("--apache-log", metavar="LOG", help="Apache access log")
    p.add_argument("--log-format", metavar="FMT", help='the LogFormat string, e.g. \'%%h %%t "%%r" %%>s %%b %%D\'')
    p.add_argument("--stage", action="append", default=[], metavar="NAME=REGEX",
                   help="map request paths matching REGEX to stage NAME (repeatable; first match wins)")
    p.add_argument("--structure", choices=STRUCTURES, default="cf1", help="default cf1 (acyclic canonical form)")
    p.add_argument("--order", default="4",
                   help="number of phases, or 'auto' (BIC over 1..12, within --max-states); default 4")
    p.add_argument("--max-states", type=int, default=DEFAULT_MAX_STATES, metavar="N",
                   help="with --order auto: only orders such that a tandem of the fitted stages (at least two) "
                        "of that order on one core solves within N states, what solve and compare accept "
                        "(default %(default)s); the BIC-best order above it is reported, not chosen")
    p.add_argument("--shift", metavar="auto|SECONDS",
                   help="fit a service floor: a constant (auto: estimated from the smallest durations) then "
                        "the PH; the solver gets the constant as an Erlang of the phases --max-states leaves "
                        "(at least one) in front of the PH, so a floor costs few phases. Exact durations only")
    p.add_argument("--censor-at", type=float, metavar="T",
                   help="durations >= T seconds were cut off by a timeout: treat them as right-censored at T")
    p.add_argument("--preserve-mean", action="store_true", help="make the fitted mean equal the sample mean exactly")
    p.add_argument("--out", default=".", metavar="DIR", help="output directory (default: current)")
    p.add_argument("--plot", action="store_true", help="also write DIR/<stage>.png")
    p.add_argument("--seed", type=int, default=0, help="seed for the random restarts (default 0)")
    p.add_argument("--max-iter", type=int, default=5000)
    p.add_argument("--paired", action="store_true",
                   help="FILE holds transactions, one a line: the stage-1 and stage-2 durations of one request "
                        "(comma or blanks). Fits each stage's PH (--structure, --order N|auto, --shift) and the "
                        "routing between their phases (with --shift: between the bodies above the floors); "
                        "writes DIR/<stage>.json per stage and DIR/routing.json for the scenario's routing key. "
                        "Stage names from --name A,B (default stage1,stage2)")


def _order(value: str) -> int | str:
    if value == "auto":
        return "auto"
    try:
        k = int(value)
    except ValueError:
        raise FitUsageError(f"--order must be an integer >= 1 or 'auto', got {value!r}") from None
    if k < 1:
        raise FitUsageError(f"--order must be >= 1, got {k}")
    return k


def _stages(specs: list[str]) -> dict[str, str]:
    from overtake.regex import check_pattern

    out: dict[str, str] = {}
    for spec in specs:
        name, sep, rx = spec.partition("=")
        if not sep or not name or not rx:
            raise FitUsageError(f"--stage must be NAME=REGEX, got {spec!r}")
        if name in out:
            raise FitUsageError(f"--stage {name!r} given twice")
        try:
            out[name] = check_pattern(rx)
        except ValueError as exc:
            raise FitUsageError(f"--stage {name}={rx}: {exc}") from None
    return out


def _input(args: argparse.Namespace) -> dict[str, str] | str:
    """The checked input options: the stages of an Apache log, or the stage name of FILE.

    Checked before anything is read or imported, so a wrong option costs no start-up."""
    if args.apache_log and args.file:
        raise FitUsageError("give either FILE or --apache-log, not both")
    if args.apache_log:
        if not args.log_format:
            raise FitUsageError("--apache-log needs --log-format (the server's LogFormat string)")
        stages = _stages(args.stage)
        if not stages:
            raise FitUsageError("--apache-log needs at least one --stage NAME=REGEX")
        return stages
    if not args.file:
        raise FitUsageError("give FILE (durations) or --apache-log LOG")
    if not (math.isfinite(args.scale) and args.scale > 0):
        raise FitUsageError(f"--scale must be > 0, got {args.scale}")
    name: str = args.name or Path(args.file).stem
    if not name.replace("_", "").replace("-", "").replace(".", "").isalnum():
        raise FitUsageError(f"--name must be letters, digits, '_', '.', '-', got {name!r}")
    return name


def _load(args: argparse.Namespace, source: dict[str, str] | str) -> tuple[dict[str, np.ndarray], list[str]]:
    from overtake.fitting import io

    if isinstance(source, dict):
        res = io.read_apache_log(args.apache_log, args.log_format, source)
        return res.stages, res.report()
    column: str | int | None = args.column
    return {source: io.read_durations(args.file, column=column, scale=args.scale)}, []


def _phases(phases: list[dict[str, Any]]) -> str:
    """``1 short: starts 93.3 %, mean 0.0134 s; 2 long: ...`` (the phases of a fit's JSON)."""
    return "; ".join(f"{j} {p['name']}: starts {100 * p['start']:.1f} %, mean {p['mean']:.4g} s" if p["name"] != str(j)
                     else f"{j}: starts {100 * p['start']:.1f} %, mean {p['mean']:.4g} s"
                     for j, p in enumerate(phases, start=1))


def _summary(name: str, res: FitResult, lines: list[str], chosen: int | None = None) -> list[str]:
    """``chosen``: the order marked in the selection table (a shifted fit's body order)."""
    out = [
        f"[{name}] {res.structure} order {res.ph.order}: loglik {res.loglik:.4f}  AIC {res.aic:.2f}  "
        f"BIC {res.bic:.2f}  n {res.n:g}  {'converged' if res.converged else 'NOT converged'} "
        f"after {res.n_iter} iterations" + ("  (mean preserved)" if res.mean_preserved else ""),
    ]
    if res.shapes is not None:
        out.append(f"  Erlang branch shapes {list(res.shapes)}")
    out.append("  phases by mean (as written): " + _phases(res.to_dict()["phases"]))
    for row in res.selection:
        mark = " <" if row.order == (chosen or res.ph.order) else ""
        out.append(f"  order {row.order:2d}: loglik {row.loglik:.3f}  AIC {row.aic:.2f}  BIC {row.bic:.2f}{mark}")
    out += ["  " + s for s in lines]
    return out


def _shift(value: str | None) -> float | str | None:
    if value is None or value == "auto":
        return value
    try:
        c = float(value)
    except ValueError:
        raise FitUsageError(f"--shift must be 'auto' or a duration in seconds, got {value!r}") from None
    if not (math.isfinite(c) and c > 0):
        raise FitUsageError(f"--shift must be > 0 seconds, got {value!r}")
    return c


def _fit_floor(obs: Observations, shift: float | str, order: int | str, budget: int,
               args: argparse.Namespace) -> tuple[FitResult, dict[str, Any], list[str]]:
    """Constant + PH within ``budget`` phases; the fit file, and the lines comparing it with a plain fit."""
    from overtake.fitting import fit_observations
    from overtake.fitting.shifted import fit_shifted

    if budget < 2:
        raise FitUsageError(f"--shift: --max-states {args.max_states} affords {budget} phase(s) a stage, none "
                            "left for the floor; raise --max-states")
    kw: dict[str, Any] = {"structure": args.structure, "preserve_mean": args.preserve_mean,
                          "random_state": args.seed, "max_iter": args.max_iter}
    body_order: int | str = order if order != "auto" else "auto"
    max_body = budget - 1 if order == "auto" else None
    try:
        sf = fit_shifted(obs, shift=shift, erlang_phases=None, max_phases=budget, order=body_order,
                         max_order=max_body, **kw)
    except FittingInputError as exc:
        raise FitUsageError(f"--shift: {exc}") from None
    plain = fit_observations(obs, order=min(sf.ph.order, MAX_AUTO_ORDER), **kw)
    res = sf.result()
    doc = res.to_dict()
    doc["shift"] = sf.meta()
    lines = [f"  floor {sf.shift:.6g} s as an Erlang of {sf.erlang_phases} phase(s) + {sf.body.structure} order "
             f"{sf.body.ph.order}: loglik {sf.loglik:.4f} with the constant, {sf.loglik_model:.4f} as modelled "
             f"(order {sf.ph.order}); unshifted {plain.structure} order {plain.ph.order}: loglik {plain.loglik:.4f}"]
    return res, doc, lines


def _budget_order(n_stages: int, max_states: int) -> int:
    """The largest order a tandem of ``n_stages`` (at least two) such stages affords on one core."""
    from overtake.mdp.budget import max_uniform_order  # the solver's state count, only when fitting

    p = max_uniform_order(max(2, n_stages), 1, max_states)
    if p < 1:
        raise FitUsageError(f"--max-states {max_states}: not even order 1 fits; raise it (default "
                            f"{DEFAULT_MAX_STATES})")
    return p


def _over_budget(res: FitResult, max_order: int, max_states: int) -> list[str]:
    """One line when BIC alone would have chosen more phases than the budget affords."""
    if not res.selection:
        return []
    bic_best = min(res.selection, key=lambda r: r.bic).order
    if bic_best <= max_order:
        return []
    return [f"  BIC-best order {bic_best} is over budget: order {res.ph.order} kept, the best of at most "
            f"{max_order} phases that fit --max-states {max_states:,} (raise it for more)\n"]


def run(args: argparse.Namespace) -> int:
    """Fit every stage, write JSON (and PNG), print diagnostics."""
    order, shift = _checked_options(args)
    if args.paired:
        return _run_paired(args, order, shift)
    source = _input(args)
    # the options are good: only now the data, and the EM's imports (numpy, numba's kernels) in _fit_one
    data, report = _load(args, source)
    for line in report:
        print(line)
    max_order = _budget_order(len(data), args.max_states) if order == "auto" else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from overtake.api.progress import progress_iter

    for name, x in progress_iter(data.items(), "fit", total=len(data)):  # a bar on a terminal only
        _fit_one(args, name, x, order, shift, max_order, len(data), out)
    sys.stdout.flush()
    return 0


def _checked_options(args: argparse.Namespace) -> tuple[int | str, float | str | None]:
    """The order and the shift, every numeric option checked before any data is read."""
    order = _order(args.order)
    if args.censor_at is not None and not (math.isfinite(args.censor_at) and args.censor_at > 0):
        raise FitUsageError(f"--censor-at must be a duration > 0 seconds, got {args.censor_at}")
    if args.max_iter < 1:
        raise FitUsageError(f"--max-iter must be >= 1, got {args.max_iter}")
    if args.max_states < 1:
        raise FitUsageError(f"--max-states must be >= 1, got {args.max_states}")
    shift = _shift(args.shift)
    if shift is not None and args.censor_at is not None:
        raise FitUsageError("--shift needs exact durations: drop --censor-at")
    return order, shift


def _fit_one(args: argparse.Namespace, name: str, x: np.ndarray, order: int | str, shift: float | str | None,
             max_order: int | None, n_stages: int, out: Path) -> None:
    """Fit one stage's durations (censored at ``--censor-at``; with a floor under ``--shift``),
    write its JSON (and PNG) and print its diagnostics."""
    import numpy as np

    from overtake.fitting import diagnose, fit_observations, samples

    censored = None
    if args.censor_at is not None:
        censored = x >= args.censor_at
        x = np.where(censored, args.censor_at, x)
    try:
        obs = samples(x, censored=censored)
    except FittingInputError as exc:
        raise type(exc)(f"stage {name!r}: {exc}") from None
    shift_lines: list[str] = []
    if shift is None:
        res = fit_observations(obs, structure=args.structure, order=order, preserve_mean=args.preserve_mean,
                               random_state=args.seed, max_iter=args.max_iter, max_order=max_order)
        doc = res.to_dict()
    else:
        res, doc, shift_lines = _fit_floor(obs, shift, order, _budget_order(n_stages, args.max_states), args)
    path = out / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    diag = diagnose(obs, res.ph).lines()
    for line in _summary(name, res, diag, doc.get("shift", {}).get("body_order")):
        print(line)
    if max_order is not None and shift is None:
        print(*_over_budget(res, max_order, args.max_states), sep="\n", end="")
    for line in shift_lines:
        print(line)
    print(f"  wrote {path}")
    if args.plot:
        from overtake.fitting.plot import fit_figure

        fig = fit_figure(x, res.ph, title=f"{name}: {res.structure}({res.ph.order})", censored=censored)
        png = out / f"{name}.png"
        fig.savefig(png, dpi=100)
        print(f"  wrote {png}")


def _paired_names(args: argparse.Namespace) -> tuple[str, str]:
    names = tuple((args.name or "stage1,stage2").split(","))
    if len(names) != 2 or not all(n.replace("_", "").replace("-", "").replace(".", "").isalnum() for n in names):
        raise FitUsageError(f"--paired: --name must be two stage names A,B (letters, digits, '_', '.', '-'), "
                            f"got {args.name!r}")
    if names[0] == names[1]:
        raise FitUsageError(f"--paired: the two stage names must differ, got {args.name!r}")
    return names[0], names[1]


def _run_paired(args: argparse.Namespace, order: int | str, shift: float | str | None) -> int:
    """``--paired``: the coupled fit (:mod:`overtake.fitting.coupled`) of a two-column file; with
    ``--shift``, each stage a floor and a body, routed body to body (:mod:`overtake.fitting.coupled_shifted`)."""
    if args.apache_log or not args.file:
        raise FitUsageError("--paired reads FILE (two durations a line), not --apache-log")
    for flag, given in (("--censor-at", args.censor_at is not None), ("--column", args.column is not None),
                        ("--plot", args.plot)):
        if given:
            raise FitUsageError(f"--paired: {flag} is not supported with paired samples; drop it")
    if not (math.isfinite(args.scale) and args.scale > 0):
        raise FitUsageError(f"--scale must be > 0, got {args.scale}")
    names = _paired_names(args)
    budget = _budget_order(2, args.max_states) if order == "auto" or shift is not None else None
    if shift is not None and budget is not None and budget < 2:
        raise FitUsageError(f"--shift: --max-states {args.max_states} affords {budget} phase(s) a stage, none "
                            "left for the floor; raise --max-states")
    from overtake.fitting import io
    from overtake.fitting.coupled import fit_coupled
    from overtake.fitting.coupled_shifted import fit_coupled_shifted

    x, y = io.read_pairs(args.file, scale=args.scale)
    kw: dict[str, Any] = {"structure": args.structure, "order": order, "random_state": args.seed,
                          "max_iter": args.max_iter, "preserve_mean": args.preserve_mean}
    try:
        if shift is None:
            fit = fit_coupled(x, y, max_order=budget if order == "auto" else None, **kw)
            model, marginals, floors = fit.model.by_mean(), fit.marginals or (), None
            routing_fit = fit
        else:
            assert budget is not None
            sf = fit_coupled_shifted(x, y, shift=shift, max_phases=budget,
                                     max_order=budget - 1 if order == "auto" else None, **kw)
            model, marginals, floors = sf.model.by_mean(), tuple(f.body for f in sf.floors), sf.floors
            routing_fit = sf.bodies
    except FittingInputError as exc:
        raise type(exc)(f"{args.file}: {exc}") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, (name, ph) in enumerate(zip(names, (model.first, model.second))):
        doc: dict[str, Any] = {"alpha": ph.alpha.tolist(), "T": ph.T.tolist(), "time_unit": 1.0,
                               "structure": "shifted" if floors else args.structure, "order": ph.order,
                               "mean": ph.mean(), "scv": ph.scv(), "n": routing_fit.n, "coupled_with": "routing.json"}
        if floors:
            doc["shift"] = {**floors[i].meta(), "floor_position": "first" if i == 0 else "last"}
        path = out / f"{name}.json"
        path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        print(f"[{name}] {doc['structure']} order {ph.order}: mean {ph.mean():.4g} s, scv {ph.scv():.3g}; wrote {path}")
        for line in _paired_stage_lines(i, marginals, floors, budget, args):
            print(line)
    _write_routing(out, names, model, routing_fit, floors)
    sys.stdout.flush()
    return 0


def _paired_stage_lines(i: int, marginals: tuple[FitResult, ...], floors: tuple[Any, ...] | None,
                        budget: int | None, args: argparse.Namespace) -> list[str]:
    """A paired stage's order selection (``--order auto``) and floor (``--shift``)."""
    lines = []
    if floors:
        f = floors[i]
        lines.append(f"  floor {f.shift:.6g} s as an Erlang of {f.erlang_phases} phase(s) "
                     f"({'before' if i == 0 else 'after'} the body) + {f.body.structure} order {f.body.ph.order}")
    if marginals and marginals[i].selection:
        res = marginals[i]
        for row in res.selection:
            mark = " <" if row.order == res.ph.order else ""
            lines.append(f"  order {row.order:2d}: loglik {row.loglik:.3f}  BIC {row.bic:.2f}{mark}")
        if budget is not None:
            lines += [s.rstrip("\n") for s in _over_budget(res, budget - (1 if floors else 0), args.max_states)]
    return lines


def _write_routing(out: Path, names: tuple[str, str], model: Any, fit: Any, floors: tuple[Any, ...] | None) -> None:
    rdoc: dict[str, Any] = {
        "routing": [model.routing.tolist()], "stages": list(names), "correlation": model.correlation(),
        "sample_correlation": fit.sample_correlation, "loglik": fit.loglik,
        "loglik_independent": fit.loglik_independent, "converged": fit.converged, "iterations": fit.n_iter,
        "n": fit.n}
    if floors:
        rdoc["shifts"] = [f.shift for f in floors]
        rdoc["routing_bodies"] = fit.model.by_mean().routing.tolist()  # body phase to body phase, by mean
    path = out / "routing.json"
    path.write_text(json.dumps(rdoc, indent=2, allow_nan=False) + "\n")
    where = " (between the bodies, above the floors)" if floors else ""
    print(f"[routing] {names[0]} -> {names[1]}: correlation {model.correlation():.3f} (sample "
          f"{fit.sample_correlation:.3f}){where}; joint loglik {fit.loglik:.4f}, independent "
          f"{fit.loglik_independent:.4f}")
    for j, row in enumerate(fit.model.by_mean().routing, start=1):
        print(f"  leaving {names[0]}{' body' if floors else ''} from phase {j}: starts {names[1]} in " +
              ", ".join(f"phase {l} {100 * p:.1f} %" for l, p in enumerate(row, start=1)))
    one = [n for n, ph in zip(names, (fit.model.first, fit.model.second)) if ph.order == 1]
    if one and abs(fit.sample_correlation) >= 0.1:
        print(f"  {', '.join(one)}: one phase, so the routing carries none of the sample correlation "
              f"{fit.sample_correlation:.3f}; give --order 2 or more (hyperexp) to keep it")
    print(f"  wrote {path} (scenario: routing: {{file: routing.json}})")
