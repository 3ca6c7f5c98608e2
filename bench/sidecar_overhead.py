"""Sidecar overhead: wrk on a tiny static file, direct to Apache, through `overtake sidecar` in
passthrough (π(∞)), and through HAProxy with per-server maxconn — in one run.

    python bench/sidecar_overhead.py [--duration 10] [--connections 32] [--repeat 3] [--json]

Apache (private instance, controller.harness.apache) is pinned to the last core with raised autogroup
priority; wrk, the sidecar and HAProxy share core 0 (the machine has 2 cores). Two loads:
``-c 1`` (one request at a time: the latency a proxy adds) and ``-c N`` (throughput). Targets:
added p50 <= 0.5 ms over direct, sidecar throughput >= 25 % of HAProxy's. Medians
over --repeat interleaved rounds. Writes the `sidecar` section of bench/results/sections.md unless
--no-write.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from _report import write_section
from _wrk import wrk

from overtake.controller.harness import apache
from overtake.controller.harness.scratch import free_port, scratch_dir

REPO = Path(__file__).resolve().parents[1]

STAGES = """stages:
  - name: stage1
    path: "^/stage1$"
  - name: stage2
    path: "^/stage2$"
limits: {max_inflight: 64}
"""


def _wait_http(url: str, proc: subprocess.Popen[bytes] | None, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
            raise SystemExit(f"sidecar_overhead: {url} did not come up")
        time.sleep(0.1)


def raise_own_autogroup(nice: int = -20) -> bool:
    """Lift this process's scheduler autogroup (and so the sidecar, HAProxy and wrk it starts) to
    ``nice`` — the same treatment controller.harness.apache gives Apache; other jobs on a shared
    machine sit in other autogroups, and ``nice`` only ranks threads inside one autogroup."""
    try:
        Path("/proc/self/autogroup").write_text(str(nice))
        return True
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run")
    ap.add_argument("--connections", type=int, default=32, help="connections for the throughput runs")
    ap.add_argument("--maxconn", type=int, default=32, help="HAProxy per-server maxconn")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds; medians reported")
    ap.add_argument("--no-raise-priority", dest="raise_priority", action="store_false",
                    help="leave every process at the default scheduler priority (Apache included); "
                    "writes section sidecar-default-priority")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--no-write", action="store_true", help="write nothing")
    args = ap.parse_args()
    for tool in ("wrk", "haproxy", "taskset"):
        if shutil.which(tool) is None:
            raise SystemExit(f"sidecar_overhead: {tool} not found; run apache-conf/install-debian-packages.sh")
    lifted = raise_own_autogroup() if args.raise_priority else False
    cores = sorted(os.sched_getaffinity(0))
    server_core, client_core = cores[-1], cores[0]
    tmp = scratch_dir("overtake-overhead-")
    procs: list[subprocess.Popen[bytes]] = []
    inst = None
    try:
        inst = apache.start(tmp / "apache", f"127.0.0.1:{free_port()}", cpu=server_core, max_workers=64,
                            raise_priority=args.raise_priority)
        ap_host, ap_port = apache.parse_listen(inst.listen)
        sc_port, hp_port = free_port(), free_port()
        (tmp / "stages.yaml").write_text(STAGES)
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        with (tmp / "sidecar.log").open("wb") as log:
            procs.append(
                subprocess.Popen(
                    [
                        "taskset",
                        "-c",
                        str(client_core),
                        sys.executable,
                        "-m",
                        "overtake.api.cli",
                        "sidecar",
                        "--policy",
                        "passthrough",
                        "--apache",
                        inst.base_url,
                        "--listen",
                        f"127.0.0.1:{sc_port}",
                        "--stages",
                        str(tmp / "stages.yaml"),
                        "--admin-listen",
                        f"127.0.0.1:{free_port()}",
                    ],
                    cwd=REPO,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            )
        cfg = (REPO / "apache-conf" / "haproxy.cfg.in").read_text()
        cfg = cfg.replace("@LISTEN@", f"127.0.0.1:{hp_port}").replace("@APACHE@", f"{ap_host}:{ap_port}")
        cfg = cfg.replace("@MAXCONN@", str(args.maxconn))
        (tmp / "haproxy.cfg").write_text(cfg)
        with (tmp / "haproxy.log").open("wb") as log:
            procs.append(subprocess.Popen(
                ["taskset", "-c", str(client_core), "haproxy", "-db", "-f", str(tmp / "haproxy.cfg")],
                stdout=log, stderr=subprocess.STDOUT,
            ))
        path = "/static/hello.txt"
        targets = {
            "direct": f"{inst.base_url}{path}",
            "sidecar": f"http://127.0.0.1:{sc_port}{path}",
            "haproxy": f"http://127.0.0.1:{hp_port}{path}",
        }
        _wait_http(targets["sidecar"], procs[0])
        _wait_http(targets["haproxy"], procs[1])
        for url in targets.values():  # warm-up: connections, Lua states, caches
            wrk(url, args.connections, 2, client_core)
        loads = {"c1": 1, f"c{args.connections}": args.connections}
        runs: dict[str, dict[str, list[dict[str, float]]]] = {ld: {t: [] for t in targets} for ld in loads}
        load_avg = []
        for _ in range(args.repeat):
            for ld, c in loads.items():
                for name, url in targets.items():
                    load_avg.append(os.getloadavg()[0])
                    runs[ld][name].append(wrk(url, c, args.duration, client_core))
        res = {
            ld: {t: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for t, rs in per.items()}
            for ld, per in runs.items()
        }
        c1, cn = res["c1"], res[f"c{args.connections}"]
        summary = {
            "added_p50_ms_c1": c1["sidecar"]["p50_ms"] - c1["direct"]["p50_ms"],
            "added_p50_ms_cN": cn["sidecar"]["p50_ms"] - cn["direct"]["p50_ms"],
            "sidecar_over_haproxy_rps_cN": cn["sidecar"]["rps"] / cn["haproxy"]["rps"],
            "haproxy_added_p50_ms_c1": c1["haproxy"]["p50_ms"] - c1["direct"]["p50_ms"],
            "load_average_1min_median": statistics.median(load_avg),
        }
        out = {"results": res, "summary": summary, "duration_s": args.duration, "repeat": args.repeat,
               "connections": args.connections, "maxconn": args.maxconn}
        if args.json:
            print(json.dumps(out, indent=2))
        lines = [
            "## sidecar: overhead of `overtake sidecar` (passthrough) vs direct Apache and HAProxy",
            "",
            f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} vCPU "
            f"({platform.processor() or platform.machine()}), shared with other jobs (1-min load average median "
            f"{summary['load_average_1min_median']:.1f} during the runs): treat as indicative.",
            f"Command: `python bench/sidecar_overhead.py --duration {args.duration:g} --connections {args.connections} "
            f"--maxconn {args.maxconn} --repeat {args.repeat}{'' if args.raise_priority else ' --no-raise-priority'}`. "
            f"GET /static/hello.txt (13 bytes); Apache pinned to core {server_core} "
            f"({'autogroup -20' if args.raise_priority else 'default priority'}), wrk -t1, sidecar (uvloop) and HAProxy "
            f"(nbthread 1, maxconn {args.maxconn}) on core {client_core}"
            f"{' (their autogroup raised to -20 like Apache)' if lifted else ''}; medians of {args.repeat} "
            f"interleaved {args.duration:g} s runs.",
            "",
            "| load | target | req/s | p50 ms | p99 ms | non-2xx |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for ld in loads:
            for t in targets:
                r = res[ld][t]
                lines.append(
                    f"| wrk -c{loads[ld]} | {t} | {r['rps']:.0f} | {r['p50_ms']:.3f} | {r['p99_ms']:.2f} | {r['non2xx']:.0f} |"
                )
        ok1 = summary["added_p50_ms_c1"] <= 0.5
        ok2 = summary["sidecar_over_haproxy_rps_cN"] >= 0.25
        lines += [
            "",
            f"- Added p50, one request at a time (-c1): {summary['added_p50_ms_c1']:.3f} ms "
            f"(target <= 0.5 ms: {'met' if ok1 else 'NOT met'}); HAProxy adds {summary['haproxy_added_p50_ms_c1']:.3f} ms.",
            f"- Added p50 at -c{args.connections}: {summary['added_p50_ms_cN']:.3f} ms (queueing at the proxy's saturation).",
            f"- Sidecar throughput / HAProxy throughput at -c{args.connections}: "
            f"{100 * summary['sidecar_over_haproxy_rps_cN']:.0f} % (target >= 25 %: {'met' if ok2 else 'NOT met'}).",
        ]
        if not args.no_write:
            write_section("sidecar" if args.raise_priority else "sidecar-default-priority", "\n".join(lines))
        print("\n".join(lines))
        return 0
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if inst is not None:
            apache.stop(inst.workdir, graceful=False)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
