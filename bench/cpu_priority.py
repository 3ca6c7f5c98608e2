"""CPU priority lever (issue 20, item 1): effective weights on this kernel and mod_overtake_prio's overhead.

    python bench/cpu_priority.py [--weight-seconds 8] [--repeat 3] [--rounds 10] [--duration 3] [--connections 16]
                                 [--perf] [--json] [--no-write]

1. Weights, two methods, each with two CPU-bound tasks on one core (``taskset``), in one
   scheduler autogroup raised to -20 (other jobs on the machine sit in other autogroups):
   a. ``tasks``: two forked busy loops, one at nice 0 and one at the candidate low level
      (nice 10, nice 19, SCHED_IDLE); their on-CPU time over a window
      (``/proc/<pid>/schedstat``) gives each one's share. Kernel weights: nice 0 = 1024,
      nice 10 = 110, nice 19 = 15, SCHED_IDLE = 3 (``sched_prio_to_weight``, WEIGHT_IDLEPRIO).
   b. ``apache``: the private Apache pinned to one core with mod_overtake_prio in class-only
      mode; a long request is started in class 1 (the candidate level), then a short one in
      class 0; the short one's sojourn ``%D``, over the same request's ``%D`` alone, is its
      slowdown, predicted 1 + w_low / w_0 when both run throughout.
2. Overhead: wrk (``-t1``, pinned to the other core) on a 13-byte static file, Apache with
   the module (default settings: levels 5 ms / 50 ms, nice +10 / SCHED_IDLE, 1 ms monitor),
   the same Apache without it, and a second one without it (A/A control: the method's own
   noise), in ``--rounds`` rounds (instances not measured are SIGSTOPped); ratio on/off of the
   median requests/s (target >= 0.98) and the median of the per-round ratios; and Apache's
   CPU time per request
   (all threads of the child, ``schedstat``), which a load generator starved by other jobs
   does not distort. Also the monitor thread's own CPU, idle and as a share of Apache's CPU
   under load, and its worst wake-up delay; with ``--perf``, the share of Apache's CPU
   samples (``perf record -e cpu-clock``) in the module's code and in the kernel side of its
   one system call per request (the thread CPU clock).

Appends the raw run to ``bench/results/cpu_priority.jsonl`` unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import http.client
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from _report import append_run
from _wrk import wrk

from overtake.controller.harness import apache
from overtake.controller.harness.apache.cpu_priority import (
    CpuPriority,
    fetch_prio_status,
)
from overtake.controller.harness.apache.lifecycle import children
from overtake.controller.harness.scratch import free_port, scratch_dir

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "cpu_priority.jsonl"
#: Kernel load weights (kernel/sched/core.c sched_prio_to_weight; WEIGHT_IDLEPRIO = 3).
KERNEL_WEIGHT = {"nice0": 1024, "nice10": 110, "nice19": 15, "idle": 3}
CANDIDATES = ("nice10", "nice19", "idle")


def _raise_own_autogroup() -> bool:
    try:
        Path("/proc/self/autogroup").write_text("-20")
        return True
    except OSError:
        return False


def _apply_level(name: str) -> None:
    if name == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.setpriority(os.PRIO_PROCESS, 0, int(name.removeprefix("nice")))


def _burner(core: int, level: str) -> int:
    pid = os.fork()
    if pid == 0:  # child: pin, set the level, spin until killed
        try:
            os.sched_setaffinity(0, {core})
            os.setpriority(os.PRIO_PROCESS, 0, 0)
            if level != "nice0":
                _apply_level(level)
            x = 0
            while True:
                x += 1
        finally:
            os._exit(0)
    return pid


def _on_cpu_ns(pid: int) -> int:
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def weights_tasks(core: int, seconds: float, repeat: int) -> dict[str, Any]:
    """Method a: two busy tasks on ``core``, nice 0 against each candidate."""
    out: dict[str, Any] = {}
    for cand in CANDIDATES:
        runs = []
        for _ in range(repeat):
            hi, lo = _burner(core, "nice0"), _burner(core, cand)
            try:
                time.sleep(0.3)  # both placed and settled
                h0, l0, t0 = _on_cpu_ns(hi), _on_cpu_ns(lo), time.monotonic()
                time.sleep(seconds)
                h1, l1, t1 = _on_cpu_ns(hi), _on_cpu_ns(lo), time.monotonic()
            finally:
                for p in (hi, lo):
                    os.kill(p, 9)
                    os.waitpid(p, 0)
            dh, dl = (h1 - h0) / 1e9, (l1 - l0) / 1e9
            runs.append({"hi_cpu_s": dh, "lo_cpu_s": dl, "wall_s": t1 - t0,
                         "lo_share": dl / (dh + dl), "ratio": dh / dl if dl > 0 else float("inf")})
        w = KERNEL_WEIGHT
        out[cand] = {
            "runs": runs,
            "lo_share_median": statistics.median(r["lo_share"] for r in runs),
            "ratio_median": statistics.median(r["ratio"] for r in runs),
            "kernel_ratio": w["nice0"] / w[cand],
            "kernel_lo_share": w[cand] / (w["nice0"] + w[cand]),
            "both_share_of_core_median": statistics.median(
                (r["hi_cpu_s"] + r["lo_cpu_s"]) / r["wall_s"] for r in runs),
        }
    return out


def _get(host: str, port: int, path: str, headers: dict[str, str]) -> int:
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


def _logged(inst: apache.ApacheInstance, rid: str) -> apache.AccessRecord:
    """The access-log record of request ``rid`` (written just after the response)."""
    deadline = time.monotonic() + 10
    while True:
        for rec in apache.read_access_log(inst.workdir):
            if rec.request_id == rid:
                return rec
        if time.monotonic() > deadline:
            raise SystemExit(f"cpu_priority: request {rid} never reached {inst.access_log}")
        time.sleep(0.01)


def weights_apache(tmp: Path, core: int, repeat: int, long_s: float = 0.6, short_s: float = 0.2) -> dict[str, Any]:
    """Method b: a class-0 request's slowdown next to a class-1 request, per candidate level."""
    out: dict[str, Any] = {}
    for cand in CANDIDATES:
        nice: tuple[int | str, ...] = ("idle",) if cand == "idle" else (int(cand.removeprefix("nice")),)
        cp = CpuPriority(levels=(1.0,), nice=nice, age=False)
        inst = apache.start(tmp / f"w-{cand}", f"127.0.0.1:{free_port()}", cpu=core, max_workers=8,
                            cpu_priority=cp)
        host, port = apache.parse_listen(inst.listen)
        slowdowns, alone = [], []
        try:
            for _ in range(max(repeat, 5)):
                rid = uuid.uuid4().hex  # calibration: the short request alone
                assert _get(host, port, f"/stage1?work={short_s}",
                            {"X-Overtake-Class": "0", "X-Request-Id": rid}) == 200
                rec = _logged(inst, rid)
                alone.append(rec.duration_us / 1e6 / short_s)
                rid = uuid.uuid4().hex
                t = threading.Thread(target=_get, args=(host, port, f"/stage1?work={long_s}",
                                                        {"X-Overtake-Class": "1"}))
                t.start()
                time.sleep(0.03)  # the long one is running (and demoted) before the short one
                assert _get(host, port, f"/stage1?work={short_s}",
                            {"X-Overtake-Class": "0", "X-Request-Id": rid}) == 200
                t.join()
                rec = _logged(inst, rid)
                slowdowns.append(rec.duration_us / 1e6 / short_s)
        finally:
            apache.stop(inst.workdir, graceful=False)
        w = KERNEL_WEIGHT
        med = statistics.median(s / a for s, a in zip(slowdowns, alone))
        out[cand] = {"slowdowns": slowdowns, "alone": alone, "slowdown_over_alone_median": med,
                     "slowdown_median": statistics.median(slowdowns),
                     "kernel_slowdown": 1 + w[cand] / w["nice0"],
                     "implied_ratio": 1 / (med - 1) if med > 1 else float("inf")}
    return out


