"""The sidecar's online loop (controller/online.py): cost of one refit and accuracy of its estimates.

Part ``fit`` (in-process, no Apache): case 4 of van der Weij et al.'s Table 1 (H2 stages, load 0.6) as the
truth; for each sample size and seed, draw demands per stage and Poisson arrivals over the
arrival window, estimate λ with :class:`overtake.controller.online.ArrivalRate`, run
:func:`overtake.controller.online.refit_job` with π(1) running (fit, solve π*, evaluate π(1) under the
refitted model) and report seconds per part, the estimators' errors and the predicted E[W]
against the exact values on the true model.

Part ``apache``: a real sidecar (``--online --access-log``) in front of a real Apache, π(1) at
start, case-4 transactions (time unit 5 ms); compares the two demand sources the sidecar holds
(attained service under sharing vs Apache's CPU notes) with the demands sent, and records the
refit it made.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/online_refit.py [--seeds 5] [--parts fit,apache]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from _report import machine, write_section

from overtake.controller.harness.loadgen import get, sidecar_admin, wait_sidecar
from overtake.controller.harness.scratch import free_port, scratch_dir
from overtake.controller.online import ArrivalRate, RefitJob, refit_job
from overtake.mdp import solve
from overtake.mdp.model import Stage, TandemModel
from overtake.mdp.rule_evaluation import evaluate_baseline

ROOT = Path(__file__).resolve().parents[1]

PROBS, MEANS = np.array([0.91, 0.09]), np.array([0.55, 5.45])
MEAN = float(PROBS @ MEANS)
LOAD = 0.6


def h2(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.asarray(rng.exponential(np.where(rng.random(n) < PROBS[1], MEANS[1], MEANS[0])), dtype=float)


def part_fit(seeds: int, out: Path) -> tuple[str, dict[str, Any]]:
    a, T = PROBS, np.diag(-1 / MEANS)
    lam = LOAD / (2 * MEAN)
    true = TandemModel(lam, (Stage("stage1", a, T), Stage("stage2", a, T)))
    star_true = solve(true, tol=1e-3).metrics.mean_response_time
    pi1_true = evaluate_baseline(true, "pi(1)", tol=1e-3).metrics.mean_response_time
    unit, window = 0.01, 60.0
    rows = []
    raw: dict[str, Any] = {"true": {"pi*": star_true, "pi(1)": pi1_true}, "runs": []}
    for n, tol in ((500, 1e-2), (2000, 1e-2), (4000, 1e-2), (4000, 1e-3)):
        runs = []
        for seed in range(seeds if tol == 1e-2 else min(seeds, 2)):
            rng = np.random.default_rng(1000 + seed)
            xs = (h2(rng, n), h2(rng, n))
            est = ArrivalRate(window, start=0.0)
            lam_s = lam / unit
            t = 0.0
            while True:
                t += rng.exponential(1 / lam_s)
                if t > window:
                    break
                est.add(t)
            lam_hat = est.rate(window)
            assert lam_hat is not None
            job = RefitJob(("stage1", "stage2"), xs, lam_hat * unit, 1, 0.0, (None, None), 2, "full", "pi(1)", tol,
                           str(out / f"p-{n}-{seed}.npz"))
            t0 = time.perf_counter()
            r = refit_job(job)
            wall = time.perf_counter() - t0
            runs.append({"n": n, "tol": tol, "seed": seed, "wall": wall, **r["seconds"],
                         "mean_err": max(abs(s["mean"] - MEAN) / MEAN for s in r["stages"]),
                         "lam_err": abs(lam_hat * unit - lam) / lam, "orders": [s["order"] for s in r["stages"]],
                         "new": r["predicted_new"], "cur": r["predicted_current"], "states": r["states"]})
            print(json.dumps(runs[-1]), flush=True)
        raw["runs"] += runs
        def med(k: str, runs: list[dict[str, Any]] = runs) -> float:
            return float(np.median([x[k] for x in runs]))

        def mx(k: str, runs: list[dict[str, Any]] = runs) -> float:
            return float(np.max([x[k] for x in runs]))

        swaps = sum(x["new"] < 0.99 * x["cur"] for x in runs)
        rows.append(f"| {n} | {tol:g} | {len(runs)} | {med('fit'):.2f} | {med('solve'):.2f} | {med('evaluate'):.2f} | "
                    f"{med('wall'):.2f} / {mx('wall'):.2f} | {med('mean_err'):.1%} / {mx('mean_err'):.1%} | "
                    f"{med('lam_err'):.1%} / {mx('lam_err'):.1%} | "
                    f"{min(x['new'] for x in runs):.3f}–{max(x['new'] for x in runs):.3f} | "
                    f"{min(x['cur'] for x in runs):.3f}–{max(x['cur'] for x in runs):.3f} | {swaps}/{len(runs)} |")
    text = (
        f"Truth: case 4 (H2 p = (0.91, 0.09), means (0.55, 5.45) per stage, load {LOAD}); exact E[W] "
        f"π* = {star_true:.4f}, π(1) = {pi1_true:.4f} (tol 1e-3). λ estimated by ArrivalRate over one 60 s window "
        "(time unit 10 ms: ≈ 1,800 arrivals). One refit = refit_job in-process (the sidecar runs it in its worker "
        "process): PH fit per stage (order 1 or 2 by BIC), solve π*, exact E[W] of π(1) under the refitted model.\n\n"
        "| samples/stage | solve tol | runs | fit s | solve s | evaluate s | total s median / max | mean error median / max "
        "| λ error median / max | predicted E[W] π* | predicted E[W] π(1) | swap (> 1 %) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    return text, raw


def part_apache(transactions: int) -> tuple[str, dict[str, Any]]:
    from overtake.controller.harness import apache

    parent = scratch_dir("overtake-online-bench-")
    cores = sorted(os.sched_getaffinity(0))
    inst = apache.start(parent / "wd", f"127.0.0.1:{free_port()}", cpu=cores[-1] if len(cores) > 1 else None,
                        max_workers=32)
    unit = 0.005
    (parent / "stages.yaml").write_text(
        'stages:\n  - {name: stage1, path: "^/stage1$"}\n  - {name: stage2, path: "^/stage2$"}\n'
        f"limits: {{max_inflight: 16, queue_cap: 5000, queue_timeout: 60}}\nclassifier: {{mode: explicit, time_unit: {unit}}}\n")
    port = free_port()
    admin, admin_flags, _ = sidecar_admin(parent / "admin-token")
    logf = parent / "sidecar.log"
    cmd = [sys.executable, "-m", "overtake.api.cli", "sidecar", "--policy", "pi(1)", "--apache", inst.base_url,
           "--listen", f"127.0.0.1:{port}", "--stages", str(parent / "stages.yaml"), *admin_flags, "--online",
           "--refit-interval", "5", "--min-samples", "200", "--arrival-window", "10", "--access-log", str(inst.access_log)]
    with logf.open("wb") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_sidecar(port, proc, logf)
        rng = np.random.default_rng(5)
        lam = LOAD / (2 * MEAN) / unit
        phases = rng.random((transactions, 2)) < PROBS[1]
        demands = rng.exponential(np.where(phases, MEANS[1], MEANS[0])) * unit
        gaps = rng.exponential(1 / lam, transactions)
        codes: list[int] = []

        def tx(i: int) -> None:
            for s in (0, 1):
                codes.append(get(port, f"/stage{s + 1}?work={demands[i, s]:.6f}",
                                  {"X-Overtake-Phase": str(int(phases[i, s]) + 1)})[0])

        threads = []
        t0 = time.monotonic()
        for i in range(transactions):
            time.sleep(max(0.0, t0 + gaps[: i + 1].sum() - time.monotonic()))
            th = threading.Thread(target=tx, args=(i,))
            th.start()
            threads.append(th)
            if i == transactions // 2:  # mid-stream: λ over the window is steady here
                mid = get(admin, "/metrics")[1].decode()
        for th in threads:
            th.join(120)
        # wait for a completed refit decision (the next interval after enough samples)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            info = json.loads(get(admin, "/-/policy")[1])
            r = info["online"]["refits"]
            if r["swapped"] + r["kept"] + r["failed"] + r["skipped_load"]:
                break
            time.sleep(0.5)
        text = get(admin, "/metrics")[1].decode()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        apache.stop(inst.workdir, graceful=False)
    log_lines = [json.loads(x) for x in logf.read_text().splitlines() if x.startswith("{")]
    shutil.rmtree(parent, ignore_errors=True)

    def g(t: str, name: str, **lab: str) -> float | None:
        want = ",".join(f'{k}="{v}"' for k, v in sorted(lab.items()))
        m = re.search("^" + re.escape(f"{name}{{{want}}}" if lab else name) + r" (\S+)", t, re.M)
        return float(m.group(1)) if m else None

    rows = []
    raw: dict[str, Any] = {"codes_200": codes.count(200), "requests": len(codes), "policy": info}
    for s, name in enumerate(("stage1", "stage2")):
        sent = float(demands[:, s].mean())
        cpu = g(text, "overtake_online_demand_mean_seconds", stage=name, source="access_log") or float("nan")
        att = g(text, "overtake_online_demand_mean_seconds", stage=name, source="attained") or float("nan")
        rows.append(f"| {name} | {sent * 1e3:.3f} | {cpu * 1e3:.3f} "
                    f"({(cpu - sent) / sent:+.1%}) | {att * 1e3:.3f} ({(att - sent) / sent:+.1%}) |")
        raw[name] = {"sent": sent, "access_log": cpu, "attained": att}
    lam_mid = g(mid, "overtake_online_arrival_rate_per_second")
    refits = [x for x in log_lines if x.get("event") == "online_refit"]
    done = [x for x in refits if x.get("outcome") in ("swapped", "kept", "failed", "skipped_load")]
    first = done[0]["refit"] if done else {}
    raw.update(lam_sent=lam, lam_mid=lam_mid, refits=[x.get("outcome") for x in refits], first=first)
    out = (
        f"Real sidecar + Apache (pinned to CPU {cores[-1] if len(cores) > 1 else 'any'}): π(1) at start, {transactions} "
        f"case-4 transactions (time unit 5 ms, load {LOAD}, λ = {lam:.1f}/s), phase header sent; "
        f"`{' '.join(cmd[3:]).replace(str(parent), 'DIR').replace(inst.base_url, 'APACHE')}`. "
        f"{codes.count(200)}/{len(codes)} answered 200.\n\n"
        "| stage | mean demand sent ms | Apache CPU notes (access_log) ms | attained service under sharing ms |\n"
        "|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        f"λ estimate mid-stream {lam_mid:.1f}/s (sent {lam:.1f}/s). Refit decisions in order: "
        f"{', '.join(x.get('outcome', '?') for x in refits)}. First refit: "
        + (
            f"outcome {done[0]['outcome']}, sources {first.get('source')}, load {first.get('load', float('nan')):.3f}, "
            f"predicted E[W] π(1) {first.get('predicted_current', float('nan')):.3f} → π* {first.get('predicted_new', float('nan')):.3f} "
            f"model units, {first.get('seconds', float('nan')):.2f} s wall (worker {json.dumps({k: round(v, 2) for k, v in first.get('worker_seconds', {}).items()})})."
            if done
            else "none completed."
        )
        + "\n"
    )
    return out, raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--parts", default="fit,apache")
    ap.add_argument("--transactions", type=int, default=600)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="overtake-online-bench-"))
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    head = (f"## Sidecar online loop (controller/online.py): refit cost and estimator accuracy\n\n"
            f"Date {date}, commit {commit}; machine: {machine()} — other helpers' jobs share the machine, so "
            f"seconds are upper bounds. Command: `OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/online_refit.py "
            f"--seeds {args.seeds} --parts {args.parts} --transactions {args.transactions}`.\n\n")
    body = head
    raw: dict[str, Any] = {}
    if "fit" in parts:
        t, raw["fit"] = part_fit(args.seeds, tmp)
        body += "### One refit on case-4 data (in-process)\n\n" + t + "\n"
    if "apache" in parts:
        t, raw["apache"] = part_apache(args.transactions)
        body += "### Demand estimators on a real Apache\n\n" + t
    shutil.rmtree(tmp, ignore_errors=True)
    write_section("online", body)
    print(body)
    print(json.dumps(raw, default=str)[:4000])


if __name__ == "__main__":
    main()
