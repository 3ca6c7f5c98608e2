"""Uplink load sweep: FAIR vs SRPT (and friends) at loads 0.5-0.9, several seeds.

Each (load, seed) is one bench/uplink_srpt.py run: a fresh testbed, one seeded Poisson schedule
replayed for every policy, so every ratio below is FAIR and the policy on the *same* arrivals
in the same run. Seeds give the spread a single run hides (the largest 1 % of a 30-60 s run
are a few dozen requests)::

    python bench/uplink_sweep.py --loads 0.5,0.6,0.7,0.8,0.9 --seeds 1,2,3 --duration 40 \
        --policies fair,srpt,srpt/t0.001,srrt,app:4 --record

``--record`` rewrites the bench/results/sections.md section ``uplink-sweep`` (``--section`` names another);
``--json`` prints every run. ``--out F`` appends each run to F as one JSON line as soon as it ends
(an interrupted sweep keeps what it measured); ``--from F`` (repeatable) summarises and records
runs saved that way instead of running any. Any other flag is passed to bench/uplink_srpt.py
(e.g. ``--sizes p000``). Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import uplink_srpt
from _report import machine, write_section

ROOT = Path(__file__).resolve().parents[1]
SECTION = "uplink-sweep"


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: {text!r} must be a comma list of numbers, e.g. 0.5,0.8") from None


def _ratio(m: dict[str, Any], fair: dict[str, Any], key: str) -> float:
    return float(m[key] / fair[key])


def span(xs: list[float]) -> str:
    """``median (min-max)`` of one ratio over the seeds."""
    if len(xs) == 1:
        return f"{xs[0]:.2f}"
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (load, policy): the policy's ratios to FAIR of the same run, over seeds."""
    rows: list[dict[str, Any]] = []
    loads = sorted({r["testbed"]["load"] for r in runs})
    for load in loads:
        at = [r for r in runs if r["testbed"]["load"] == load]
        for pol in at[0]["policies"]:
            per = [(r["policies"][pol], r["policies"]["fair"]) for r in at]
            rows.append({
                "load": load, "policy": pol, "seeds": [r["testbed"]["seed"] for r in at],
                "offered": [r["testbed"]["offered_load_realised"] for r in at],
                "mean_rt": [m["mean_response_time"] for m, _ in per],
                "mean_ratio": [_ratio(m, f, "mean_response_time") for m, f in per],
                "slowdown": [m["mean_slowdown"] for m, _ in per],
                "top1_ratio": [_ratio(m, f, "largest_1pct_mean_response_time") for m, f in per],
                "top1": [m["largest_1pct_mean_response_time"] for m, _ in per],
                "top1_fair": [f["largest_1pct_mean_response_time"] for _, f in per],
                "tput_ratio": [_ratio(m, f, "throughput_bytes_per_s") for m, f in per],
                "conns": [m["mean_connections"] for m, _ in per],
                "errors": sum(m["errors"] for m, _ in per),
            })  # fmt: skip
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| load | policy | offered | mean RT s | mean RT / FAIR | mean slowdown | "
           "largest 1 % / FAIR | bytes/s / FAIR | mean conns | errors |",
           "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(
            f"| {r['load']:g} | {r['policy']} | {statistics.mean(r['offered']):.2f} | "
            f"{statistics.mean(r['mean_rt']):.3f} | {span(r['mean_ratio'])} | "
            f"{statistics.mean(r['slowdown']):.1f} | {span(r['top1_ratio'])} | "
            f"{span(r['tput_ratio'])} | {statistics.mean(r['conns']):.1f} | {r['errors']} |"
        )
    return "\n".join(out)


def pooled_top1(r: dict[str, Any]) -> float:
    """The largest 1 %'s time over FAIR's, pooled over the seeds: the ratio of their summed
    per-seed means (each seed's largest 1 % is the same ~1 % of its requests). One run's ratio
    moves by +-10 % with the few very largest requests; pooling is the steadier estimate."""
    return float(sum(r["top1"]) / sum(r["top1_fair"]))