def _apache_cpu_ns(pid: int) -> int:
    """On-CPU nanoseconds of every thread of Apache's children (schedstat field 1)."""
    total = 0
    for kid in children(pid):
        for tid in os.listdir(f"/proc/{kid}/task"):
            try:
                total += int(Path(f"/proc/{kid}/task/{tid}/schedstat").read_text().split()[0])
            except (OSError, IndexError):
                continue
    return total


def _monitor_tid(child: int) -> int | None:
    for tid in os.listdir(f"/proc/{child}/task"):
        if Path(f"/proc/{child}/task/{tid}/comm").read_text().strip() == "overtake-prio":
            return int(tid)
    return None


def _signal_all(inst: apache.ApacheInstance, sig: int) -> None:
    for pid in (inst.pid, *children(inst.pid)):
        os.kill(pid, sig)


def _task_cpu_ns(pid: int, tid: int) -> int:
    return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])


#: Kernel functions of the one system call the module makes per request (thread CPU clock).
_CLOCK_SYMS = ("posix_cpu_clock_get", "task_sched_runtime", "__x64_sys_clock_gettime", "cpu_clock_sample")


def _perf_profile(inst: apache.ApacheInstance, url: str, connections: int, duration: float,
                  client_core: int, tmp: Path) -> dict[str, float]:
    """Share of Apache's CPU samples in the module's code and in its clock system call."""
    kid = children(inst.pid)[0]
    data = tmp / "perf.data"
    rec = subprocess.Popen(["taskset", "-c", str(client_core), "perf", "record", "-e", "cpu-clock", "-F", "20000",
                            "-p", str(kid), "-o", str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    wrk(url, connections, duration, client_core)
    rec.send_signal(2)
    rec.wait()
    rep = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,sym", "-g", "none",
                          "--percent-limit", "0"], capture_output=True, text=True, check=True).stdout
    module = clock = 0.0
    for line in rep.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[[.k]\]\s+(\S+)", line)
        if not m:
            continue
        pct, dso, sym = float(m.group(1)), m.group(2), m.group(3)
        if dso == "mod_overtake_prio.so":
            module += pct
        elif sym in _CLOCK_SYMS:
            clock += pct
    return {"module_code_pct": module, "clock_syscall_kernel_pct": clock}


