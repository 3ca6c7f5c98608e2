"""van der Weij et al., "Dynamic thread assignment" Table 1 through the CLI: twelve sequential `overtake compare CASE --json` processes.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/cli_table1.py [--exe PATH] [--cases 1,...,12]
        [--phase-info full|none|route] [--cpu-priority none|age]
        [--reference OLD.json] [--repeat N] [--other RUN.json | --other-exe PATH | --baseline-rev REV]
        [--json] [--no-write]

``--phase-info none`` or ``route``, or ``--cpu-priority age``, times `overtake solve CASE
--phase-info X [--cpu-priority age] --out P.npz` instead (the solves auto mode and the online loop
run) and reads the policy's E[W] from the file. ``route`` solves a copy of each case with route
classes on its two-phase stages (the split of bench/value_of_information.py) and skips the cases
without one. Every process's CPU seconds (user + sys, from ``getrusage``) are recorded beside its
wall time: on a shared machine CPU time is the figure to compare.

What a user pays: each case is a fresh process (start-up, imports, compiled kernels loaded from
the cache, the solve, the baselines), one after another, at the scenario's tolerance (0.1 %).
``--exe`` points at another install's `overtake` (e.g. the main branch's) so old and new run in
one session; ``--reference`` is an earlier run's ``--json`` output, and every policy's E[W] is
compared with it (the largest relative difference is reported). The 1-minute load average is
recorded before and after each process: timings taken above a load of 1 are flagged.
Appends one JSON line to bench/results/solver_speed.jsonl and replaces the ``cli-table1`` section of
bench/results/sections.md (all twelve cases only) unless ``--no-write`` (``--other RUN.json``: a run of another ``--exe`` from the same
session, shown beside this one; ``--other-exe PATH``: another install run just before this one on
every case, so the two see the same load on a shared machine; ``--baseline-rev REV``: the same with
revision REV of this repository, checked out as a detached worktree under the temporary directory
with its own ``make venv``, built on first use and reused by later runs; remove it with
``git worktree remove PATH``).

The three kinds of solve side by side against the previous revision, one command each::

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/cli_table1.py --phase-info none --baseline-rev HEAD~1
    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/cli_table1.py --cpu-priority age --baseline-rev HEAD~1
    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/cli_table1.py --phase-info route --baseline-rev HEAD~1
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _report import machine, replace_section

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "solver_speed.jsonl"


def git_rev(path: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def baseline_exe(rev: str) -> tuple[str, str]:
    """The `overtake` of revision ``rev`` of this repository, and the commit: a detached worktree
    of it with its own virtual environment (``make venv``: the install, numba's cache and the
    ahead-of-time kernels, as a user's set-up builds them), made once per commit and reused."""
    try:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                             capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        raise SystemExit(f"--baseline-rev {rev}: not a commit of {ROOT} (give a hash, a branch or e.g. HEAD~1)") from None
    tree = Path(tempfile.gettempdir()) / f"overtake-baseline-{sha[:12]}"
    exe = tree / ".venv" / "bin" / "overtake"
    if (tree / ".venv" / ".kernels").exists() and exe.exists():  # the Makefile's last step: a complete build
        return str(exe), sha
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), sha], check=True,
                       capture_output=True)
    log = tree / "baseline-venv.log"
    print(f"--baseline-rev {rev}: building {tree}/.venv (log: {log})", file=sys.stderr, flush=True)
    with log.open("w") as fh:
        built = subprocess.run(["make", "venv"], cwd=tree, stdout=fh, stderr=subprocess.STDOUT, check=False)
    if built.returncode != 0 or not exe.exists():
        raise SystemExit(f"--baseline-rev {rev}: `make venv` in {tree} failed (exit {built.returncode}); see {log}")
    return str(exe), sha