def targets(rows: list[dict[str, Any]]) -> str:
    """The uplink targets at load 0.8, counted per seed: mean <= 1/3, largest 1 % <= 1.1x; and the
    largest 1 % pooled over the seeds."""
    lines = []
    for r in rows:
        if r["load"] != 0.8 or r["policy"] == "fair":
            continue
        n = len(r["seeds"])
        m = sum(x <= 1 / 3 for x in r["mean_ratio"])
        t = sum(x <= 1.1 for x in r["top1_ratio"])
        e = sum(abs(x - 1) <= 0.01 for x in r["tput_ratio"])
        pooled = f"; pooled over the seeds {pooled_top1(r):.2f}x" if n > 1 else ""
        # runs saved separately may repeat a seed: then they are counted as runs
        what = "seeds" if len(set(r["seeds"])) == n else f"runs (seeds {_seed_list(r['seeds'])})"
        lines.append(f"- {r['policy']} at load 0.8: mean RT <= 1/3 of FAIR's in {m}/{n} {what}, "
                     f"largest 1 % <= 1.1x in {t}/{n}{pooled}, byte throughput within 1 % in "
                     f"{e}/{n}.")
    return "\n".join(lines)


def _seed_list(seeds: list[int]) -> str:
    return ",".join(str(x) for x in seeds)


def cutoff_rules(policies: list[str]) -> str:
    """Say what each srpt/tF, /wK and /bN variant in the table is (F = share of sizes above the
    top cutoff, K = lowest-band writers, N = bands so ordered)."""
    parts = [uplink_srpt.parse_variant(p) for p in policies]
    ts = sorted({v.top for v in parts if v.top is not None})
    ws = sorted({v.writers for v in parts if v.writers})
    bs = sorted({v.ordered for v in parts if v.ordered > 1})
    return ("".join(f"; srpt/t{t:g} = top cutoff at the {100 * (1 - t):g}th" for t in ts)
            + "".join(f"; /w{w} = at most {w} response{'s' if w > 1 else ''} of the lowest band "
                      "writing at once, least remaining first" for w in ws)
            + "".join(f"; /b{b} = each of the lowest {b} bands so" for b in bs))


def load_runs(paths: list[str]) -> list[dict[str, Any]]:
    """Runs saved by ``--out`` (one JSON object a line) or printed by ``--json`` (a JSON list)."""
    runs: list[dict[str, Any]] = []
    for p in paths:
        try:
            text = Path(p).read_text()
        except OSError as exc:
            raise SystemExit(f"--from: cannot read {p}: {exc.strerror}") from None
        # (text, line offset) chunks: the whole file for a --json list, else one per line
        chunks = ([(text, 0)] if text.lstrip().startswith("[")
                  else [(ln, i) for i, ln in enumerate(text.splitlines()) if ln.strip()])
        for chunk, off in chunks:
            try:
                got = json.loads(chunk)
            except json.JSONDecodeError as exc:
                raise SystemExit(f"--from: {p} line {off + exc.lineno}: not JSON ({exc.msg}); "
                                 "give a file written by --out or --json") from None
            runs.extend(got if isinstance(got, list) else [got])
    if not runs:
        raise SystemExit(f"--from: no runs in {', '.join(paths)}")
    for i, r in enumerate(runs):
        if not isinstance(r, dict) or not {"load", "seed", "duration_s"} <= set(r.get("testbed", {})):
            raise SystemExit(f"--from: run {i} is not a bench/uplink_srpt.py result (no testbed "
                             "load/seed/duration_s)")
        if "fair" not in r.get("policies", {}):
            raise SystemExit(f"--from: run {i} has no fair policy (every ratio is taken against it)")
    return runs