def _monitor_timeliness(host: str, port: int, k: int = 4, work: float = 1.0) -> dict[str, float]:
    """Wake-up delays of the monitor while ``k`` CPU-bound requests share Apache's core.

    From the difference of the module's delay histogram before and after; the requests run
    at levels 0..2 (their demotions are part of the load the monitor must cut through).
    """
    def hist() -> tuple[dict[float, int], float]:
        st = fetch_prio_status(host, port)
        return dict(st.monitor_late_buckets), st.monitor_late_sum

    b0, s0 = hist()
    ts = [threading.Thread(target=_get, args=(host, port, f"/stage1?work={work}", {})) for _ in range(k)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    b1, s1 = hist()
    n = b1[float("inf")] - b0[float("inf")]
    return {
        "concurrent_requests": k, "work_s": work, "wakeups": n,
        "mean_ms": (s1 - s0) / n * 1e3 if n else float("nan"),
        **{f"le_{le * 1e3:g}ms": (b1[le] - b0[le]) / n for le in b1 if le != float("inf") and n},
    }


def overhead(tmp: Path, server_core: int, client_core: int, duration: float, connections: int,
             repeat: int, profile: bool) -> dict[str, Any]:
    """wrk on /static/hello.txt: Apache without the module (``off``), with it (``on``) and a
    second instance without it (``ctl``, an A/A control: its ratio to ``off`` shows the
    method's noise), in rounds of one short run each, the order rotating.

    All instances stay up; those not measured are stopped (SIGSTOP), so nothing of theirs
    (the monitor included) runs during another's run.
    """
    insts = {
        "off": apache.start(tmp / "o-off", f"127.0.0.1:{free_port()}", cpu=server_core, max_workers=64),
        "on": apache.start(tmp / "o-on", f"127.0.0.1:{free_port()}", cpu=server_core, max_workers=64,
                           cpu_priority=CpuPriority()),
        "ctl": apache.start(tmp / "o-ctl", f"127.0.0.1:{free_port()}", cpu=server_core, max_workers=64),
    }
    modes = list(insts)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    load_avg = []
    out: dict[str, Any] = {}
    try:
        urls = {m: f"{i.base_url}/static/hello.txt" for m, i in insts.items()}
        on_host, on_port = apache.parse_listen(insts["on"].listen)
        kid = fetch_prio_status(on_host, on_port).child_pid
        mon = _monitor_tid(kid)
        assert mon is not None, "no overtake-prio monitor thread"
        for m in ("off", "ctl"):
            _signal_all(insts[m], signal.SIGSTOP)
        c0, t0 = _task_cpu_ns(kid, mon), time.monotonic()
        time.sleep(2.0)
        out["monitor_idle_cpu_fraction"] = (_task_cpu_ns(kid, mon) - c0) / 1e9 / (time.monotonic() - t0)
        out["monitor_late_under_cpu_load"] = _monitor_timeliness(on_host, on_port)
        for m in ("off", "ctl"):
            _signal_all(insts[m], signal.SIGCONT)
        for m in insts:  # warm-up: worker threads, connections, caches
            wrk(urls[m], connections, 2, client_core)
        mon_busy = []
        for rnd in range(repeat):
            for mode in modes[rnd % 3:] + modes[: rnd % 3]:
                others = [m for m in modes if m != mode]
                for m in others:
                    _signal_all(insts[m], signal.SIGSTOP)
                try:
                    load_avg.append(os.getloadavg()[0])
                    cpu0 = _apache_cpu_ns(insts[mode].pid)
                    m0 = _task_cpu_ns(kid, mon) if mode == "on" else 0
                    r = wrk(urls[mode], connections, duration, client_core)
                    cpu = _apache_cpu_ns(insts[mode].pid) - cpu0
                    # Apache's CPU per request: insensitive to a starved client (the load
                    # generator shares its core with other jobs), unlike requests/s.
                    r["apache_cpu_us_per_request"] = cpu / 1e3 / r["requests"]
                    if mode == "on":
                        mon_busy.append((_task_cpu_ns(kid, mon) - m0) / cpu)
                    runs[mode].append(r)
                finally:
                    for m in others:
                        _signal_all(insts[m], signal.SIGCONT)
        if profile and shutil.which("perf"):
            for m in ("off", "ctl"):
                _signal_all(insts[m], signal.SIGSTOP)
            try:
                out["perf"] = _perf_profile(insts["on"], urls["on"], connections, duration, client_core, tmp)
            finally:
                for m in ("off", "ctl"):
                    _signal_all(insts[m], signal.SIGCONT)
        st = fetch_prio_status(on_host, on_port)
        out["monitor_share_of_apache_cpu_median"] = statistics.median(mon_busy)
        out["untracked"] = st.untracked
    finally:
        for i in insts.values():
            with contextlib.suppress(OSError):
                _signal_all(i, signal.SIGCONT)
            apache.stop(i.workdir, graceful=False)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    def per_round(a: str, key: str) -> list[float]:
        return [x[key] / y[key] for x, y in zip(runs[a], runs["off"])]

    def over_both(key: str) -> list[float]:
        """on / mean(off, ctl) per round: two module-less baselines in the same round."""
        return [x[key] / ((y[key] + z[key]) / 2) for x, y, z in zip(runs["on"], runs["off"], runs["ctl"])]

    ratios, cpu_ratios = per_round("on", "rps"), per_round("on", "apache_cpu_us_per_request")
    ctl, ctl_cpu = per_round("ctl", "rps"), per_round("ctl", "apache_cpu_us_per_request")
    return {
        **out, "runs": runs, "median": med,
        "rps_ratio_on_off": med["on"]["rps"] / med["off"]["rps"],
        "rps_ratio_per_round": ratios,
        "rps_ratio_per_round_median": statistics.median(ratios),
        "cpu_per_request_ratio_on_off": (med["on"]["apache_cpu_us_per_request"]
                                         / med["off"]["apache_cpu_us_per_request"]),
        "cpu_per_request_ratio_per_round": cpu_ratios,
        "cpu_per_request_ratio_per_round_median": statistics.median(cpu_ratios),
        "rps_ratio_over_both_baselines_median": statistics.median(over_both("rps")),
        "cpu_per_request_ratio_over_both_baselines_median": statistics.median(
            over_both("apache_cpu_us_per_request")),
        "control_rps_ratio_per_round": ctl,
        "control_rps_ratio_per_round_median": statistics.median(ctl),
        "control_cpu_per_request_ratio_per_round": ctl_cpu,
        "control_cpu_per_request_ratio_per_round_median": statistics.median(ctl_cpu),
        "load_average_1min_median": statistics.median(load_avg),
        "target_ratio_min": 0.98,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weight-seconds", type=float, default=8.0,
                    help="window of the two-task weight runs (SCHED_IDLE gets ~1 slice a second)")
    ap.add_argument("--repeat", type=int, default=3, help="repeats of each weight measurement")
    ap.add_argument("--rounds", type=int, default=12, help="wrk rounds (module off, on, A/A control)")
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per wrk run")
    ap.add_argument("--perf", action="store_true", help="also profile Apache with the module (perf record)")
    ap.add_argument("--connections", type=int, default=16, help="wrk connections")
    ap.add_argument("--skip-overhead", action="store_true", help="weights only")
    ap.add_argument("--json", action="store_true", help="print the raw results as JSON")
    ap.add_argument("--no-write", action="store_true", help=f"do not append to {RESULTS.relative_to(REPO)}")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("cpu_priority: needs root (Apache's workers run as www-data; autogroup -20)")
    for tool in ("wrk", "taskset", "apxs"):
        if shutil.which(tool) is None:
            raise SystemExit(f"cpu_priority: {tool} not found; run apache-conf/install-debian-packages.sh")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("cpu_priority: needs two cores (Apache on one, wrk and the bench on the other)")
    server_core, client_core = cores[-1], cores[0]
    lifted = _raise_own_autogroup()
    tmp = scratch_dir("overtake-cpu-prio-")
    t0 = time.time()
    try:
        res: dict[str, Any] = {
            "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
            "host": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
            "load_average_1min_start": os.getloadavg()[0], "own_autogroup_raised": lifted,
            "server_core": server_core, "client_core": client_core,
            "args": vars(args),
            "weights_tasks": weights_tasks(server_core, args.weight_seconds, args.repeat),
            "weights_apache": weights_apache(tmp, server_core, args.repeat),
        }
        if not args.skip_overhead:
            res["overhead"] = overhead(tmp, server_core, client_core, args.duration, args.connections,
                                       args.rounds, args.perf)
        res["elapsed_s"] = time.time() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = _finite(res)  # a ratio over an empty sample (e.g. no perf samples) is recorded as null
    if not args.no_write:
        append_run("cpu_priority", res)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(summary(res))
    return 0


def _finite(x: Any) -> Any:
    """``x`` with every non-finite float replaced by None (JSON has no NaN or infinity)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def summary(res: dict[str, Any]) -> str:
    lines = [f"{res['date_utc']} UTC, kernel {res['kernel']}, load {res['load_average_1min_start']:.1f}",
             ("| low level | kernel w0/w | tasks: measured w0/w | tasks: low share | "
              "apache: short-request slowdown, over alone (raw) | kernel slowdown |"),
             "|---|---:|---:|---:|---:|---:|"]
    for c in CANDIDATES:
        a, b = res["weights_tasks"][c], res["weights_apache"][c]
        lines.append(f"| {c} | {a['kernel_ratio']:.1f} | {a['ratio_median']:.1f} | {a['lo_share_median']:.4f} | "
                     f"{b['slowdown_over_alone_median']:.4f} ({b['slowdown_median']:.4f}) | "
                     f"{b['kernel_slowdown']:.4f} |")
    if "overhead" in res:
        o = res["overhead"]
        m = o["median"]
        late = o["monitor_late_under_cpu_load"]
        rounds = ", ".join(f"{r:.3f}" for r in o["rps_ratio_per_round"])
        lines.append("")
        lines.append(
            f"wrk -c{res['args']['connections']}, {res['args']['rounds']} paired rounds of "
            f"{res['args']['duration']:g} s (load average median {o['load_average_1min_median']:.1f}): "
            f"off {m['off']['rps']:.0f} req/s, on {m['on']['rps']:.0f} req/s: ratio of medians "
            f"{o['rps_ratio_on_off']:.4f}, median per-round ratio {o['rps_ratio_per_round_median']:.4f} "
            f"(rounds {rounds})"
        )
        lines.append(
            f"A/A control (a second instance without the module, same rounds): median per-round ratio "
            f"{o['control_rps_ratio_per_round_median']:.4f} req/s, "
            f"{o['control_cpu_per_request_ratio_per_round_median']:.4f} CPU/request; per-round req/s ratios "
            f"{min(o['control_rps_ratio_per_round']):.3f}..{max(o['control_rps_ratio_per_round']):.3f}"
        )
        lines.append(
            f"module against both module-less instances of each round (median per round): "
            f"req/s {o['rps_ratio_over_both_baselines_median']:.4f}, CPU/request "
            f"{o['cpu_per_request_ratio_over_both_baselines_median']:.4f}"
        )
        lines.append(
            f"Apache CPU per request: off {m['off']['apache_cpu_us_per_request']:.1f} us, on "
            f"{m['on']['apache_cpu_us_per_request']:.1f} us: ratio {o['cpu_per_request_ratio_on_off']:.4f} "
            f"(median per-round {o['cpu_per_request_ratio_per_round_median']:.4f})"
        )
        lines.append(
            f"monitor: idle {100 * o['monitor_idle_cpu_fraction']:.3f} % of a core; under wrk "
            f"{100 * o['monitor_share_of_apache_cpu_median']:.3f} % of Apache's CPU; wake-up delay with "
            f"{late['concurrent_requests']} CPU-bound requests: mean {late['mean_ms']:.3f} ms, "
            f"<= 1 ms {100 * late['le_1ms']:.1f} %, <= 2 ms {100 * late['le_2ms']:.1f} % of "
            f"{late['wakeups']} wake-ups"
        )
        if "perf" in o:
            lines.append(f"perf: module code {o['perf']['module_code_pct']:.2f} % of Apache's CPU samples, "
                         f"thread-clock syscall (kernel side) {o['perf']['clock_syscall_kernel_pct']:.2f} %")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