def scenario(case: int, phase_info: str, scratch: Path) -> Path | None:
    """The case's scenario file; for ``route`` a copy with route classes (None: no two-phase stage)."""
    scen = ROOT / "examples" / "table1" / f"case{case:02d}.yaml"
    if phase_info != "route":
        return scen
    import yaml
    from value_of_information import route_split

    from overtake.api.scenario import load_scenario

    _, model = load_scenario(scen)
    split = route_split(model)
    if split is None:
        return None
    doc = yaml.safe_load(scen.read_text())
    for st, rs in zip(doc["stages"], split.to_dict()):
        if len(rs) > 1:
            st["routes"] = rs
    out = scratch / f"case{case:02d}-routes.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def _cpu_children() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_case(exe: str, case: int, phase_info: str = "full", cpu_priority: str = "none",
             scratch: Path | None = None) -> dict[str, Any] | None:
    """One case in a fresh process: `compare --json` (full, no CPU priority) or `solve --out`; None
    where ``route`` does not apply (no two-phase stage)."""
    scratch = scratch or Path(tempfile.gettempdir())
    scen = scenario(case, phase_info, scratch)
    if scen is None:
        return None
    compare = phase_info == "full" and cpu_priority == "none"
    out = scratch / f"case{case:02d}-{phase_info}-{cpu_priority}.npz"
    cmd = ([exe, "compare", str(scen), "--json", "--quiet"] if compare else
           [exe, "solve", str(scen), "--phase-info", phase_info, "--out", str(out), "--quiet"]
           + (["--cpu-priority", "age"] if cpu_priority == "age" else []))
    load0 = os.getloadavg()[0]
    cpu0 = _cpu_children()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    cpu = _cpu_children() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"case {case}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    rec: dict[str, Any] = {"case": case, "wall_s": wall, "cpu_s": cpu, "load_before": load0,
                           "load_after": os.getloadavg()[0]}
    if compare:
        doc = json.loads(proc.stdout)
        return {**rec, "states": doc["states"], "iterations": doc["iterations"], "method": doc.get("method"),
                "mean_response_time": {k: v["mean_response_time"] for k, v in doc["policies"].items()}}
    from overtake.mdp.policy import Policy

    meta = Policy.load(out).meta
    label = phase_info if phase_info != "full" else "pi*"
    ew = {label: meta["metrics"]["mean_response_time"]}
    if cpu_priority == "age":
        ew.update({f"{k} (age)": v for k, v in _age_predictions(meta["cpu_priority"]["age"]).items()})
    return {**rec, "states": meta["metrics"]["states"], "iterations": len(meta.get("truncation_trace", [])),
            "method": meta.get("method"), "source": meta.get("observation", {}).get("source"),
            "mean_response_time": ew}


