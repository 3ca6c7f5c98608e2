"""One sidecar, both schedulers: the thread policy on CPU stages and uplink SRPT on static files.

    python bench/paired.py --case 4 --load 0.8 --duration 90 [--json] [--no-write]

Pairing with the thread policy. The uplink testbed (bench/uplink/testbed.py: two
namespaces, the server side's egress shaped by HTB to --rate) runs a private Apache (pinned to the
last core, autogroup -20) behind ONE `overtake sidecar --policy P --uplink U` (on core 0). Two
open-loop clients in the client namespace run at the same time:

- CPU-stage transactions of Table 1 case ``--case`` (bench/apache_table2.py's trace: Poisson
  arrivals, PH demands, start phase in X-Overtake-Phase; one model time unit = --time-unit s of
  Apache thread CPU), replayed by bench/uplink/txclient.py;
- static downloads, World Cup 98 sizes at uplink load ``--load`` (bench/uplink/client.py).

The same two traces are replayed under the 2 x 2 combinations P in {pi*, passthrough = pi(inf)}
x U in {srpt, fair}. Each scheduler is compared with its own baseline: the thread policy's gain
(E W(pi(inf)) - E W(pi*)) / E W(pi*) on the transactions, with U held fixed, against the model's
prediction; SRPT's mean response time and largest-1 % time on the static files over FAIR's, with
P held fixed. Per-band bytes, responses and SO_PRIORITY changes come from the sidecar's /metrics.
Writes the bench/results/sections.md section ``paired`` unless --no-write. Needs root.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _report import halt_polling, machine, write_section
from apache_table2 import STAGES, policy_file, predicted
from uplink.testbed import Testbed
from uplink.workload import MODELS, schedule
from uplink_srpt import (
    ADMIN_PORT,
    CAL_SIZES,
    NOMINAL_GOODPUT,
    calibrate_solo,
    response_metrics,
    start_sidecar,
    stop_process,
    write_files,
)

from overtake.api.scenario import load_scenario
from overtake.controller.harness.loadgen import batch_means, make_trace, paired_gain_ci
from overtake.controller.uplink.qdisc import parse_rate
from overtake.mdp import Policy

ROOT = Path(__file__).resolve().parents[1]

PY = sys.executable
OVERTAKE = str(Path(sys.executable).with_name("overtake"))
APACHE_PORT = 18081  # inside the server namespace: bench/uplink_srpt.py's port (its calibrate_solo uses it)
PORT = 8080
UPLINK_SERIES = ("overtake_uplink_bytes_total", "overtake_uplink_flows_total",
                 "overtake_uplink_priority_changes_total", "overtake_follow_up_gap_seconds_count",
                 "overtake_follow_up_gap_seconds_sum", "overtake_stage_completed_total",
                 "overtake_stage_rejected_total")


def _side(tb: Testbed, policy: str, uplink: str, stages: Path, log: Path, core: int) -> subprocess.Popen[str]:
    try:
        return start_sidecar(tb, uplink, log, policy=policy, stages=stages, core=core)
    except RuntimeError as exc:
        raise SystemExit(f"paired: {exc}") from None


def _in_client(tb: Testbed, *args: str) -> list[str]:
    return [*tb.exec_prefix(tb.cli_ns), PY, *args]


def _scrape(tb: Testbed) -> dict[str, float]:
    """The sidecar's uplink series (summed over bands where labelled) plus per-band bytes."""
    code = ("import sys, urllib.request; "
            "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())")
    text = subprocess.run(_in_client(tb, "-c", code, f"http://{tb.srv_ip}:{ADMIN_PORT}/metrics"),
                          capture_output=True, text=True, check=True).stdout
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in UPLINK_SERIES:
            key = name if "{" not in line else f"{name}{{{line.split('{', 1)[1].split('}', 1)[0]}}}"
            out[key] = float(line.rsplit(" ", 1)[1])
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    _, model = load_scenario(ROOT / "examples" / "table1" / f"case{args.case:02d}.yaml")
    pfile = policy_file(args.case, Path(args.policy_dir))
    pred = predicted(model, Policy.load(pfile))
    n_tx = int(model.arrival_rate * args.duration / args.time_unit)
    trace = make_trace(model, n_tx, args.seed + args.case)
    cores = sorted(os.sched_getaffinity(0))
    server_core, client_core = cores[-1], cores[0]
    tb = Testbed.up(rate=args.rate, mode="htb")
    work = Path(tempfile.mkdtemp(prefix="ovt_paired_"))
    work.chmod(0o755)
    out: dict[str, Any] = {"runs": {}}
    try:
        subprocess.run([*tb.exec_prefix(tb.srv_ns), OVERTAKE, "apache", "start", "--workdir", str(work / "apache"),
                        "--listen", f"127.0.0.1:{APACHE_PORT}", "--cpu", str(server_core), "--max-workers", "160"],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        stages = work / "stages.yaml"
        # Table 2's stages (stage1 -> next: stage2) plus a cap on the static (passthrough) lane
        text = STAGES.format(cap=120, mode="explicit", unit=args.time_unit, follow_up=args.follow_up_timeout)
        stages.write_text(text + "passthrough: {cap: 48}\n")
        (work / "trace.json").write_text(json.dumps({k: v.tolist() for k, v in trace.items()}))
        # solo time of the link (FAIR, passthrough) for slowdowns and the static schedule's rate
        cal = argparse.Namespace(server="sidecar", rate=args.rate, prefix="/f/")
        write_files(work / "apache", set(CAL_SIZES))
        solo = calibrate_solo(tb, work, cal)
        # the static load against the link's nominal goodput (as bench/uplink_srpt.py)
        sched = schedule(MODELS["wc98"], load=args.load, duration=args.duration,
                         goodput_bps=parse_rate(args.rate) * NOMINAL_GOODPUT, seed=args.seed)
        write_files(work / "apache", {sz for _, sz in sched})
        (work / "sched.json").write_text(json.dumps(sched))
        # Apache's CPU per stage request beyond the burn, through a passthrough sidecar
        side = _side(tb, "passthrough", "fair", stages, work / "cal.log", client_core)
        try:
            overhead = float(subprocess.run(
                _in_client(tb, str(ROOT / "bench" / "uplink" / "txclient.py"), "--server", f"{tb.srv_ip}:{PORT}",
                           "--unit", str(args.time_unit), "--calibrate"),
                capture_output=True, text=True, check=True).stdout)
        finally:
            stop_process(side)
        out["setup"] = {"case": args.case, "transactions": n_tx, "static_requests": len(sched),
                        "time_unit": args.time_unit, "overhead_s": overhead, "solo": solo, "load": args.load,
                        "rate": args.rate, "follow_up_timeout": args.follow_up_timeout,
                        "predicted_mean_response_time": {k: v * args.time_unit for k, v in pred.items()},
                        "predicted_gain_pi_inf": (pred["pi(inf)"] - pred["pi*"]) / pred["pi*"]}
        rts: dict[str, np.ndarray] = {}
        for pol in ("pi*", "passthrough"):
            for up in ("srpt", "fair"):
                name = f"{pol}+{up}"
                side = _side(tb, str(pfile) if pol == "pi*" else pol, up, stages, work / f"{pol}_{up}.log",
                             client_core)
                try:
                    t0 = time.monotonic()
                    tx = subprocess.Popen(_in_client(
                        tb, str(ROOT / "bench" / "uplink" / "txclient.py"), "--server", f"{tb.srv_ip}:{PORT}",
                        "--trace", str(work / "trace.json"), "--unit", str(args.time_unit),
                        "--overhead", str(overhead), "--out", str(work / "tx.json")))
                    st = subprocess.Popen(_in_client(
                        tb, str(ROOT / "bench" / "uplink" / "client.py"), "--server", f"{tb.srv_ip}:{PORT}",
                        "--schedule", str(work / "sched.json"), "--out", str(work / "static.json"),
                        "--timeout", "300", "--prefix", "/f/"))
                    if tx.wait() != 0 or st.wait() != 0:
                        raise SystemExit(f"paired: a client failed in run {name}")
                    bands = _scrape(tb)
                finally:
                    stop_process(side)
                txr = json.loads((work / "tx.json").read_text())
                rt = np.array([np.nan if x is None else x for x in txr["response_times"]])
                rts[name] = rt
                mean, ci = batch_means(rt)
                static = response_metrics(json.loads((work / "static.json").read_text()), solo)
                out["runs"][name] = {"stages": {"mean_response_time": mean, "ci95": ci, "failures": txr["failures"]},
                                     "static": static, "uplink_metrics": bands, "wall_s": time.monotonic() - t0}
                print(f"  {name}: stages E[W] {mean * 1e3:.1f} ± {ci * 1e3:.1f} ms; static mean "
                      f"{static['mean_response_time'] * 1e3:.1f} ms, largest 1% "
                      f"{static['largest_1pct_mean_response_time']:.3f} s, "
                      f"{static['throughput_bytes_per_s'] * 8 / 1e6:.2f} Mbit/s", file=sys.stderr, flush=True)
                time.sleep(1.0)
        def w(name: str) -> float:
            return float(out["runs"][name]["stages"]["mean_response_time"])

        out["thread_gain"] = {
            up: {"measured": (w(f"passthrough+{up}") - w(f"pi*+{up}")) / w(f"pi*+{up}"),
                 "ci95": paired_gain_ci(rts[f"pi*+{up}"], rts[f"passthrough+{up}"])}
            for up in ("srpt", "fair")}
        out["uplink_ratio"] = {
            pol: {k: out["runs"][f"{pol}+srpt"]["static"][k] / out["runs"][f"{pol}+fair"]["static"][k]
                  for k in ("mean_response_time", "mean_slowdown", "largest_1pct_mean_response_time",
                            "throughput_bytes_per_s")}
            for pol in ("pi*", "passthrough")}
    finally:
        subprocess.run([*tb.exec_prefix(tb.srv_ns), OVERTAKE, "apache", "stop", "--workdir", str(work / "apache"),
                        "--now"], capture_output=True)  # fmt: skip
        tb.down()
    return out


def _band(series: str) -> str:
    """``overtake_uplink_bytes_total{band="3"}`` -> ``3``."""
    return series.split('band="', 1)[1].split('"', 1)[0]


def _follow(m: dict[str, float]) -> str:
    """`next` reservations: claimed in time (mean client round trip) / lapsed unused or while queued."""
    n = sum(v for k, v in m.items() if k.startswith("overtake_follow_up_gap_seconds_count"))
    gap = sum(v for k, v in m.items() if k.startswith("overtake_follow_up_gap_seconds_sum"))
    lapsed = sum(v for k, v in m.items() if ('outcome="unused"' in k or 'reason="follow_up_missing"' in k))
    return f"{n:.0f} ({1e3 * gap / n:.2f}) / {lapsed:.0f}" if n else f"0 / {lapsed:.0f}"


def render(out: dict[str, Any], command: str, started: float, hp: int | None, section: str = "paired") -> str:
    s = out["setup"]
    lines = [
        f"## {section}: thread policy and uplink SRPT in one sidecar",
        "",
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; {machine()} at the end; "
        f"guest halt polling {'off' if not hp else f'{hp / 1e6:g} ms'}; {time.time() - started:.0f} s.",
        f"Command: `{command}`. Uplink testbed at {s['rate']} (HTB, TSO/GSO off); Apache pinned to the last core "
        f"(autogroup -20), one `overtake sidecar` on core 0 in the server namespace; two open-loop clients at once: "
        f"{s['transactions']} CPU-stage transactions of Table 1 case {s['case']} (1 unit = {s['time_unit'] * 1e3:g} ms "
        f"of Apache CPU, {s['overhead_s'] * 1e3:.2f} ms per-request overhead subtracted) and {s['static_requests']} "
        f"World Cup 98 static downloads at uplink load {s['load']}. Same two traces in all four runs. "
        f"`next` reservations lapse after {s.get('follow_up_timeout', 0.05) * 1e3:g} ms (limits.follow_up_timeout).",
        "",
        "| thread policy + uplink | stages E[W] ms | static mean RT ms | static mean slowdown | static largest 1 % s "
        "| static Mbit/s | uplink bytes by band | SO_PRIORITY changes | follow-ups in time (mean gap ms) / lapsed |",
        "|---|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for name, r in out["runs"].items():
        st, m = r["static"], r["uplink_metrics"]
        by_band = ", ".join(f"{_band(k)}: {v / 1e6:.1f} MB"
                            for k, v in sorted(m.items()) if k.startswith("overtake_uplink_bytes_total{") and v > 0)
        lines.append(
            f"| {name} | {r['stages']['mean_response_time'] * 1e3:.1f} ± {r['stages']['ci95'] * 1e3:.1f} "
            f"| {st['mean_response_time'] * 1e3:.1f} | {st['mean_slowdown']:.1f} "
            f"| {st['largest_1pct_mean_response_time']:.3f} | {st['throughput_bytes_per_s'] * 8 / 1e6:.2f} "
            f"| {by_band or '-'} | {m.get('overtake_uplink_priority_changes_total', 0):.0f} | {_follow(m)} |")
    lines.append("")
    for up, g in out["thread_gain"].items():
        lines.append(f"- Thread policy vs its baseline (uplink {up}): pi* gains {100 * g['measured']:.1f} ± "
                     f"{100 * g['ci95']:.1f} % over pi(inf) (model {100 * s['predicted_gain_pi_inf']:.1f} %).")
    for pol, r in out["uplink_ratio"].items():
        lines.append(f"- Uplink vs its baseline (thread policy {pol}): SRPT / FAIR mean RT {r['mean_response_time']:.2f}, "
                     f"slowdown {r['mean_slowdown']:.2f}, largest 1 % {r['largest_1pct_mean_response_time']:.2f}, "
                     f"throughput {r['throughput_bytes_per_s']:.3f}.")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", type=int, default=4, help="Table 1 case of the CPU stages (1..12)")
    ap.add_argument("--load", type=float, default=0.8, help="uplink load of the static downloads")
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of arrivals per run")
    ap.add_argument("--time-unit", type=float, default=0.01)
    ap.add_argument("--rate", default="10mbit")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--policy-dir", default="/tmp/overtake-table2-policies")
    ap.add_argument("--halt-poll-us", type=float, default=20000)
    ap.add_argument("--follow-up-timeout", type=float, default=0.005,
                    help="limits.follow_up_timeout s: how long a `next` reservation holds its place")
    ap.add_argument("--section", default="paired", help="section of bench/results/sections.md to (re)write")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if not 1 <= args.case <= 12:
        raise SystemExit(f"paired: --case: a Table 1 case 1..12, got {args.case}")
    if not 0 < args.load < 1:
        raise SystemExit(f"paired: --load: uplink load in (0, 1), got {args.load}")
    if not 0 < args.follow_up_timeout <= 10:
        raise SystemExit(f"paired: --follow-up-timeout: seconds in (0, 10], got {args.follow_up_timeout}")
    if os.geteuid() != 0:
        raise SystemExit("paired: needs root (network namespaces, qdiscs, SO_PRIORITY); run as root")
    Path(args.policy_dir).mkdir(parents=True, exist_ok=True)
    try:
        Path("/proc/self/autogroup").write_text("-20")
    except OSError:
        pass
    command = "python bench/paired.py " + " ".join(sys.argv[1:])
    started = time.time()
    with halt_polling(int(args.halt_poll_us * 1000)) as hp:
        out = run(args)
    text = render(out, command, started, hp, args.section)
    if args.json:
        print(json.dumps(out, indent=2, default=float))
    if not args.no_write:
        write_section(args.section, text)
    print(text, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