def commands(runs: list[dict[str, Any]]) -> list[list[str]]:
    """The sweeps that measure ``runs`` again (for a record made with ``--from``): one per set
    of runs sharing policies, duration, sizes and server."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in runs:
        tb = r["testbed"]
        key = (tuple(r["policies"]), tb["duration_s"], tb.get("sizes"), tb.get("server"))
        groups.setdefault(key, []).append(r)
    out = []
    for (pols, dur, sizes, server), rs in groups.items():
        loads = sorted({r["testbed"]["load"] for r in rs})
        seeds = sorted({r["testbed"]["seed"] for r in rs})
        out.append(["--loads", ",".join(f"{x:g}" for x in loads),
                    "--seeds", ",".join(map(str, seeds)), "--duration", f"{dur:g}",
                    "--policies", ",".join(pols), "--sizes", str(sizes), "--server", str(server)])  # fmt: skip
    return out


def record(rows: list[dict[str, Any]], runs: list[dict[str, Any]], argvs: list[list[str]],
           section: str = SECTION, summarised_by: list[str] | None = None) -> None:
    tb = runs[0]["testbed"]
    loads = sorted({r["testbed"]["load"] for r in runs})
    durations = sorted({r["testbed"]["duration_s"] for r in runs})
    top_fraction = tb.get("srpt_top_fraction", uplink_srpt.LEGACY_TOP_FRACTION)
    span = f"{loads[0]:g}" if len(loads) == 1 else f"{loads[0]:g}-{loads[-1]:g}"
    starts = [r["testbed"].get("loadavg_1min_at_start") for r in runs]
    la = [x for x in starts if x is not None]
    when = (f"load average {min(la):.1f}-{max(la):.1f} at the runs' starts" if la
            else "load average unknown")
    text = "\n".join([
        f"## {section}: FAIR vs SRPT over uplink load {span}, "
        f"{'/'.join(f'{d:g}' for d in durations)} s, several seeds", "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine()} at the end, {when}; " +
        "; ".join(f"`OPENBLAS_NUM_THREADS=1 python bench/uplink_sweep.py {' '.join(a)}`"
                  for a in argvs)
        + (f" (saved with --out or --json; recorded by `python bench/uplink_sweep.py "
           f"{' '.join(summarised_by)}`)" if summarised_by else ""), "",
        f"Each (load, seed) is one bench/uplink_srpt.py run ({tb['qdisc'].split(': ', 1)[-1]}; "
        f"server {tb['server']}; {tb['sizes']} sizes; Poisson "
        "arrivals, one connection per request): a fresh testbed and one schedule replayed for every "
        "policy, so each ratio is the policy over FAIR on the same arrivals. Ratios: median over "
        "the seeds (min-max); other columns: mean over the seeds. srpt = the cutoffs of the bench's "
        f"default rule then (top one at the {100 * (1 - top_fraction):g}th size percentile)"
        f"{cutoff_rules(list(runs[0]['policies']))}.", "",
        table(rows), "", targets(rows), "",
    ])  # fmt: skip
    write_section(section, text)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", default="0.5,0.6,0.7,0.8,0.9")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--policies", default="fair,srpt,srpt/t0.001,srrt,app:4",
                    help="as bench/uplink_srpt.py --policies; must include fair (the baseline)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--section", default=SECTION, help="bench/results/sections.md section for --record")
    ap.add_argument("--out", help="append each run to this file as one JSON line when it ends")
    ap.add_argument("--from", dest="from_", action="append", metavar="FILE",
                    help="summarise runs saved by --out/--json instead of running (repeatable)")
    args, rest = ap.parse_known_args(argv)
    if not args.section.replace("-", "").isalnum():
        ap.error(f"--section: {args.section!r} must be letters, digits and '-', e.g. uplink-sweep")
    if args.from_:
        if rest:
            ap.error(f"{rest[0]}: not used with --from (the saved runs already ran)")
        runs = load_runs(args.from_)
        return _report(runs, args, commands(runs), summarised_by=argv)
    loads, seeds = _floats(args.loads, "--loads"), [int(s) for s in _floats(args.seeds, "--seeds")]
    if "fair" not in args.policies.split(","):
        ap.error("--policies: include fair, the baseline every ratio is taken against")
    for bad in ("--load", "--seed", "--record", "--json", "--workload"):
        if bad in rest:
            ap.error(f"{bad}: set by the sweep (use --loads/--seeds, or bench/uplink_srpt.py)")
    us_ap = uplink_srpt.parser()
    per_run = [uplink_srpt.parse(us_ap, [*rest, "--load", str(ld), "--seed", str(sd),
                                         "--policies", args.policies])
               for ld in loads for sd in seeds]  # fmt: skip
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.geteuid() != 0:
        print("uplink_sweep: needs root (network namespaces, qdiscs)", file=sys.stderr)
        return 2
    autogroup = uplink_srpt.raise_priority()
    runs = []
    for a in per_run:
        a.autogroup, a.loadavg = autogroup, os.getloadavg()[0]
        print(f"load {a.load} seed {a.seed}", file=sys.stderr, flush=True)
        runs.append(uplink_srpt.run(a))
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(runs[-1]) + "\n")
    return _report(runs, args, [argv])


def _report(runs: list[dict[str, Any]], args: argparse.Namespace, argvs: list[list[str]],
            summarised_by: list[str] | None = None) -> int:
    """Print the runs (``--json``) or their table and targets; ``--record`` writes the section."""
    rows = summarise(runs)
    print(json.dumps(runs, indent=1) if args.json else table(rows) + "\n\n" + targets(rows))
    if args.record:
        record(rows, runs, argvs, args.section, summarised_by)
    return 0


if __name__ == "__main__":
    sys.exit(main())