def _age_predictions(age: Any) -> dict[str, float]:
    """The predicted E[W]s in a policy file's age-priority record (whatever its layout: every
    ``mean_response_time`` found, keyed by where it sits)."""
    found: dict[str, float] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "mean_response_time" and isinstance(v, (int, float)):
                    found[path or "policy"] = float(v)
                else:
                    walk(v, f"{path}.{k}" if path else str(k))

    walk(age, "")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exe", default=str(ROOT / ".venv" / "bin" / "overtake"), help="the `overtake` to time")
    ap.add_argument("--cases", default=",".join(str(i) for i in range(1, 13)))
    ap.add_argument("--reference", help="an earlier --json output: compare every E[W] with it")
    ap.add_argument("--repeat", type=int, default=1, help="run the whole sequence N times; report each")
    ap.add_argument("--other", help="a --json run of another --exe in the same session, for the section's table")
    ap.add_argument("--other-exe", help="another install's `overtake`, run case by case in alternation with --exe "
                                         "(both see the same load; shown beside it like --other)")
    ap.add_argument("--baseline-rev", metavar="REV",
                    help="a revision of this repository (e.g. HEAD~1, main): its own worktree and venv, built once, "
                         "run case by case in alternation like --other-exe")
    ap.add_argument("--phase-info", choices=("full", "none", "route"), default="full",
                    help="full: `overtake compare` (default); none or route: `overtake solve --phase-info X` "
                         "(route: the cases with a two-phase stage, with route classes added)")
    ap.add_argument("--cpu-priority", choices=("none", "age"), default="none",
                    help="age: `overtake solve --cpu-priority age` (the threshold chosen and predicted)")
    ap.add_argument("--json", action="store_true", help="print the run as one JSON document")
    ap.add_argument("--no-write", action="store_true", help=f"do not append to {RESULTS.relative_to(ROOT)}")
    args = ap.parse_args()
    if args.baseline_rev and (args.other_exe or args.other):
        ap.error("--baseline-rev: give one of --baseline-rev, --other-exe and --other")
    baseline_sha = None
    if args.baseline_rev:
        args.other_exe, baseline_sha = baseline_exe(args.baseline_rev)
    cases = [int(x) for x in args.cases.split(",")]
    kind = {"phase_info": args.phase_info, "cpu_priority": args.cpu_priority}
    scratch = tempfile.TemporaryDirectory(prefix="cli_table1-")
    runs: list[dict[str, Any]] = []
    other_runs: list[dict[str, Any]] = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        per: list[dict[str, Any]] = []
        per_other: list[dict[str, Any]] = []
        for c in cases:
            if args.other_exe:
                o = run_case(args.other_exe, c, args.phase_info, args.cpu_priority, Path(scratch.name))
                if o is not None:
                    per_other.append(o)
            r = run_case(args.exe, c, args.phase_info, args.cpu_priority, Path(scratch.name))
            if r is None:
                continue
            per.append(r)
            if not args.json:
                name, ew = next(iter(r["mean_response_time"].items()))
                print(f"case {c:2d}: {r['wall_s']:6.2f} s wall {r['cpu_s']:6.2f} s CPU  {r['states']:7d} states  "
                      f"E[W]({name}) {ew:.6f}  load {r['load_before']:.2f}", file=sys.stderr, flush=True)
        # alternating, a sequence's wall time is the sum of its cases'
        total = sum(r["wall_s"] for r in per) if args.other_exe else time.perf_counter() - t0
        runs.append({"total_wall_s": total, "cases": per})
        if args.other_exe:
            other_runs.append({"total_wall_s": sum(r["wall_s"] for r in per_other), "cases": per_other})
    out: dict[str, Any] = {
        "bench": "cli_table1", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(), "exe": args.exe, "rev": git_rev(Path(args.exe).resolve().parents[2]),
        "command": "OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/cli_table1.py " + " ".join(sys.argv[1:]), **kind,
        "_reference_arg": args.reference, "_other_arg": args.other,
        "runs": runs, "max_load": max(max(r["load_before"], r["load_after"]) for run in runs for r in run["cases"]),
    }
    if args.other_exe:
        out["other_exe"] = {"exe": args.other_exe, "rev": git_rev(Path(args.other_exe).resolve().parents[2]),
                            "runs": other_runs, "interleaved": True}
        if baseline_sha is not None:
            out["other_exe"]["baseline_rev"] = {"rev": args.baseline_rev, "commit": baseline_sha}
        # per case, this exe's E[W] relative to the other's (negative: this one found a better policy)
        mine = {r["case"]: r["mean_response_time"] for r in runs[0]["cases"]}
        out["ew_vs_other"] = {c["case"]: {k: (mine[c["case"]][k] - v) / v for k, v in c["mean_response_time"].items()
                                          if k in mine.get(c["case"], {})} for c in other_runs[0]["cases"]}
    if args.reference:
        ref = json.loads(Path(args.reference).read_text())
        old = {r["case"]: r["mean_response_time"] for r in ref["runs"][0]["cases"]}
        worst = 0.0
        for r in runs[0]["cases"]:
            for k, v in r["mean_response_time"].items():
                if k in old.get(r["case"], {}):
                    worst = max(worst, abs(v - old[r["case"]][k]) / abs(old[r["case"]][k]))
        out["max_rel_diff_vs_reference"] = worst
        out["reference"] = {"date": ref.get("date"), "rev": ref.get("rev")}
    for run in [*runs, *other_runs]:
        run["total_cpu_s"] = sum(r["cpu_s"] for r in run["cases"])
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for i, run in enumerate(runs):
            print(f"run {i + 1}: {run['total_wall_s']:.1f} s wall, {run['total_cpu_s']:.1f} s CPU for cases {args.cases}"
                  + (f" (--other-exe: {other_runs[i]['total_cpu_s']:.1f} s CPU)" if other_runs else ""))
        for case, diff in out.get("ew_vs_other", {}).items():
            print(f"case {case}: E[W] relative to --other-exe: "
                  + ", ".join(f"{k} {d:+.2e}" for k, d in diff.items()))
        if "max_rel_diff_vs_reference" in out:
            print(f"largest relative E[W] difference from the reference: {out['max_rel_diff_vs_reference']:.2e}")
        print(f"largest 1-min load average seen: {out['max_load']:.2f}")
    if not args.no_write:
        with RESULTS.open("a") as fh:
            fh.write(json.dumps(out) + "\n")
        # the section is the whole table of the full-information compare; the rest only go to results
        if cases == list(range(1, 13)) and args.phase_info == "full" and args.cpu_priority == "none":
            other = out.get("other_exe") or (json.loads(Path(args.other).read_text()) if args.other else None)
            replace_section("cli-table1", section(out, other))
    return 0


