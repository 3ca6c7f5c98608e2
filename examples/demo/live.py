"""The live half of ``make demo``: the bundled example's load on a private Apache through the sidecar.

    python examples/demo/live.py --out demo-out --default 127.0.0.1:PORT --sidecar 127.0.0.1:PORT \
        --apache 127.0.0.1:PORT --prometheus http://127.0.0.1:PORT [--seconds 70] [--seed 7]

``examples/demo/run.sh`` starts everything and stops it again; this script only drives it. Two
private Apaches share one core: Apache's default (behind a sidecar that passes everything
through, ``--default``) and one loading mod_overtake_prio at the threshold the model chose,
behind the product's sidecar (``--sidecar``: ``classifier.mode: auto`` over the policies of
``OUT/policies/``, ``--cpu-priority age``). One trace of open-loop Poisson transactions (rate λ
of ``OUT/scenario.yaml``, demands drawn from the fitted PH; the example's time unit is the second
of Apache thread CPU) is replayed three times (common random numbers):

1. Apache's default π(∞);
2. the product without any phase header — what a real site sends; auto runs what it predicts best
   for that (and says why);
3. the product with the phase header (``X-Overtake-Phase``, the start phase of each demand).

Each row: measured mean response time (95 % CI, 20 batch means), the trace's ideal twin (the same
transactions on a processor-sharing CPU through the sidecar's own limiter and, where Apache runs
it, CPU priority) and the model's prediction. Gains over π(∞) are (E W(π(∞)) − E W) / E W
with a paired 95 % CI, and 'adjusted' = measured − twin + model: the twin as control variate
removes this trace's randomness. Writes ``OUT/report.png`` and ``OUT/live.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import numpy as np

from overtake.api import plots
from overtake.api.scenario import load_scenario
from overtake.controller.harness.loadgen import (
    batch_means,
    calibrate,
    get,
    http_request,
    make_trace,
    paired_gain_ci,
    replay,
    wait_idle,
)
from overtake.controller.sidecar import virtual
from overtake.controller.sidecar.auto import MODE_FOR
from overtake.mdp.policy import Policy
from overtake.mdp.priority import DEFAULT_LOW_WEIGHT, age_priority

REPO = Path(__file__).resolve().parents[2]
ROWS = (("pi(inf)", "Apache's default", False), ("no header", "Overtake, no phase header", False),
        ("header", "Overtake, with phase header", True))


def prom_query(base: str, expr: str) -> list[dict[str, Any]]:
    code, body = http_request("GET", f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    if code != 200:
        raise SystemExit(f"demo: Prometheus query {expr!r} answered {code}: {body[:200]!r}")
    res: list[dict[str, Any]] = json.loads(body)["data"]["result"]
    return res


def auto_state(admin: int) -> dict[str, Any]:
    code, body = http_request("GET", f"http://127.0.0.1:{admin}/-/policy")
    if code != 200:
        raise SystemExit(f"demo: GET /-/policy answered {code}")
    auto: dict[str, Any] = json.loads(body)["auto"]
    return auto


def prime(port: int, admin: int, header: bool, want: str, timeout: float = 30.0) -> dict[str, Any]:
    """Show auto the traffic of the next row (tiny requests with or without the phase header)
    until it runs a policy for information ``want``; its state then."""
    deadline = time.monotonic() + timeout
    while True:
        for _ in range(120):
            for s in (1, 2):
                get(port, f"/stage{s}?work=0.00005", {"X-Overtake-Phase": "1"} if header else None)
        st = auto_state(admin)
        if st["phase_info"] == want or time.monotonic() > deadline:
            return st
        time.sleep(0.5)


def report(out: Path, pol: Policy, rows: dict[str, dict[str, Any]], caption: str) -> Path:
    """Measured (± 95 % CI), twin and model bars per row (left); π*'s heatmap (right)."""
    from matplotlib.figure import Figure
    from matplotlib.image import imread

    heat = imread(io.BytesIO(plots.png(plots.policy_figure(
        pol, size=6, title=f"π* for known phases ({pol.digest()}): threads started per state"), dpi=80)))
    fig = Figure(figsize=(15, 7.5))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.1, 1.4]})
    names = list(rows)
    x = np.arange(len(names))
    meas = [rows[n]["measured_ms"] for n in names]
    ci = [rows[n]["ci95_ms"] for n in names]
    tw = [rows[n]["twin_ms"] for n in names]
    pred = [rows[n]["predicted_ms"] for n in names]
    left.bar(x - 0.27, meas, 0.27, yerr=ci, capsize=4, color="#d62728", label="measured ± 95 % CI")
    left.bar(x, tw, 0.27, color="#ff9896", label="ideal twin (same trace)")
    left.bar(x + 0.27, pred, 0.27, color="#1f77b4", label="model")
    for xi, m, p in zip(x, meas, pred):
        left.annotate(f"{m:.1f}", (xi - 0.27, m), ha="center", va="bottom", xytext=(0, 3), textcoords="offset points")
        left.annotate(f"{p:.1f}", (xi + 0.27, p), ha="center", va="bottom", xytext=(0, 3), textcoords="offset points")
    left.set_xticks(x, [f"{rows[n]['label']}\n({rows[n]['runs']})" for n in names], fontsize=8)
    left.set_ylabel("mean response time per transaction, ms")
    left.set_ylim(0, 1.3 * max(m + c for m, c in zip(meas, ci)))
    left.legend(loc="upper right", fontsize=8)
    left.set_title("measured vs predicted", fontsize=10)
    right.imshow(heat)
    right.set_axis_off()
    fig.suptitle(caption, fontsize=10)
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.12, top=0.88, wspace=0.05)
    path = out / "report.png"
    fig.savefig(path, dpi=80)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="demo-out")
    ap.add_argument("--default", required=True, metavar="HOST:PORT", help="sidecar in front of Apache's default")
    ap.add_argument("--sidecar", required=True, metavar="HOST:PORT", help="the product's sidecar (auto, CPU priority)")
    ap.add_argument("--default-admin", required=True, metavar="HOST:PORT", help="--default's admin listener")
    ap.add_argument("--sidecar-admin", required=True, metavar="HOST:PORT", help="--sidecar's admin listener")
    ap.add_argument("--apache", required=True, metavar="HOST:PORT", help="Apache itself (overhead calibration)")
    ap.add_argument("--prometheus", required=True, metavar="URL")
    ap.add_argument("--seconds", type=float, default=70.0, help="length of the load trace per row (default 70)")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    # own session, hence own scheduler autogroup at -20 (root), as Apache's and the sidecars': the
    # load driver must send on time on a shared machine (bench/apache_table2.py does the same)
    try:
        os.setsid()
        Path("/proc/self/autogroup").write_text("-20")
    except OSError:
        pass
    out = Path(args.out).resolve()
    _, model = load_scenario(out / "scenario.yaml")
    full = Policy.load(out / "policies" / "full.npz")
    ps_w = float(full.meta["baselines"]["pi(inf)"])  # Apache's default, exact (seconds: unit 1 s)
    age = full.meta["cpu_priority"]["age"]
    prio = age_priority(model, age["thresholds"], weights=[1.0, DEFAULT_LOW_WEIGHT])
    ports = {"pi(inf)": int(args.default.rsplit(":", 1)[1]), "no header": int(args.sidecar.rsplit(":", 1)[1]),
             "header": int(args.sidecar.rsplit(":", 1)[1])}
    admins = {"pi(inf)": int(args.default_admin.rsplit(":", 1)[1]),
              "no header": int(args.sidecar_admin.rsplit(":", 1)[1]), "header": int(args.sidecar_admin.rsplit(":", 1)[1])}

    n = max(400, int(round(args.seconds * model.arrival_rate)))
    trace = make_trace(model, n, args.seed)
    overhead = calibrate(int(args.apache.rsplit(":", 1)[1]), 0.01)
    means = [float(st.mean()) for st in model.stages]
    print(f"load: {n} transactions (Poisson, {model.arrival_rate:.2f}/s, {trace['arrival'][-1]:.0f} s per row), "
          f"stage means {', '.join(f'{1e3 * m:.2f} ms' for m in means)} of Apache CPU, rho {model.load:.2f}; "
          f"Apache's own CPU per request {1e3 * overhead:.2f} ms (subtracted from each demand); "
          f"age threshold {1e3 * prio.thresholds[0][0]:.1f} ms of thread CPU", flush=True)

    rows: dict[str, dict[str, Any]] = {}
    rts: dict[str, np.ndarray] = {}
    ideal: dict[str, np.ndarray] = {}
    for name, label, header in ROWS:
        port = ports[name]
        if name == "pi(inf)":
            runs, spec, mode, lv, w = "passthrough, no CPU priority", "passthrough", "explicit", None, ps_w
            why = "Apache's default: a thread for every request, the CPU shared equally"
        else:
            st = prime(port, admins[name], header, "full" if header else "none")
            chosen = st["chosen"]
            spec = "passthrough" if chosen == "passthrough" else str(out / "policies" / chosen)
            mode = MODE_FOR[st["phase_info"]]
            lv, runs = prio, f"{chosen} + age priority"
            w = ps_w * (1 - float(st["predicted_gain"]))
            why = st["reason"]
        ideal[name] = virtual.replay(trace, spec, time_unit=1.0, mode=mode, max_inflight=60, cpu_priority=lv)
        wait_idle(admins[name])
        t0 = time.monotonic()
        rt, failures = asyncio.run(replay(port, trace, 1.0, model.n_stages, overhead, phase_header=header))
        rts[name] = rt
        mean, ci = batch_means(rt)
        im, _ = batch_means(ideal[name])
        rows[name] = {"label": label, "runs": runs, "why": why, "measured_ms": 1e3 * mean, "ci95_ms": 1e3 * ci,
                      "twin_ms": 1e3 * im, "predicted_ms": 1e3 * w, "failures": failures,
                      "seconds": time.monotonic() - t0}
        print(f"  {label:28s}: measured {1e3 * mean:6.1f} ms ± {1e3 * ci:.1f}, twin {1e3 * im:6.1f}, "
              f"model {1e3 * w:6.1f} ms, {failures} failures, {time.monotonic() - t0:.0f} s\n"
              f"  {'':28s}  runs {runs}: {why}", flush=True)

    inf = rows["pi(inf)"]
    print(f"\n{'':30s}{'measured E[W]':>18s}{'twin':>9s}{'model':>9s}   gain over Apache's default: measured ± CI "
          "(adjusted ± CI) / model")
    for name, label, _ in ROWS:
        r = rows[name]
        line = f"{label:30s}{r['measured_ms']:10.1f} ± {r['ci95_ms']:4.1f}{r['twin_ms']:9.1f}{r['predicted_ms']:9.1f}"
        if name != "pi(inf)":
            g = (inf["measured_ms"] - r["measured_ms"]) / r["measured_ms"]
            gt = (inf["twin_ms"] - r["twin_ms"]) / r["twin_ms"]
            gm = (inf["predicted_ms"] - r["predicted_ms"]) / r["predicted_ms"]
            gci = paired_gain_ci(rts[name], rts["pi(inf)"])
            aci = paired_gain_ci(rts[name], rts["pi(inf)"] - ideal["pi(inf)"] + ideal[name])
            r.update(gain=g, gain_ci95=gci, gain_twin=gt, gain_model=gm, gain_adjusted=g - gt + gm, gain_adjusted_ci95=aci)
            verdict = ("resolved" if g - gci > 0 else "not resolved (the CI includes 0)") if gm >= 0.05 else \
                "model gain below 5 %"
            line += (f"   {100 * g:+.1f} % ± {100 * gci:.1f} ({100 * (g - gt + gm):+.1f} % ± {100 * aci:.1f}) / "
                     f"{100 * gm:+.1f} %: {verdict}")
        print(line)

    # one Prometheus query: the product sidecar's series (and Apache's and the module's, exported by it)
    time.sleep(2.5)  # > 2 scrape intervals since the last request
    admitted = prom_query(args.prometheus, "sum by (stage) (overtake_stage_admitted_total)")
    demoted = prom_query(args.prometheus, 'sum(overtake_cpu_prio_requests_total{level!="0"})')
    print(f"Prometheus ({args.prometheus}): "
          + ", ".join(f"overtake_stage_admitted_total{{stage={r['metric'].get('stage')}}} = {float(r['value'][1]):.0f}"
                      for r in admitted)
          + (f"; requests demoted by mod_overtake_prio = {float(demoted[0]['value'][1]):.0f}" if demoted else ""))
    if not admitted:
        raise SystemExit("demo: Prometheus has no overtake_stage_admitted_total series (is it scraping the sidecar?)")

    nh = rows["no header"]
    caption = (f"load ρ = {model.load:.2f} ({model.arrival_rate:.1f} transactions/s, {n} per row); without a phase "
               f"header Overtake runs {nh['runs']}: {100 * nh['gain']:+.1f} % ± {100 * nh['gain_ci95']:.1f} over "
               f"Apache's default (model {100 * nh['gain_model']:+.1f} %)")
    path = report(out, full, rows, caption)
    (out / "live.json").write_text(json.dumps({
        "transactions": n, "seed": args.seed, "apache_overhead_ms": 1e3 * overhead, "rows": rows,
        "age_threshold_s": prio.thresholds[0][0],
        "prometheus": {"admitted": {r["metric"].get("stage"): float(r["value"][1]) for r in admitted}},
    }, indent=1))
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path} and live.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
