"""CPU priority: effective weights on this kernel and mod_overtake_prio's overhead.

    python bench/cpu_priority.py [--weight-seconds 8] [--repeat 3] [--pairs 3] [--windows 6] [--duration 2]
                                 [--connections 16] [--perf] [--skip-weights] [--module-mode]
                                 [--extended-status on|off] [--json] [--no-write]

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
2. Overhead: Apache with the module (default settings: levels 5 ms / 50 ms, nice +10 /
   SCHED_IDLE, 1 ms monitor, 1 ms CPU-clock resolution) and the same Apache without it, side
   by side on one core, each under its own wrk (``-t1 -c16``, pinned to the other core) on a
   13-byte static file: Apache's CPU time per request (all threads of the child,
   ``schedstat``) on / off per window, averaged over ``--pairs`` independent instance pairs
   with a Student-t 95 % interval, and the same for A/A pairs (two instances without the
   module: the method's own error); requests per CPU-second is its inverse (target >= 0.98).
   Also the monitor thread's own CPU, idle and as a share of Apache's CPU under load, its
   worst wake-up delay, the module's CPU-clock reads per request, and with ``--perf`` the
   share of Apache's CPU samples (``perf record -e cpu-clock``) in the module's code and in
   the kernel side of its one system call (the thread CPU clock).
   ``--module-mode``: the module's instances run module mode as well: the static file is a stage
   (``OvertakeStagePrefix /static/ static``: a server-level prefix, no ``<Location>`` section
   for Apache to merge per request) and a count table is in force from a control file (π(k) with k twice the
   connections, so it never holds a request: every request still takes its ticket, a decision at
   its arrival and one at its end); the record adds the ratios of requests/s and of p99 side by
   side (the module-mode target: >= 0.98 and <= 1.10) and the stage's counters (requests
   counted, held: 0); and, each instance alone on the server core in windows alternated with the
   side-by-side ones, the ratios of p99, of requests/s and of CPU per request. Ratios of
   requests/s and of p99 are geometric means with a 95 % interval over the pairs
   (:func:`ratio_summaries`); side by side, a p99 is mostly the scheduler alternating between
   the two instances, so its per-window ratios spread widely and need the A/A control beside them.

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
import random
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
from scipy import stats

from overtake.controller.harness import apache
from overtake.controller.harness.apache.cpu_priority import (
    CpuPriority,
    fetch_prio_status,
)
from overtake.controller.harness.apache.lifecycle import children
from overtake.controller.harness.scratch import free_port, scratch_dir
from overtake.controller.sidecar.control_file import ControlFile
from overtake.controller.sidecar.count_table import from_policy
from overtake.controller.sidecar.policies import BaselinePolicy

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


def _wrk_pair(urls: dict[str, str], pids: dict[str, int], connections: int, duration: float,
              client_core: int) -> dict[str, dict[str, float]]:
    """wrk against two instances at once; each instance's requests/s, CPU and CPU per request."""
    out: dict[str, dict[str, float]] = {}
    cpu0 = {n: _apache_cpu_ns(pid) for n, pid in pids.items()}

    def load(n: str) -> None:
        out[n] = wrk(urls[n], connections, duration, client_core)

    ts = [threading.Thread(target=load, args=(n,)) for n in urls]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for n, r in out.items():
        cpu = _apache_cpu_ns(pids[n]) - cpu0[n]
        r["apache_cpu_us_per_request"] = cpu / 1e3 / r["requests"]
        r["apache_cpu_s"] = cpu / 1e9
    return out


def _alone_pair(insts: dict[str, apache.ApacheInstance], urls: dict[str, str], order: tuple[str, str],
                connections: int, duration: float, client_core: int) -> dict[str, dict[str, float]]:
    """wrk against each instance of a pair alone on the server core (every other instance
    stopped), one after the other in ``order``. Side by side, a request's tail is the scheduler
    alternating between the two instances on one core (the A/A control's per-window p99 ratios
    spread over a factor of 3); alone, the p99 is the instance's own, at the same closed-loop load.
    Apache's CPU per request too: alone, an instance keeps its caches warm, which side by side it
    never does, so the module's cost need not read the same in both."""
    out: dict[str, dict[str, float]] = {}
    for n in order:
        others = [m for m in insts if m != n]
        for m in others:
            _signal_all(insts[m], signal.SIGSTOP)
        try:
            cpu0 = _apache_cpu_ns(insts[n].pid)
            out[n] = wrk(urls[n], connections, duration, client_core)
            out[n]["apache_cpu_us_per_request"] = (_apache_cpu_ns(insts[n].pid) - cpu0) / 1e3 / out[n]["requests"]
        finally:
            for m in others:
                _signal_all(insts[m], signal.SIGCONT)
    return out