def section(out: dict[str, Any], other: dict[str, Any] | None) -> str:
    """The ``cli-table1`` section: per case the fastest of the repeats, this exe and ``other``'s."""
    def best(run: dict[str, Any]) -> tuple[dict[int, float], float]:
        per: dict[int, float] = {}
        for r in run["runs"]:
            for c in r["cases"]:
                per[c["case"]] = min(per.get(c["case"], float("inf")), c["wall_s"])
        return per, min(r["total_wall_s"] for r in run["runs"])

    def latest(pred: Any) -> dict[str, Any] | None:
        found = None
        if RESULTS.exists():
            for line in RESULTS.read_text().splitlines():
                rec = json.loads(line)
                if pred(rec):
                    found = rec
        return found

    command = " ".join("REF.json" if a == out.get("_reference_arg") else "OTHER.json" if a == out.get("_other_arg") else a
                       for a in out["command"].split(" "))
    mine, total = best(out)
    theirs, total_o = best(other) if other else ({}, float("nan"))
    first = {c["case"]: c for c in out["runs"][0]["cases"]}
    lines = [
        "## Table 1 through the CLI: twelve sequential `overtake compare` processes",
        "",
        f"Date {out['date'][:10]}, machine: {out['machine']}; command: `{command}` (rev {out['rev']}"
        + ("" if not other else f"; `--other-exe` rev {other['rev']} run in alternation with it, case by case"
           if other.get("interleaved") else
           f"; OTHER.json: {len(other['runs'])} sequence(s) of `--exe` rev {other['rev']}, the same session")
        + "; every run in bench/results/solver_speed.jsonl). "
        f"Each case is a fresh process at the scenario's tolerance (0.1 %); per case the fastest of "
        f"{len(out['runs'])} sequence(s), and the fastest whole sequence. 1-min load average up to "
        f"{out['max_load']:.2f} (the machine is shared: wall times vary by up to 2× between runs). "
        "Targets: all twelve <= 20 s, cases 8 and 12 <= 3 s each.",
    ]
    # one paragraph, the twelve cases in one sentence: a short write-up
    cells = []
    for case in sorted(mine):
        cell = f"{mine[case]:.2f}" + (f"/{theirs[case]:.2f}" if other and case in theirs else "")
        if case in (8, 12):
            c = first[case]
            cell = f"**{cell}** ({c['states']:,} states, {c['iterations']:,} {c['method']} steps)"
        cells.append(cell)
    lines[-1] += (" Wall s per case 1–12" + (f" (this rev / {other['rev']})" if other else "") + ": "
                  + ", ".join(cells) + f"; **all twelve {total:.1f} s**" + (f" / {total_o:.1f} s" if other else "") + ".")
    notes: list[str] = []  # one closing paragraph
    if "max_rel_diff_vs_reference" in out:
        ref = out.get("reference", {})
        notes += [f"Largest relative difference of any policy's E[W] from the reference run (rev {ref.get('rev')}, "
                      f"{str(ref.get('date'))[:10]}, bench/results/solver_speed.jsonl): "
                      f"{out['max_rel_diff_vs_reference']:.1e} (target 1e-4)."]
    start = latest(lambda r: r.get("bench") == "cli_startup" and r.get("exe") == out["exe"])
    if start:
        w = start["wall_s"]["compare case01"]
        notes += [f"Cold start (`bench/cli_startup.py`, {start['date'][:10]}): `overtake compare case01.yaml --json` "
                      f"{w['min']:.3f} s min, {w['median']:.3f} s median (target 0.8 s); heavy imports: "
                      f"{', '.join(start['compare_imports']) or 'none'}."]
    pi = latest(lambda r: r.get("bench") == "mdp_peer" and "pi" in r.get("cpu_s", {}) and "pymdptoolbox" not in r["cpu_s"])
    if pi:
        c = pi["cpu_s"]
        notes += [f"Why Anderson stays the default (`{pi['command']}`): on case {pi['case']}'s {pi['states']:,} "
                      f"states policy iteration took {c['pi']:.1f} s CPU ({pi['sweeps']['pi']} policies, each evaluated by "
                      f"ILU-preconditioned GMRES), plain RVI {c['rvi']:.1f} s, Anderson {c['anderson']:.1f} s; a complete "
                      "sparse LU of one policy's system fills in (17 M entries, 184 s)."]
    if notes:
        lines[-1] += " " + " ".join(notes)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
