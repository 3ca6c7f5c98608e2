"""Paper 004, Table 1: π* and the four baselines on the twelve cases; writes a BENCHMARKS.md section.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/table1.py [--cases 1,2,...] [--tol 0.001]

Per case: gains (ours vs the paper's, cases 1–6), π* states, RVI sweeps, seconds, peak memory
(ru_maxrss of this process so far), blocking probability, the final truncation.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "api" / "commands"))

from api.commands._scenario import load_scenario  # noqa: E402
from mdp.compare import compare  # noqa: E402

REF = ROOT.parent / "shared" / "reference" / "table1.csv"
KEYS = {"pi(1)": "gain_pi1", "pi(4)": "gain_pi4", "pi(inf)": "gain_piinf", "pi(1,1)": "gain_pi11"}


def paper_rows() -> dict[int, dict[str, str]]:
    if not REF.exists():
        return {}
    rows = [r for r in csv.reader(REF.open()) if r and not r[0].startswith("#")]
    return {int(r[0]): dict(zip(rows[0], r)) for r in rows[1:]}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def write_section(text: str) -> None:
    path = ROOT / "BENCHMARKS.md"
    cur = path.read_text() if path.exists() else "# Benchmarks\n"
    begin, end = "<!-- table1:begin -->", "<!-- table1:end -->"
    block = f"{begin}\n{text}\n{end}"
    if begin in cur:
        cur = cur[: cur.index(begin)] + block + cur[cur.index(end) + len(end):]
    else:
        cur = cur.rstrip() + "\n\n" + block + "\n"
    path.write_text(cur)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(str(i) for i in range(1, 13)))
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    paper = paper_rows()
    out = {}
    lines = ["| case | arrival rate | pi* E[W] | gain pi(1) | pi(4) | pi(inf) | pi(1,1) | paper pi(1) | pi(4) | pi(inf) | pi(1,1) | states | sweeps | cap C / threads | blocking | s | peak MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    total = 0.0
    for c in [int(x) for x in args.cases.split(",")]:
        sc, model = load_scenario(ROOT / "examples" / "table1" / f"case{c:02d}.yaml")
        t0 = time.perf_counter()
        doc = compare(model, tol=args.tol, progress=lambda s: print(s, file=sys.stderr, flush=True))
        sec = time.perf_counter() - t0
        total += sec
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        g = doc["gains"]
        p = paper.get(c, {})
        pg = [p.get(KEYS[k], "") or "–" for k in KEYS]
        tr = doc["truncation"]
        star = doc["policies"]["pi*"]
        lines.append(
            f"| {c} | {doc['arrival_rate']:.5f} | {star['mean_response_time']:.4f} | "
            + " | ".join(f"{100 * g[k]:.2f}" for k in KEYS)
            + " | " + " | ".join(pg)
            + f" | {doc['states']} | {doc['iterations']} | {tr['max_requests']} / {tr['max_threads']} | "
            f"{star['blocking_probability']:.1e} | {sec:.1f} | {peak:.0f} |"
        )
        out[c] = {"gains": g, "seconds": sec, "states": doc["states"], "iterations": doc["iterations"]}
        print(lines[-1], flush=True)
    cmd = "OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/table1.py " + " ".join(sys.argv[1:])
    head = (
        f"## Paper 004 Table 1: pi* and baselines (mdp/)\n\n"
        f"Date {dt.date.today()}, machine: {os.cpu_count()} cores, {cpu_model()}, Python {platform.python_version()}; "
        f"command: `{cmd}`; auto-truncation tolerance {args.tol}. Gains in percent, "
        f"(E W(pi) - E W(pi*)) / E W(pi*). Paper columns are the paper's figures (cases 7-12 withheld). "
        f"Total {total:.0f} s for the cases listed (pi* and the four baselines, auto-truncation included).\n"
    )
    text = head + "\n" + "\n".join(lines)
    if not args.no_write:
        write_section(text)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