def _geo_ci95(xs: list[float]) -> tuple[float, float, float]:
    """Geometric mean of ratios and its Student-t 95 % interval (computed on the logs)."""
    m, h = _mean_ci95([math.log(x) for x in xs])
    return math.exp(m), math.exp(m - h), math.exp(m + h)


def ratio_summaries(runs: dict[str, list[dict[str, Any]]], keys: list[str]) -> dict[str, Any]:
    """Per-window ratios summarised as geometric means: over a pair's windows, then over the
    pairs (95 % interval on the logs), for the module's pairs (``on...``) and the A/A pairs
    (``ctl...``, keys prefixed ``control_``). A geometric mean of ratios is symmetric: exchanging
    the two sides inverts it. An arithmetic mean of ratios is not, and it grows with their
    spread: a p99's per-window ratios spread widely side by side, and their arithmetic mean
    read well above 1 for A/A pairs, two instances of the same server (BENCHMARKS.md).

    >>> runs = {"on0/off0": [{"r": 2.0}, {"r": 0.5}], "ctl0/off0": [{"r": 1.0}, {"r": 1.0}],
    ...         "on1/off1": [{"r": 4.0}, {"r": 1.0}], "ctl1/off1": [{"r": 1.0}, {"r": 1.0}]}
    >>> s = ratio_summaries(runs, ["r"])
    >>> s["r_pairs"], round(s["r"], 12), s["control_r"]
    ([1.0, 2.0], 1.414213562373, 1.0)
    """
    out: dict[str, Any] = {}
    for key in keys:
        for kind, tag in (("on", ""), ("ctl", "control_")):
            per_pair = [math.exp(statistics.fmean(math.log(x[key]) for x in rs))
                        for k, rs in runs.items() if k.startswith(kind)]
            g, lo, hi = _geo_ci95(per_pair)
            out |= {f"{tag}{key}_pairs": per_pair, f"{tag}{key}": g, f"{tag}{key}_ci95": [lo, hi]}
    return out


def _mean_ci95(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its Student-t 95 % interval (nan for fewer than 2)."""
    n = len(xs)
    m = statistics.fmean(xs)
    if n < 2:
        return m, float("nan")
    return m, float(stats.t.ppf(0.975, n - 1)) * statistics.stdev(xs) / math.sqrt(n)


#: --module-mode: the stage the static file belongs to (name, URL-path prefix)
MODULE_STAGE = ("static", "/static/")


def module_mode_priority(i: int) -> CpuPriority:
    """The module with the static file as a stage (a server-level prefix) and a control file
    (module mode)."""
    return CpuPriority(control_file=f"/dev/shm/overtake-overhead-{os.getpid()}-{i}", stage_prefixes=(MODULE_STAGE,))


def put_table(inst: apache.ApacheInstance, path: str, connections: int) -> dict[str, float]:
    """Write π(2 × connections)'s count table (it never holds a request at ``connections``) and
    wait until Apache's module has it in force; its stage counters then."""
    table = from_policy(BaselinePolicy(f"pi({2 * connections})", 1), (MODULE_STAGE[0],))
    assert table is not None
    cf = ControlFile(path)
    try:
        gen = cf.write(1, None, table.encode())
    finally:
        cf.close()
    deadline = time.monotonic() + 10
    while True:
        st = stage_counters(inst)
        if st.get("overtake_stage_table_generation") == gen and st.get(
                f'overtake_stage_table_in_force{{stage="{MODULE_STAGE[0]}"}}') == 1:
            return st
        if time.monotonic() > deadline:
            raise SystemExit(f"cpu_priority: the count table (generation {gen}) did not reach Apache: {st}")
        time.sleep(0.05)


def stage_counters(inst: apache.ApacheInstance) -> dict[str, float]:
    """The ``overtake_stage_*`` lines of the module's status page."""
    host, port = apache.parse_listen(inst.listen)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", "/overtake-prio-status")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(overtake_stage_\S+) (\S+)$", text, re.M)}


