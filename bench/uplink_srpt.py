"""Uplink SRPT testbed: FAIR vs SRPT vs SRRT vs app-level on a shaped veth (the uplink papers (Crovella et al.; Harchol-Balter et al.; Al Sa'deh and Yahya; Schroeder and Harchol-Balter)).

Two network namespaces joined by a veth pair (bench/uplink/testbed.py); the server side's egress
is shaped to ``--rate`` by HTB (8 strict classes, TSO/GSO off) or TBF + pfifo_fast
(controller.uplink.qdisc). The server under test runs in the server namespace and writes every response
through ``overtake.controller.uplink``; an open-loop Poisson client (one connection per request, Harchol-Balter et al., "Size-based scheduling to improve web performance"
§3.1.4) runs in the client namespace. The same seeded schedule is replayed for every policy.

Server under test (``--server``): ``sidecar`` (the default from 2026-11-21 22:30 UTC; the issue's
testbed) = a private Apache (``overtake apache start``) serving the file set behind
``overtake sidecar --policy passthrough --uplink X`` (the product path; the sidecar builds the
uplink with ``make_uplink(X)``: bands detected from the installed qdisc, adaptive cutoffs), or
``asyncio`` = bench/uplink/server.py (the product's uplink code path with a minimal static server
in front, no Apache; SRPT gets cutoffs derived from the size model).

Contract::

    python bench/uplink_srpt.py --load 0.8 --policies fair,srpt,srrt --duration S --json

prints ``{"policies": {"fair": {"mean_response_time": s, "mean_slowdown": x,
"largest_1pct_mean_response_time": s, "throughput_bytes_per_s": b, ...}, ...}}``.
``--workload w1`` runs Schroeder and Harchol-Balter's W1 (alternating ``--w1-phase`` s at load 0.2 and 1.2);
``--workload w2`` .. ``w10`` the other transient-overload workloads of its Table 1, with both
phases multiplied by ``--phase-scale`` (1 = the paper's lengths).
``--record`` appends the run to bench/results/uplink_srpt.jsonl and replaces the bench/results/sections.md section
``uplink-srpt`` (the latest run; the curated uplink sections rest on the records).
Needs root (namespaces, qdisc, SO_PRIORITY >= 7).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from uplink.ideal import fluid_response_times
from uplink.testbed import Testbed
from uplink.workload import HEADER_BYTES, MODELS, TRANSIENT, schedule, transient_phases

from overtake.controller.uplink import bands as _bands
from overtake.controller.uplink import qdisc as _qdisc

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SERVER = ROOT / "bench" / "uplink" / "server.py"
CLIENT = ROOT / "bench" / "uplink" / "client.py"
PORT = 8080
# 10 KB first: the 100-byte request (a) then follows a small one, not the 3 MB one (after
# which it pays the cold caches below, not the link)
CAL_SIZES = [10_000, 100, 100_000, 1_000_000, 3_000_000]
CAL_REPEATS = 3
# payload per L2 byte the qdisc counts: MSS 1448 (MTU 1500, TCP timestamps) per 1514-byte frame
NOMINAL_GOODPUT = 1448 / 1514
# plain srpt's rule in runs recorded before the testbed said (srpt_top_fraction): Harchol-Balter et al.'s 1 %
LEGACY_TOP_FRACTION = 0.01
SECTION = "uplink-srpt"


APACHE_PORT = 18081
ADMIN_PORT = 18089  # the sidecar's admin listener, on the server's address (the client namespace scrapes it)
OVERTAKE = str(Path(sys.executable).with_name("overtake"))
STAGES = ROOT / "examples" / "sidecar" / "stages.yaml"


def start_sidecar(tb: Testbed, name: str, log_path: Path, *, policy: str = "passthrough", stages: Path = STAGES,
                  core: int | None = None, extra: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    """Apache + ``overtake sidecar --policy POLICY --uplink NAME [EXTRA]`` in the server namespace."""
    pin = ["taskset", "-c", str(core)] if core is not None else []
    cmd = [*tb.exec_prefix(tb.srv_ns), *pin, OVERTAKE, "sidecar", "--policy", policy,
           "--apache", f"http://127.0.0.1:{APACHE_PORT}", "--listen", f"{tb.srv_ip}:{PORT}",
           "--stages", str(stages), "--uplink", name, "--admin-listen", f"{tb.srv_ip}:{ADMIN_PORT}", *extra]  # fmt: skip
    log = open(log_path, "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while "listening" not in log_path.read_text():
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise RuntimeError(f"sidecar --policy {policy} --uplink {name} did not start: {log_path.read_text()}")
        time.sleep(0.1)
    p.describe = " ".join(["Apache + overtake sidecar --policy", policy, "--uplink", name, *extra])  # type: ignore[attr-defined]
    return p


def _apache_up(tb: Testbed, sizes: set[int]) -> Path:
    work = Path(tempfile.mkdtemp(prefix="ovt_uplink_apache_"))
    os.chmod(work, 0o755)  # Apache's www-data child must read htdocs
    subprocess.run([*tb.exec_prefix(tb.srv_ns), OVERTAKE, "apache", "start", "--workdir",
                    str(work), "--listen", f"127.0.0.1:{APACHE_PORT}", "--max-workers", "128"],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    write_files(work, sizes)
    return work


def write_files(work: Path, sizes: set[int]) -> None:
    files = work / "htdocs" / "f"
    files.mkdir(parents=True, exist_ok=True)
    os.chmod(files, 0o755)
    for n in sizes:
        f = files / str(n)
        if not f.exists():
            f.write_bytes(b"x" * n)
            os.chmod(f, 0o644)


def _apache_down(tb: Testbed, work: Path) -> None:
    subprocess.run([*tb.exec_prefix(tb.srv_ns), OVERTAKE, "apache", "stop", "--workdir",
                    str(work), "--now"], check=False, capture_output=True)  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)


def start_server(tb: Testbed, policy: str, args: argparse.Namespace, cutoffs: str | None,
                 stats_out: Path, top: float | None = None, writers: int = 0,
                 ordered: int = 1) -> subprocess.Popen[str]:
    name = "app" if policy.startswith("app") else policy
    if args.server == "sidecar":
        # the sidecar adapts its cutoffs from the served sizes; srpt/tF sets the rule it adapts by
        extra: tuple[str, ...] = ()
        if name == "srpt" and args.fixed_cutoffs and cutoffs:
            extra = ("--uplink-cutoffs", cutoffs)  # the size model's, as the asyncio server gets
        elif name == "srpt" and top is not None:
            extra = ("--uplink-top-fraction", f"{top:g}")
        if writers:
            extra += ("--uplink-lowest-writers", str(writers))
        if ordered > 1:
            extra += ("--uplink-ordered-bands", str(ordered))
        return start_sidecar(tb, name, stats_out.with_suffix(".log"), extra=extra)
    cmd = [*tb.exec_prefix(tb.srv_ns), PY, str(SERVER), "--listen", f"{tb.srv_ip}:{PORT}",
           "--uplink", name, "--stats-out", str(stats_out),
           "--bands", "htb" if tb.mode == "htb" else "pfifo_fast"]  # fmt: skip
    if name == "srpt" and cutoffs:
        cmd += ["--cutoffs", cutoffs]
    if writers:
        cmd += ["--lowest-writers", str(writers)]
    if ordered > 1:
        cmd += ["--ordered-bands", str(ordered)]
    if name == "app":
        k = policy.split(":", 1)[1] if ":" in policy else str(args.app_concurrency)
        cmd += ["--concurrency", k, "--quantum", str(args.app_quantum)]
        if args.app_pacing:
            cmd += ["--max-pacing-rate", str(_qdisc.parse_rate(args.rate) // 8)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()  # "serving ... uplink <describe>"
    if not line.startswith("serving"):
        p.kill()
        raise RuntimeError(f"server for {policy} did not start: {line} {p.stderr.read()}")
    p.describe = line.split(" uplink ", 1)[1].strip()  # type: ignore[attr-defined]
    return p


def stop_process(p: subprocess.Popen[str]) -> None:
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=20)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def _client(tb: Testbed, sched: list[tuple[float, int]], tmp: Path, timeout: float,
            prefix: str = "/", sequential: float | None = None) -> list[list[Any]]:
    sp, rp = tmp / "sched.json", tmp / "res.json"
    sp.write_text(json.dumps(sched))
    cmd = [*tb.exec_prefix(tb.cli_ns), PY, str(CLIENT), "--server", f"{tb.srv_ip}:{PORT}",
           "--schedule", str(sp), "--out", str(rp), "--timeout", str(timeout),
           "--prefix", prefix]  # fmt: skip
    if sequential is not None:
        cmd += ["--sequential", str(sequential)]
    subprocess.run(cmd, check=True)
    out: list[list[Any]] = json.loads(rp.read_text())
    return out


def calibrate_solo(tb: Testbed, tmp: Path, args: argparse.Namespace) -> tuple[float, float, float]:
    """Solo response time t(s) = a + s/b on the idle link (sequential requests, FAIR), and the
    bytes the qdisc carries per request beyond its modelled ones (size + HEADER_BYTES in full
    frames): SYN-ACK, FIN, the real server's longer headers, the last frame's header.

    Closed loop with 10 ms between requests: after an idle spell a VM's next request pays
    cold caches, more the longer the spell, which is the machine, not the link. Goodput from the two
    largest sizes' difference (1.7 s of transfer, so a disturbed start is ~1 %); medians of
    the repeats.
    """
    p = start_server(tb, "fair", args, None, tmp / "cal_stats.json")
    try:
        sched = [(0.0, s) for _ in range(CAL_REPEATS) for s in CAL_SIZES]
        w0 = _wire_bytes(tb)
        res = _client(tb, sched, tmp, 60.0, args.prefix, sequential=0.01)
        wire = _wire_bytes(tb) - w0
    finally:
        stop_process(p)
    med = {s: float(np.median([r[3] - r[0] for r in res if r[4] == s])) for s in CAL_SIZES}
    big, bigger = CAL_SIZES[-2], CAL_SIZES[-1]
    b = (bigger - big) / (med[bigger] - med[big])
    return med[100], float(b), wire / len(sched) - _modelled_wire(sched)


def response_metrics(res: list[list[Any]], solo: tuple[float, float]) -> dict[str, Any]:
    a, b = solo
    ok = [r for r in res if r[6] is None and r[5] >= r[4]]
    arr = np.array([r[0] for r in ok])
    end = np.array([r[3] for r in ok])
    size = np.array([r[4] for r in ok], float)
    rt = end - arr
    slow = rt / (a + (size + HEADER_BYTES) / b)
    order = np.argsort(size, kind="stable")
    n = len(ok)

    def grp(lo: float, hi: float) -> float:
        idx = order[int(lo * n) : int(hi * n)]
        return float(rt[idx].mean()) if len(idx) else float("nan")

    span = float(end.max() - arr.min()) if n else float("nan")
    # connections in the system: time average (Little: sum of sojourns / span) and maximum
    ev = np.concatenate([np.stack([arr, np.ones(n)], 1), np.stack([end, -np.ones(n)], 1)])
    ev = ev[np.lexsort((ev[:, 1], ev[:, 0]))]
    in_sys = np.cumsum(ev[:, 1])
    return {
        "requests": len(res),
        "completed": n,
        "errors": len(res) - n,
        "mean_response_time": float(rt.mean()),
        "mean_slowdown": float(slow.mean()),
        "p50_response_time": float(np.median(rt)),
        "p99_response_time": float(np.quantile(rt, 0.99)),
        "response_time_by_size_percentile": {
            "0-50": grp(0, 0.5), "50-90": grp(0.5, 0.9), "90-99": grp(0.9, 0.99),
            "99-100": grp(0.99, 1.0),
        },  # fmt: skip
        "largest_1pct_mean_response_time": grp(0.99, 1.0),
        "largest_request_response_time": float(rt[order[-1]]) if n else float("nan"),
        "throughput_bytes_per_s": float((size + HEADER_BYTES).sum() / span),
        "mean_connections": float(rt.sum() / span),
        "max_connections": int(in_sys.max()) if n else 0,
    }


# server-side TCP counters per run: retransmitted segments, retransmission timeouts, and
# timeouts that found the segment still in the local qdisc (a band starved longer than the RTO)
TCP_COUNTERS = ("TcpRetransSegs", "TcpExtTCPTimeouts", "TcpExtTCPSpuriousRtxHostQueues",
                "TcpExtTCPLossUndo", "TcpOutSegs")  # fmt: skip


class Variant(NamedTuple):
    base: str  #: fair, srpt, srrt, app or app:K
    floor: float  #: /fF
    top: float | None  #: /tF
    writers: int  #: /wK
    ordered: int  #: /bN (1 without it)


def parse_variant(pol: str) -> Variant:
    """``srpt/f0.05/t0.001/w1/b3`` -> Variant("srpt", floor 0.05, top fraction 0.001, 1 writer,
    3 ordered bands).

    ``/fF``: the lowest band guaranteed a fraction F of the link (srpt, srrt); ``/tF``: SRPT
    cutoffs with only a fraction F of the sizes above the highest (Harchol-Balter et al.'s rule: 0.005-0.01);
    ``/wK``: at most K responses of the lowest band write at once, least remaining first;
    ``/bN`` (with /wK): each of the lowest N bands ordered so."""
    base, *mods = pol.split("/")
    if base.split(":")[0] not in ("fair", "srpt", "srrt", "app"):
        raise ValueError("use fair, srpt, srrt, app or app:K, with /fF (floor), /tF (top "
                         "fraction of the cutoffs), /wK (lowest-band writers) or /bN (bands so "
                         "ordered) after srpt, e.g. srpt/f0.05/t0.001/w1/b3")
    floor, top, writers, ordered = 0.0, None, 0, 1
    for m in mods:
        try:
            v = float(m[1:])
        except ValueError:
            v = float("nan")
        if m[:1] == "f" and base in ("srpt", "srrt") and 0 < v <= 0.5:
            floor = v
        elif m[:1] == "t" and base == "srpt" and 0 < v < 0.5:
            top = v
        elif m[:1] == "w" and base in ("srpt", "srrt") and v == int(v) and 1 <= v <= 64:
            writers = int(v)
        elif m[:1] == "b" and base in ("srpt", "srrt") and v == int(v) and 1 <= v <= 7:
            ordered = int(v)
        else:
            raise ValueError(f"{m!r}: /fF needs srpt or srrt and 0 < F <= 0.5; /tF needs srpt and "
                             "0 < F < 0.5; /wK needs srpt or srrt and a whole K in 1..64; /bN a "
                             "whole N in 1..7")
    if ordered > 1 and not writers:
        raise ValueError(f"{pol!r}: /b{ordered} orders bands with /wK's writers; add /w1")
    return Variant(base, floor, top, writers, ordered)


def _tcp_counters(ns: str) -> dict[str, int]:
    cp = subprocess.run(["ip", "netns", "exec", ns, "nstat", "-az", "--json"],
                        capture_output=True, text=True)  # fmt: skip
    if cp.returncode != 0:
        return {}
    data = json.loads(cp.stdout)
    flat = data.get("kernel", data)
    return {k: int(v) for k, v in flat.items() if k in TCP_COUNTERS}


def _qdisc_drops(tb: Testbed) -> dict[str, int]:
    """Packets each leaf of the server's qdisc dropped so far (a full leaf FIFO)."""
    return {c.classid: c.drops for c in _qdisc.show(tb.srv_dev, netns=tb.srv_ns).classes}


def _modelled_wire(sched: list[tuple[float, int]]) -> float:
    """Wire bytes a request of ``sched`` costs in the model: size + HEADER_BYTES in full frames."""
    return sum(s + HEADER_BYTES for _, s in sched) / (len(sched) * NOMINAL_GOODPUT)


def _wire_bytes(tb: Testbed) -> int:
    """Bytes (L2, as the shaper counts them) the server's qdisc has sent so far, all leaves."""
    return sum(c.bytes for c in _qdisc.show(tb.srv_dev, netns=tb.srv_ns).classes)


def _ideal(sched: list[tuple[float, int]], goodput_bps: float, cut: Any,
           which: tuple[str, ...] = ("ps", "srpt", "bands"), overhead: float = 0.0) -> dict[str, Any]:
    """The schedule on a fluid link (bench/uplink/ideal.py): PS, exact SRPT and the bands.
    ``overhead``: wire bytes per request beyond size + HEADER_BYTES in full frames (0: the
    sizes alone; the calibrated figure: every byte the link really carries for a request)."""
    arr = np.array([a for a, _ in sched])
    size = np.array([s + HEADER_BYTES + overhead * NOMINAL_GOODPUT for _, s in sched], float)
    big = np.argsort(size, kind="stable")[int(0.99 * len(size)):]
    out: dict[str, Any] = {}
    for name in which:
        rt = fluid_response_times(arr, size, goodput_bps / 8, name, tuple(cut.edges))
        out[name] = {"mean_response_time": float(rt.mean()),
                     "largest_1pct_mean_response_time": float(rt[big].mean())}  # fmt: skip
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = MODELS[args.sizes]
    tb = Testbed.up(rate=args.rate, mode=args.mode)
    out: dict[str, Any] = {"testbed": {}, "policies": {}}
    apache_dir: Path | None = None
    args.prefix = "/"
    try:
        with tempfile.TemporaryDirectory(prefix="ovt_uplink_") as td:
            tmp = Path(td)
            if args.server == "sidecar":
                apache_dir = _apache_up(tb, set(CAL_SIZES))
                args.prefix = "/f/"
            solo = calibrate_solo(tb, tmp, args)
            # the schedule's load is against the link's nominal goodput, not the calibrated one:
            # calibration on this shared VM scatters by +-5 %, and W1's overload phase (1.2)
            # is very sensitive to that; the calibrated figure is reported beside it
            goodput = _qdisc.parse_rate(args.rate) * NOMINAL_GOODPUT
            w1 = args.w1_phase if args.workload == "w1" else None
            phases = (transient_phases(args.workload, args.phase_scale)
                      if args.workload not in ("poisson", "w1") else None)
            sched = schedule(model, load=args.load, duration=args.duration, goodput_bps=goodput,
                             seed=args.seed, w1_phase=w1, phases=phases)  # fmt: skip
            if apache_dir is not None:
                write_files(apache_dir, {sz for _, sz in sched})
            n_data = 7 if tb.mode == "htb" else 2
            ref = model.sample(200_000, np.random.default_rng(args.seed + 1)) + HEADER_BYTES
            # plain srpt: the product's default rule (records before 2026-11-21 20:45 UTC: 1 %)
            cut = _bands.cutoffs_from_samples(ref, n_data)
            offered = sum(s + HEADER_BYTES for _, s in sched) * 8 / args.duration / goodput
            out["testbed"] = {
                "qdisc": _qdisc.show(tb.srv_dev, netns=tb.srv_ns).describe(),
                "solo_time_s": {"a": solo[0], "goodput_bps": solo[1] * 8},
                "wire_overhead_bytes_per_request": solo[2],
                "nominal_goodput_bps": goodput,
                "sizes": args.sizes, "workload": args.workload, "load": args.load,
                "w1_phase_s": w1, "phases": phases, "duration_s": args.duration, "requests": len(sched),
                "offered_load_realised": offered, "srpt_cutoffs_bytes": str(cut),
                "srpt_top_fraction": _bands.TOP_FRACTION,
                "seed": args.seed, "server": args.server, "autogroup_nice": args.autogroup,
                "loadavg_1min_at_start": args.loadavg,
            }  # fmt: skip
            out["ideal"] = _ideal(sched, goodput, cut)
            if solo[2] > 0:
                for name, row in _ideal(sched, goodput, cut, overhead=solo[2]).items():
                    out["ideal"][f"{name} (wire)"] = row
            # cutoffs of the srpt/tF variants, each also on the fluid link
            alt_cuts = {t: _bands.cutoffs_from_samples(ref, n_data, top_fraction=t)
                        for t in (parse_variant(p).top for p in args.policies) if t is not None}  # fmt: skip
            for top, alt in sorted(alt_cuts.items()):
                out["ideal"][f"bands/t{top:g}"] = _ideal(sched, goodput, alt, ("bands",))["bands"]
            for pol in args.policies:
                stats_path = tmp / f"stats_{pol.replace(':', '_').replace('/', '_')}.json"
                var = parse_variant(pol)
                if tb.mode == "htb":
                    tb.set_floor(var.floor)
                pcut = cut if var.top is None else alt_cuts[var.top]
                p = start_server(tb, var.base, args, str(pcut), stats_path, var.top, var.writers, var.ordered)
                t0 = time.monotonic()
                tcp0 = _tcp_counters(tb.srv_ns)
                q0, w0 = _qdisc_drops(tb), _wire_bytes(tb)
                try:
                    res = _client(tb, sched, tmp, args.timeout, args.prefix)
                finally:
                    stop_process(p)
                m = response_metrics(res, solo[:2])
                m["wall_s"] = time.monotonic() - t0
                tcp1 = _tcp_counters(tb.srv_ns)
                m["server_tcp"] = {k: tcp1.get(k, 0) - tcp0.get(k, 0) for k in TCP_COUNTERS}
                m["qdisc_drops"] = {k: v - q0.get(k, 0) for k, v in _qdisc_drops(tb).items()
                                    if v - q0.get(k, 0)}  # fmt: skip
                # what the link carried for this run (incl. retransmissions, handshakes)
                m["wire_bytes_per_request"] = (_wire_bytes(tb) - w0) / max(len(sched), 1)
                m["uplink"] = p.describe  # type: ignore[attr-defined]
                if var.floor:
                    m["uplink"] += f"; lowest band guaranteed {var.floor:.0%} of the link (HTB rate)"
                if var.top is not None and args.server == "sidecar" and not args.fixed_cutoffs:
                    m["uplink"] += (f" (cutoffs adapt to the served sizes, the top one at their "
                                    f"{100 * (1 - var.top):g}th percentile)")
                elif var.top is not None:
                    m["uplink"] += (f"; cutoffs with the top one at the {100 * (1 - var.top):g}th percentile: "
                                    f"{pcut}")
                if stats_path.exists():
                    st = json.loads(stats_path.read_text())
                    if "bands" in st:
                        m["priority_changes"] = st["bands"]["priority_changes"]
                out["policies"][pol] = m
                print(f"  {pol}: mean {m['mean_response_time']:.3f}s slowdown "
                      f"{m['mean_slowdown']:.1f} top1% {m['largest_1pct_mean_response_time']:.3f}s "
                      f"tput {m['throughput_bytes_per_s'] * 8 / 1e6:.2f} Mbit/s "
                      f"conns {m['mean_connections']:.1f} (max {m['max_connections']}) "
                      f"errors {m['errors']}", file=sys.stderr, flush=True)  # fmt: skip
                time.sleep(1.0)  # let the last FIN/ACKs drain
            fair = out["policies"].get("fair")
            if fair is not None and "wire_bytes_per_request" in fair:
                # the twins again on the bytes FAIR's run carried a request: no starved band, so
                # hardly a retransmission, and under load FINs ride on the last data segment
                o = fair["wire_bytes_per_request"] - _modelled_wire(sched)
                out["testbed"]["fair_overhead_bytes_per_request"] = o
                for name, row in _ideal(sched, goodput, cut, overhead=o).items():
                    out["ideal"][f"{name} (FAIR's bytes)"] = row
    finally:
        if apache_dir is not None:
            _apache_down(tb, apache_dir)
        tb.down()
    return out


def render_table(out: dict[str, Any]) -> str:
    pols = out["policies"]
    fair = pols.get("fair")
    rows = ["| policy | mean RT s | vs FAIR | mean slowdown | RT 0-50% | 50-90% | 90-99% | "
            "largest 1% | vs FAIR | Mbit/s | mean conns | max conns | errors | RTOs (in qdisc) | "
            "retrans % | qdisc drops |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, m in pols.items():
        g = m["response_time_by_size_percentile"]
        r1 = f"{m['mean_response_time'] / fair['mean_response_time']:.2f}" if fair else "-"
        r2 = (f"{m['largest_1pct_mean_response_time'] / fair['largest_1pct_mean_response_time']:.2f}"
              if fair else "-")  # fmt: skip
        rows.append(
            f"| {name} | {m['mean_response_time']:.3f} | {r1} | {m['mean_slowdown']:.1f} | "
            f"{g['0-50']:.3f} | {g['50-90']:.3f} | {g['90-99']:.3f} | {g['99-100']:.3f} | {r2} | "
            f"{m['throughput_bytes_per_s'] * 8 / 1e6:.2f} | {m['mean_connections']:.1f} | "
            f"{m['max_connections']} | {m['errors']} | {_rto(m)} | "
            f"{sum(m.get('qdisc_drops', {}).values())} |"
        )
    ideal = out.get("ideal")
    if ideal:
        for name in ideal:
            i = ideal[name]
            # each twin against its own PS: sizes alone, or the bytes on the wire
            _, sep, tail = name.partition(" ")
            ps = ideal["ps" + sep + tail]["mean_response_time"]
            rows.append(
                f"| ideal {name} | {i['mean_response_time']:.3f} | "
                f"{i['mean_response_time'] / ps:.2f} (vs PS) | | | | | "
                f"{i['largest_1pct_mean_response_time']:.3f} | | | | | | | | |"
            )
    return "\n".join(rows)


def wire_line(out: dict[str, Any]) -> list[str]:
    """Bytes on the link per request: the calibrated overhead and each policy's (runs from
    2026-11-22 01:40 UTC on)."""
    o = out["testbed"].get("wire_overhead_bytes_per_request")
    if o is None:
        return []
    per = "; ".join(f"{k} {m['wire_bytes_per_request']:.0f}" for k, m in out["policies"].items()
                    if "wire_bytes_per_request" in m)  # fmt: skip
    of = out["testbed"].get("fair_overhead_bytes_per_request")
    fair = (f"; FAIR's run {of:.0f} (the `(FAIR's bytes)` twins add that)" if of is not None
            else "")  # fmt: skip
    return [f"Wire: {o:.0f} bytes a request beyond size + {HEADER_BYTES} in full frames "
            f"(calibrated, idle link; the `(wire)` twins add it){fair}; the link carried per "
            f"request: {per}.", ""]


def _rto(m: dict[str, Any]) -> str:
    t = m.get("server_tcp")
    if not t or not t.get("TcpOutSegs"):
        return "- | -"
    pct = 100.0 * t["TcpRetransSegs"] / t["TcpOutSegs"]
    return f"{t['TcpExtTCPTimeouts']} ({t['TcpExtTCPSpuriousRtxHostQueues']}) | {pct:.2f}"


def _record(out: dict[str, Any], argv: list[str]) -> None:
    tb = out["testbed"]
    head = (
        f"### {tb['workload']} {tb['sizes']} "
        + (f"load {tb['load']}" if tb["workload"] == "poisson"
           else f"W1 phase {tb['w1_phase_s']} s" if tb["workload"] == "w1"
           else "phases " + ", ".join(f"{d:g} s at {ld:g}" for d, ld in tb["phases"]))
        + f", {tb['duration_s']} s, {tb['requests']} requests"
    )
    body = "\n".join([
        head, "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; `{platform.node()}` "
        f"({os.cpu_count()} vCPU, shared with other helpers' jobs: load average "
        f"{tb['loadavg_1min_at_start']:.1f} at start; bench session autogroup nice "
        f"{tb['autogroup_nice']}); server under test: {tb['server']}; "
        f"`python bench/uplink_srpt.py {' '.join(argv)}`", "",
        f"qdisc: {tb['qdisc']}. Solo time a = {tb['solo_time_s']['a'] * 1e3:.1f} ms, goodput "
        f"{tb['solo_time_s']['goodput_bps'] / 1e6:.2f} Mbit/s calibrated, "
        f"{tb.get('nominal_goodput_bps', 0) / 1e6:.2f} nominal (the load's base); realised offered load "
        f"{tb['offered_load_realised']:.2f}; SRPT cutoffs (bytes, from the size model, "
        f"{100 * tb.get('srpt_top_fraction', LEGACY_TOP_FRACTION):g} % above the top one) {tb['srpt_cutoffs_bytes']}.", "",
        render_table(out), "",
        *wire_line(out),
        "Uplinks: " + "; ".join(f"{k}: {v['uplink']}" for k, v in out["policies"].items()), "",
    ])  # fmt: skip
    # the raw run goes to bench/results, this bench's own section is replaced
    from _report import write_section

    intro = (f"## {SECTION}: the latest recorded run of bench/uplink_srpt.py\n\n"
             "Every run is in bench/results/uplink_srpt.jsonl; the curated uplink sections "
             "rest on those records.\n\n")
    write_section(SECTION, intro + body, run=out,
                  bench="uplink_srpt", command=f"python bench/uplink_srpt.py {' '.join(argv)}")


def raise_priority() -> int | None:
    """Put this session's scheduler autogroup at nice -20 (as controller.harness.apache does for Apache).

    The Python server and client must not be CPU-starved by other jobs on the shared machine, or
    response times measure the CPU queue instead of the uplink. ``nice`` alone does nothing
    across autogroups (it only ranks threads inside one). Children share the autogroup.
    """
    try:
        Path("/proc/self/autogroup").write_text("-20")
        return -20
    except OSError:
        return None


def parser() -> argparse.ArgumentParser:
    """The command line (also used by bench/uplink_sweep.py to build each run's arguments)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", type=float, default=0.8, help="uplink load (default 0.8)")
    ap.add_argument("--policies", default="fair,srpt,srrt,app",
                    help="comma list of fair, srpt, srrt, app, app:K (K writers); srpt/fF, "
                    "srrt/fF: the lowest band guaranteed a fraction F of the link (HTB); srpt/tF: "
                    f"cutoffs with a fraction F of the sizes above the top one (plain srpt: the "
                    f"product's default, {_bands.TOP_FRACTION:g}); srpt/wK: at most K responses of "
                    "the lowest band write at once, least remaining first; srpt/wK/bN: each of the "
                    "lowest N bands so; modifiers combine: srpt/t0.005/w1")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    ap.add_argument("--workload", choices=("poisson", *TRANSIENT), default="poisson")
    ap.add_argument("--phase-scale", type=float, default=1.0,
                    help="w2..w10: multiply both phase lengths (same shape and mean load)")
    ap.add_argument("--w1-phase", type=float, default=25.0,
                    help="W1 phase length s (Schroeder and Harchol-Balter: 25)")
    ap.add_argument("--sizes", choices=sorted(MODELS), default="wc98")
    ap.add_argument("--mode", choices=_qdisc.MODES, default="htb")
    ap.add_argument("--rate", default="10mbit")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--app-concurrency", type=int, default=4)
    ap.add_argument("--app-pacing", action=argparse.BooleanOptionalAction, default=True,
                    help="app: cap each socket's pacing rate at the link rate (default on)")
    ap.add_argument("--app-quantum", type=int, default=16384, help="bytes per app-level write")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request client timeout s")
    ap.add_argument("--server", choices=("asyncio", "sidecar"), default="sidecar",
                    help="server under test: Apache + overtake sidecar --policy passthrough "
                    "--uplink X (the default, the product path: SRPT cutoffs adapt from 1K-50K), "
                    "or bench/uplink/server.py (asyncio, no Apache)")
    ap.add_argument("--fixed-cutoffs", action="store_true",
                    help="--server sidecar: give SRPT the size model's cutoffs (as the asyncio "
                    "server gets) instead of adapting them from the served sizes")
    ap.add_argument("--no-raise-priority", dest="raise_priority", action="store_false",
                    help="do not put this session's autogroup at nice -20")
    ap.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    ap.add_argument("--record", action="store_true", help="append the run to bench/results/uplink_srpt.jsonl, replace "
                    "bench/results/sections.md section uplink-srpt")
    return ap


def parse(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse and check ``argv`` (errors name the flag and exit 2, as argparse does)."""
    args = ap.parse_args(argv)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in args.policies:
        try:
            floor = parse_variant(p).floor
        except ValueError as exc:
            ap.error(f"--policies: {p!r}: {exc}")
        if floor and args.mode != "htb":
            ap.error(f"--policies: {p!r}: a floor needs --mode htb (pfifo_fast bands are strict)")
    if not 0 < args.load < 2:
        ap.error(f"--load: {args.load} must be in (0, 2)")
    if not args.phase_scale > 0:
        ap.error(f"--phase-scale: {args.phase_scale} must be > 0 (1 = Schroeder and Harchol-Balter's phase lengths)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(parser(), argv)
    # SIGTERM -> SystemExit, so the namespaces and Apache are always torn down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.geteuid() != 0:
        print("uplink_srpt: needs root (network namespaces, qdiscs)", file=sys.stderr)
        return 2
    args.autogroup = raise_priority() if args.raise_priority else None
    args.loadavg = os.getloadavg()[0]
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(render_table(out))
    if args.record:
        _record(out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
