"""The live half of ``make demo``: the bundled example's load on a private Apache through the sidecar.

    python examples/demo/live.py --out demo-out --sidecar 127.0.0.1:PORT --apache 127.0.0.1:PORT \
        --prometheus http://127.0.0.1:PORT [--seconds 45] [--seed 7]

``examples/demo/run.sh`` starts Apache, the sidecar (``--policy passthrough``) and Prometheus and
stops them again; this script only drives them. One trace of open-loop Poisson transactions
(rate λ of ``OUT/scenario.yaml``, about ``--seconds`` long) with service demands drawn from the
fitted PH of each stage (the example's time unit is the second: a demand d burns d seconds of
Apache thread CPU, the start phase goes in X-Overtake-Phase) is replayed twice — under Apache's
default π(∞) (``passthrough``) and under π* (``OUT/policy.npz``), swapped with ``PUT /-/policy``
— with the load driver of :mod:`overtake.controller.harness.loadgen` (bench/apache_table2.py's).
It prints the measured mean response times (95 % CI, 20 batch means) next to the model's (π*:
the solver's E[W]; π(∞): M/G/1-PS, E[S]/(1 − ρ), paper 004 §4), queries Prometheus once for the sidecar's and Apache's series, and
writes ``OUT/report.png`` (measured vs predicted bars + π*'s heatmap from :mod:`overtake.api.plots`) and
``OUT/live.json``.
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
from overtake.controller.harness.loadgen import batch_means, calibrate, http_request, make_trace, replay, wait_idle
from overtake.mdp.policy import Policy

REPO = Path(__file__).resolve().parents[2]

RUNS = (("pi(inf)", "passthrough", "Apache's default"), ("pi*", "", "the solved policy"))


def prom_query(base: str, expr: str) -> list[dict[str, Any]]:
    code, body = http_request("GET", f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    if code != 200:
        raise SystemExit(f"demo: Prometheus query {expr!r} answered {code}: {body[:200]!r}")
    res: list[dict[str, Any]] = json.loads(body)["data"]["result"]
    return res


def report(out: Path, pol: Policy, rows: dict[str, dict[str, float]]) -> Path:
    """Measured vs predicted bars (left) and π*'s policy heatmap (right, api.plots.policy_figure)."""
    from matplotlib.figure import Figure
    from matplotlib.image import imread

    heat = imread(io.BytesIO(plots.png(plots.policy_figure(
        pol, size=6, title=f"π* ({pol.digest()}): threads started per state"), dpi=80)))
    fig = Figure(figsize=(14, 7.5))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.5]})
    names = [n for n, _, _ in RUNS]
    x = np.arange(len(names))
    meas = [rows[n]["measured_ms"] for n in names]
    ci = [rows[n]["ci95_ms"] for n in names]
    pred = [rows[n]["predicted_ms"] for n in names]
    left.bar(x - 0.2, meas, 0.4, yerr=ci, capsize=4, color="#d62728", label="measured (Apache + sidecar)")
    left.bar(x + 0.2, pred, 0.4, color="#1f77b4", label="model")
    for xi, m, p in zip(x, meas, pred):
        left.annotate(f"{m:.1f}", (xi - 0.2, m), ha="center", va="bottom", xytext=(0, 3), textcoords="offset points")
        left.annotate(f"{p:.1f}", (xi + 0.2, p), ha="center", va="bottom", xytext=(0, 3), textcoords="offset points")
    left.set_xticks(x, ["π(∞) (Apache default)", "π*"])
    left.set_ylabel("mean response time, ms")
    left.set_title("measured vs predicted mean response time")
    left.set_ylim(0, 1.3 * max(m + c for m, c in zip(meas, ci)))
    left.legend(loc="upper left")
    right.imshow(heat)
    right.set_axis_off()
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.06, top=0.93, wspace=0.05)
    path = out / "report.png"
    fig.savefig(path, dpi=80)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="demo-out")
    ap.add_argument("--sidecar", required=True, metavar="HOST:PORT")
    ap.add_argument("--apache", required=True, metavar="HOST:PORT", help="Apache itself (overhead calibration)")
    ap.add_argument("--prometheus", required=True, metavar="URL")
    ap.add_argument("--seconds", type=float, default=45.0, help="length of the load trace per policy (default 45)")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    # own session, hence own scheduler autogroup at -20 (root), as Apache's and the sidecar's: the
    # load driver must send on time on a shared machine (bench/apache_table2.py does the same)
    try:
        os.setsid()
        Path("/proc/self/autogroup").write_text("-20")
    except OSError:
        pass
    out = Path(args.out).resolve()
    _, model = load_scenario(out / "scenario.yaml")
    pol = Policy.load(out / "policy.npz")
    side_host, side_port = args.sidecar.rsplit(":", 1)
    side = f"http://{args.sidecar}"

    # model predictions in the example's unit (seconds): π* from the solver, π(∞) = M/G/1-PS
    means = [float(st.mean()) for st in model.stages]
    es = sum(means)
    predicted = {"pi*": float(pol.meta["metrics"]["mean_response_time"]), "pi(inf)": es / (1 - model.arrival_rate * es)}

    n = max(200, int(round(args.seconds * model.arrival_rate)))
    trace = make_trace(model, n, args.seed)
    overhead = calibrate(int(args.apache.rsplit(":", 1)[1]), 0.01)
    print(f"load: {n} transactions (Poisson, {model.arrival_rate:.2f}/s, {trace['arrival'][-1]:.0f} s), "
          f"stage means {', '.join(f'{1e3 * m:.2f} ms' for m in means)} of Apache CPU, rho {model.load:.2f}; "
          f"Apache's own CPU per request {1e3 * overhead:.2f} ms (subtracted from each demand)", flush=True)

    rows: dict[str, dict[str, float]] = {}
    for name, spec, what in RUNS:
        body = (spec or str(out / "policy.npz")).encode()
        code, text = http_request("PUT", f"{side}/-/policy", body)
        if code != 200:
            raise SystemExit(f"demo: the sidecar refused {name}: {text.decode().strip()}")
        wait_idle(int(side_port))
        t0 = time.monotonic()
        rt, failures = asyncio.run(replay(int(side_port), trace, 1.0, model.n_stages, overhead))
        mean, ci = batch_means(rt)
        rows[name] = {"measured_ms": 1e3 * mean, "ci95_ms": 1e3 * ci, "predicted_ms": 1e3 * predicted[name],
                      "failures": failures, "seconds": time.monotonic() - t0}
        print(f"  {name:8s} ({what}): measured {1e3 * mean:6.1f} ms ± {1e3 * ci:.1f}, model {1e3 * predicted[name]:6.1f} ms, "
              f"{failures} failures, {time.monotonic() - t0:.0f} s", flush=True)

    star, inf = rows["pi*"], rows["pi(inf)"]
    g_meas = (inf["measured_ms"] - star["measured_ms"]) / star["measured_ms"]
    g_pred = (inf["predicted_ms"] - star["predicted_ms"]) / star["predicted_ms"]
    print(f"\n{'policy':24s}{'measured E[W]':>18s}{'model E[W]':>13s}")
    print(f"{'pi(inf) Apache default':24s}{inf['measured_ms']:10.1f} ± {inf['ci95_ms']:4.1f} ms{inf['predicted_ms']:10.1f} ms")
    print(f"{'pi* (policy.npz)':24s}{star['measured_ms']:10.1f} ± {star['ci95_ms']:4.1f} ms{star['predicted_ms']:10.1f} ms")
    print(f"gain of pi* over pi(inf): measured {100 * g_meas:+.1f} %, model {100 * g_pred:+.1f} %")

    # one Prometheus query: the sidecar's series (and Apache's, exported by the sidecar) are scraped
    time.sleep(2.5)  # > 2 scrape intervals since the last request
    admitted = prom_query(args.prometheus, "sum by (stage) (overtake_stage_admitted_total)")
    apache_acc = prom_query(args.prometheus, "apache_accesses_total")
    print(
        f"Prometheus ({args.prometheus}): "
        + ", ".join(
            f"overtake_stage_admitted_total{{stage={r['metric'].get('stage')}}} = {float(r['value'][1]):.0f}"
            for r in admitted
        )
        + (
            f"; apache_accesses_total = {float(apache_acc[0]['value'][1]):.0f}"
            if apache_acc
            else "; apache_accesses_total: none"
        )
    )
    if not admitted:
        raise SystemExit("demo: Prometheus has no overtake_stage_admitted_total series (is it scraping the sidecar?)")

    path = report(out, pol, rows)
    (out / "live.json").write_text(json.dumps({
        "transactions": n, "seed": args.seed, "apache_overhead_ms": 1e3 * overhead, "policies": rows,
        "gain_measured": g_meas, "gain_model": g_pred,
        "prometheus": {"admitted": {r["metric"].get("stage"): float(r["value"][1]) for r in admitted}},
    }, indent=1))
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path} and live.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