def overhead(tmp: Path, server_core: int, client_core: int, duration: float, connections: int,
             pairs: int, windows: int, profile: bool, module_mode: bool = False,
             extended_status: bool = True) -> dict[str, Any]:
    """Apache CPU per request with the module against the same Apache without it, measured
    side by side: the two instances of a pair run at the same time on one core, each under its
    own wrk, so the VM's and the other jobs' slow-downs of the moment hit both alike (measured
    one after the other, windows of a few seconds differ by more than the effect sought). Each window gives the ratio of CPU per request, on / off. An instance's memory
    layout is drawn at its start, so ``pairs`` independent pairs (``on_i``, ``off_i``) are
    averaged (Student-t interval over the pairs), and as many A/A pairs (``ctl_i``, ``off_i``:
    two instances without the module) show the method's own error. The instances of the other
    pairs are stopped (SIGSTOP) meanwhile. Requests per CPU-second is 1 / CPU per request:
    the throughput of an Apache whose core is the bottleneck. ``module_mode``: the module's
    instances also hold the static file's stage by a count table (:func:`put_table`).
    ``extended_status``: False turns mod_status's ExtendedStatus off in every instance alike.
    """
    insts: dict[str, apache.ApacheInstance] = {}
    out: dict[str, Any] = {}
    tables: dict[str, dict[str, float]] = {}
    try:
        for i in range(pairs):
            for kind in random.sample(("off", "on", "ctl"), 3):  # start order drawn: no order bias
                cp = (module_mode_priority(i) if module_mode else CpuPriority()) if kind == "on" else None
                insts[f"{kind}{i}"] = apache.start(
                    tmp / f"o-{kind}{i}", f"127.0.0.1:{free_port()}", cpu=server_core, max_workers=64,
                    cpu_priority=cp, extra_conf="" if extended_status else "ExtendedStatus Off")
                if module_mode and cp is not None and cp.control_file:
                    tables[f"{kind}{i}"] = put_table(insts[f"{kind}{i}"], cp.control_file, connections)
        urls = {n: f"{i.base_url}/static/hello.txt" for n, i in insts.items()}
        pids = {n: i.pid for n, i in insts.items()}
        on_host, on_port = apache.parse_listen(insts["on0"].listen)
        kid = fetch_prio_status(on_host, on_port).child_pid
        mon = _monitor_tid(kid)
        assert mon is not None, "no overtake-prio monitor thread"
        for n in insts:
            if n != "on0":
                _signal_all(insts[n], signal.SIGSTOP)
        c0, t0 = _task_cpu_ns(kid, mon), time.monotonic()
        time.sleep(2.0)
        out["monitor_idle_cpu_fraction"] = (_task_cpu_ns(kid, mon) - c0) / 1e9 / (time.monotonic() - t0)
        out["monitor_late_under_cpu_load"] = _monitor_timeliness(on_host, on_port)
        for n in insts:
            if n != "on0":
                _signal_all(insts[n], signal.SIGCONT)
        for n in insts:  # warm-up: worker threads, connections, caches
            wrk(urls[n], connections, 2, client_core)
        plan = [(f"on{i}", f"off{i}") for i in range(pairs)] + [(f"ctl{i}", f"off{i}") for i in range(pairs)]
        runs: dict[str, list[dict[str, Any]]] = {f"{a}/{b}": [] for a, b in plan}
        load_avg, mon_busy = [], []
        st0 = fetch_prio_status(on_host, on_port)
        for w in range(windows):
            for a, b in plan[w % len(plan):] + plan[: w % len(plan)]:
                others = [n for n in insts if n not in (a, b)]
                for n in others:
                    _signal_all(insts[n], signal.SIGSTOP)
                try:
                    load_avg.append(os.getloadavg()[0])
                    m0 = _task_cpu_ns(kid, mon)
                    r = _wrk_pair({a: urls[a], b: urls[b]}, {a: pids[a], b: pids[b]}, connections,
                                  duration, client_core)
                    if a == "on0":
                        mon_busy.append((_task_cpu_ns(kid, mon) - m0) / 1e9 / r[a]["apache_cpu_s"])
                finally:
                    for n in others:
                        _signal_all(insts[n], signal.SIGCONT)
                alone = _alone_pair(insts, urls, (a, b) if w % 2 == 0 else (b, a), connections, duration,
                                    client_core) if module_mode else {}
                runs[f"{a}/{b}"].append({
                    "cpu_per_request_ratio": r[a]["apache_cpu_us_per_request"] / r[b]["apache_cpu_us_per_request"],
                    "rps_ratio": r[a]["rps"] / r[b]["rps"],
                    "p99_ratio": r[a]["p99_ms"] / r[b]["p99_ms"],
                    "cpu_share_ratio": r[a]["apache_cpu_s"] / r[b]["apache_cpu_s"],
                    **({"p99_alone_ratio": alone[a]["p99_ms"] / alone[b]["p99_ms"],
                        "rps_alone_ratio": alone[a]["rps"] / alone[b]["rps"],
                        "cpu_alone_ratio": alone[a]["apache_cpu_us_per_request"] / alone[b]["apache_cpu_us_per_request"],
                        "alone": alone} if alone else {}),
                    a: r[a], b: r[b]})
        st1 = fetch_prio_status(on_host, on_port)
        out["clock_reads_per_request_on0"] = (st1.clock_reads - st0.clock_reads) / max(
            1, sum(st1.requests) - sum(st0.requests))
        if profile and shutil.which("perf"):
            for n in insts:
                if n != "on0":
                    _signal_all(insts[n], signal.SIGSTOP)
            try:
                out["perf"] = _perf_profile(insts["on0"], urls["on0"], connections, duration, client_core, tmp)
            finally:
                for n in insts:
                    if n != "on0":
                        _signal_all(insts[n], signal.SIGCONT)
        out["monitor_share_of_apache_cpu_median"] = statistics.median(mon_busy)
        out["untracked"] = fetch_prio_status(on_host, on_port).untracked
        if module_mode:
            out["module_mode"] = _table_counts(insts, tables)
    finally:
        for i in insts.values():
            with contextlib.suppress(OSError):
                _signal_all(i, signal.SIGCONT)
            apache.stop(i.workdir, graceful=False)
        for i in range(pairs):
            for suffix in ("", ".key"):
                Path(module_mode_priority(i).control_file + suffix).unlink(missing_ok=True)  # type: ignore[operator]

    def pair_means(kind: str, key: str) -> list[float]:
        return [statistics.fmean(x[key] for x in rs) for k, rs in runs.items() if k.startswith(kind)]

    on_cpu, ctl_cpu = pair_means("on", "cpu_per_request_ratio"), pair_means("ctl", "cpu_per_request_ratio")
    on_m, on_h = _mean_ci95(on_cpu)
    ctl_m, ctl_h = _mean_ci95(ctl_cpu)
    keys = ["rps_ratio", "p99_ratio"]
    if module_mode:
        keys += ["p99_alone_ratio", "rps_alone_ratio", "cpu_alone_ratio"]
    return {
        **out, "runs": runs, "pairs": pairs, "windows": windows,
        "cpu_per_request_ratio_pairs": on_cpu,
        "cpu_per_request_ratio": on_m, "cpu_per_request_ratio_ci95": on_h,
        "requests_per_cpu_second_ratio": 1.0 / on_m,
        "control_cpu_per_request_ratio_pairs": ctl_cpu,
        "control_cpu_per_request_ratio": ctl_m, "control_cpu_per_request_ratio_ci95": ctl_h,
        **ratio_summaries(runs, keys),
        "p99_ratio_arithmetic_mean": statistics.fmean(pair_means("on", "p99_ratio")),
        "control_p99_ratio_arithmetic_mean": statistics.fmean(pair_means("ctl", "p99_ratio")),
        "load_average_1min_median": statistics.median(load_avg),
        "target_ratio_min": 0.98,
    }


def _table_counts(insts: dict[str, apache.ApacheInstance], before: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Per module-mode instance: the static stage's requests counted and held during the runs, the
    futex wake-ups issued, and whether its table stayed in force."""
    name = MODULE_STAGE[0]
    out: dict[str, Any] = {}
    for n, b in before.items():
        st = stage_counters(insts[n])
        out[n] = {k: st[f'overtake_stage_{k}{{stage="{name}"}}'] - b[f'overtake_stage_{k}{{stage="{name}"}}']
                  for k in ("requests_total", "held_total", "hold_timeouts_total")}
        out[n]["table_in_force"] = st[f'overtake_stage_table_in_force{{stage="{name}"}}'] == 1
        # futex wake-ups (system calls) the decisions made: none while no request waits
        out[n]["wakeups_total"] = st.get("overtake_stage_wakeups_total", 0.0) - b.get("overtake_stage_wakeups_total", 0.0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weight-seconds", type=float, default=8.0,
                    help="window of the two-task weight runs (SCHED_IDLE gets ~1 slice a second)")
    ap.add_argument("--repeat", type=int, default=3, help="repeats of each weight measurement")
    ap.add_argument("--pairs", type=int, default=3,
                    help="independent instance pairs, module on/off (and as many A/A pairs)")
    ap.add_argument("--windows", type=int, default=6, help="side-by-side wrk windows per pair")
    ap.add_argument("--duration", type=int, default=2, help="seconds per wrk window (whole seconds)")
    ap.add_argument("--perf", action="store_true", help="also profile Apache with the module (perf record)")
    ap.add_argument("--connections", type=int, default=16, help="wrk connections")
    ap.add_argument("--skip-overhead", action="store_true", help="weights only")
    ap.add_argument("--skip-weights", action="store_true", help="overhead only")
    ap.add_argument("--module-mode", action="store_true",
                    help="the module's instances run module mode: the static file a stage, a count table in force "
                    "that never holds at --connections (the module-mode overhead; with --skip-weights)")
    ap.add_argument("--extended-status", choices=("on", "off"), default="on",
                    help="mod_status's ExtendedStatus in every instance of the overhead runs (on: Apache's "
                    "default with mod_status, which reads the child's CPU times after each request)")
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
        }
        if not args.skip_weights:
            res["weights_tasks"] = weights_tasks(server_core, args.weight_seconds, args.repeat)
            res["weights_apache"] = weights_apache(tmp, server_core, args.repeat)
        if not args.skip_overhead:
            res["overhead"] = overhead(tmp, server_core, client_core, args.duration, args.connections,
                                       args.pairs, args.windows, args.perf, args.module_mode,
                                       extended_status=args.extended_status == "on")
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


def _nan(x: Any) -> Any:
    """The inverse of :func:`_finite` for printing: None (an interval over one pair) as nan."""
    if x is None:
        return math.nan
    if isinstance(x, dict):
        return {k: _nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan(v) for v in x]
    return x


def summary(res: dict[str, Any]) -> str:
    res = _nan(res)
    lines = [f"{res['date_utc']} UTC, kernel {res['kernel']}, load {res['load_average_1min_start']:.1f}"]
    if "weights_tasks" in res:
        lines += [("| low level | kernel w0/w | tasks: measured w0/w | tasks: low share | "
                   "apache: short-request slowdown, over alone (raw) | kernel slowdown |"),
                  "|---|---:|---:|---:|---:|---:|"]
        for c in CANDIDATES:
            a, b = res["weights_tasks"][c], res["weights_apache"][c]
            lines.append(f"| {c} | {a['kernel_ratio']:.1f} | {a['ratio_median']:.1f} | {a['lo_share_median']:.4f} | "
                         f"{b['slowdown_over_alone_median']:.4f} ({b['slowdown_median']:.4f}) | "
                         f"{b['kernel_slowdown']:.4f} |")
    if "overhead" in res:
        o = res["overhead"]
        late = o["monitor_late_under_cpu_load"]
        fmt = ", ".join
        lines.append("")
        lines.append(
            f"wrk -c{res['args']['connections']} on each instance of a pair at once, {o['pairs']} pairs x "
            f"{o['windows']} windows of {res['args']['duration']} s (load average median "
            f"{o['load_average_1min_median']:.1f}): Apache CPU per request on / off "
            f"{o['cpu_per_request_ratio']:.4f} +- {o['cpu_per_request_ratio_ci95']:.4f} (pairs "
            f"{fmt(f'{x:.4f}' for x in o['cpu_per_request_ratio_pairs'])}), requests per CPU-second "
            f"{o['requests_per_cpu_second_ratio']:.4f} (target >= {o['target_ratio_min']})"
        )
        lines.append(
            f"A/A control (two instances without the module): {o['control_cpu_per_request_ratio']:.4f} +- "
            f"{o['control_cpu_per_request_ratio_ci95']:.4f} (pairs "
            f"{fmt(f'{x:.4f}' for x in o['control_cpu_per_request_ratio_pairs'])}); req/s ratios on/off per pair "
            f"{fmt(f'{x:.3f}' for x in o['rps_ratio_pairs'])}, A/A {fmt(f'{x:.3f}' for x in o['control_rps_ratio_pairs'])}"
        )
        lines.append(
            f"monitor: idle {100 * o['monitor_idle_cpu_fraction']:.3f} % of a core; under wrk "
            f"{100 * o['monitor_share_of_apache_cpu_median']:.3f} % of Apache's CPU; wake-up delay with "
            f"{late['concurrent_requests']} CPU-bound requests: mean {late['mean_ms']:.3f} ms, "
            f"<= 1 ms {100 * late['le_1ms']:.1f} %, <= 2 ms {100 * late['le_2ms']:.1f} % of "
            f"{late['wakeups']} wake-ups; CPU-clock reads per request {o['clock_reads_per_request_on0']:.3f}"
        )
        if "module_mode" in o:
            mm = o["module_mode"]
            lines.append(
                f"module mode (a count table in force on the static file's stage), side by side, geometric "
                f"means: requests/s on / off {o['rps_ratio']:.4f} ({o['rps_ratio_ci95'][0]:.4f}-"
                f"{o['rps_ratio_ci95'][1]:.4f}; target >= 0.98; A/A {o['control_rps_ratio']:.4f}), p99 on / off "
                f"{o['p99_ratio']:.4f} ({o['p99_ratio_ci95'][0]:.4f}-{o['p99_ratio_ci95'][1]:.4f}; target <= "
                f"1.10; A/A {o['control_p99_ratio']:.4f}, pairs {fmt(f'{x:.3f}' for x in o['control_p99_ratio_pairs'])}; "
                f"arithmetic means of the windows' ratios {o['p99_ratio_arithmetic_mean']:.4f}, A/A "
                f"{o['control_p99_ratio_arithmetic_mean']:.4f}); stage requests counted "
                f"{fmt(str(round(v['requests_total'])) for v in mm.values())}, held "
                f"{fmt(str(round(v['held_total'])) for v in mm.values())}")
            lines.append(
                f"each instance alone on the core, windows alternated: p99 on / off {o['p99_alone_ratio']:.4f} "
                f"({o['p99_alone_ratio_ci95'][0]:.4f}-{o['p99_alone_ratio_ci95'][1]:.4f}; A/A "
                f"{o['control_p99_alone_ratio']:.4f}, pairs {fmt(f'{x:.3f}' for x in o['control_p99_alone_ratio_pairs'])}), "
                f"requests/s on / off {o['rps_alone_ratio']:.4f} ({o['rps_alone_ratio_ci95'][0]:.4f}-"
                f"{o['rps_alone_ratio_ci95'][1]:.4f}; A/A {o['control_rps_alone_ratio']:.4f}), Apache CPU per "
                f"request on / off {o['cpu_alone_ratio']:.4f} ({o['cpu_alone_ratio_ci95'][0]:.4f}-"
                f"{o['cpu_alone_ratio_ci95'][1]:.4f}; A/A {o['control_cpu_alone_ratio']:.4f})")
        if "perf" in o:
            lines.append(f"perf: module code {o['perf']['module_code_pct']:.2f} % of Apache's CPU samples, "
                         f"thread-clock syscall (kernel side) {o['perf']['clock_syscall_kernel_pct']:.2f} %")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
