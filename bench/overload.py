"""Module mode under sustained overload from clients that give up: what is answered in time, and
how soon the server is back.

    python bench/overload.py [--rate 15] [--seconds 20] [--patience 2] [--work 0.1] [--cap 2]
                             [--lifo-after 0.5] [--runs 3] [--arms plain,serve,drop,newest]
                             [--mpm event|prefork] [--other-load N]
                             [--record] [--json] [--no-write]

A private Apache (``--mpm``, mpm_event by default; 256 workers) on one core; every request runs the stage handler for
``--work`` seconds of CPU. Open-loop arrivals at ``--rate`` a second for ``--seconds`` (with the
defaults 1.5 times what the core serves) from clients that close their connection after
``--patience`` seconds without an answer (a FIN: nothing was unread), as a browser's stop or a
front end's timeout does. The moment the arrivals stop, one patient request is sent: its response
time is how long the server takes to get back to new work. Arms:

- ``plain``: no table (Apache's default: every request runs at once, sharing the core);
- ``serve``: module mode, the stage capped at ``--cap`` running by the count table π(cap, ...),
  held requests whose client left served all the same (``OvertakeStageAbortOnClose Off``);
- ``drop``: the same with the module's default, a held request whose client left dropped;
- ``newest``: ``drop`` with ``OvertakeStageLifoAfter`` (``--lifo-after``): once the stage's queue
  has stood that long, its newest waiting requests start first.

With ``--patience`` longer than the overload lasts, no client leaves: that shows what newest
first costs the oldest requests. ``--other-load N`` runs N busy loops at nice 0 on Apache's core
during each run (other jobs of the machine; Apache keeps the harness's autogroup priority -20);
``--mpm prefork`` holds each waiting request in a process of its own. Per run: requests answered within the patience and their mean and 99th-percentile response
time, handlers run and requests dropped (Apache's access log: status 200 and 499), and the
patient request's response time. Appends the runs to
``bench/results/overload.jsonl`` and their write-up to ``bench/results/sections.md`` with
``--record``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _report import add_output_arguments, command_line, machine, publish
from cpu_priority import stage_counters

from overtake.controller.harness import apache
from overtake.controller.harness.apache.cpu_priority import CpuPriority
from overtake.controller.harness.scratch import free_port, scratch_dir
from overtake.controller.sidecar.control_file import ControlFile
from overtake.controller.sidecar.count_table import from_policy
from overtake.controller.sidecar.policies import BaselinePolicy

ARMS = ("plain", "serve", "drop", "newest")
STAGES = ("capped", "other")  # the bench's requests are all of the first


def _get(host: str, port: int, path: str, timeout: float) -> float | None:
    """One request: its response time if answered 200 within ``timeout``, else None (the
    connection is closed)."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        r.read()
        return time.monotonic() - t0 if r.status == 200 else None
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def _put_table(inst: apache.ApacheInstance, path: str, cap: int) -> None:
    """π(cap, 8) in force in Apache (the first stage capped at ``cap`` running)."""
    table = from_policy(BaselinePolicy(f"pi({cap},8)", 2), STAGES)
    assert table is not None
    cf = ControlFile(path)
    try:
        cf.write(2, None, table.encode())
    finally:
        cf.close()
    host, port = apache.parse_listen(inst.listen)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        _get(host, port, "/stage2?work=0", 10)  # a request start reads the control file
        if stage_counters(inst).get('overtake_stage_table_in_force{stage="capped"}') == 1:
            return
        time.sleep(0.1)
    raise RuntimeError("the count table did not come into force in Apache within 15 s")


def one_run(arm: str, args: argparse.Namespace, tmp: Path, core: int) -> dict[str, Any]:
    """One arm, one run: start Apache, send the trace, read its access log, stop Apache."""
    control = f"/dev/shm/overtake-overload-{os.getpid()}-{arm}"
    cp = None if arm == "plain" else CpuPriority(
        levels=(0.5,), nice=("idle",), control_file=control, stage_hold=600.0, stage_abort_on_close=arm != "serve",
        stage_lifo_after=args.lifo_after if arm == "newest" else 0.0, stages=(("capped", "^/stage1$"), ("other", "^/stage2$")))
    inst = apache.start(tmp / arm, f"127.0.0.1:{free_port()}", cpu=core, max_workers=256, cpu_priority=cp,
                        mpm=args.mpm)
    try:
        if cp is not None:
            _put_table(inst, control, args.cap)
        host, port = apache.parse_listen(inst.listen)
        path = f"/stage1?work={args.work}"
        answered: list[float] = []
        lock = threading.Lock()

        def client() -> None:
            took = _get(host, port, path, args.patience)
            if took is not None:
                with lock:
                    answered.append(took)

        threads = []
        n = round(args.rate * args.seconds)
        with _busy(args.other_load, core):
            t0 = time.monotonic()
            for i in range(n):
                delay = t0 + i / args.rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                threads.append(threading.Thread(target=client, daemon=True))
                threads[-1].start()
            back = _get(host, port, path, 600)  # sent when the arrivals stop: how soon new work is served
        for t in threads:
            t.join(args.patience + 5)
        log = Path(inst.workdir) / "logs" / "access.log"
        time.sleep(1)  # a dropped request's log line follows its client's close
        codes = re.findall(rf'"GET {re.escape(path)} HTTP/1\.1" (\d+) ', log.read_text())  # not the start's probe
    finally:
        apache.stop(inst.workdir, graceful=False)
        for p in (control, control + ".key"):
            Path(p).unlink(missing_ok=True)
    answered.sort()
    return {"sent": n, "answered_in_time": len(answered), "handlers_run": codes.count("200") - 1,
            "dropped": codes.count("499"), "recovery_s": back,
            "answered_mean_s": statistics.fmean(answered) if answered else None,
            "answered_p99_s": answered[min(len(answered) - 1, int(0.99 * len(answered)))] if answered else None}


@contextlib.contextmanager
def _busy(n: int, core: int) -> Iterator[None]:
    """``n`` busy loops at nice 0 on ``core`` (each in its own session, hence autogroup) meanwhile."""
    procs = [subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", "while True: pass"],
                              start_new_session=True) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()


def section(args: argparse.Namespace) -> str:
    """The BENCHMARKS.md section a run's write-up goes to: one per setting that changes the claim.

    >>> section(argparse.Namespace(patience=2.0, mpm="event", other_load=0))
    'overload'
    >>> section(argparse.Namespace(patience=60.0, mpm="prefork", other_load=2))
    'overload-patience-60-prefork-load-2'
    """
    name = "overload" if args.patience == 2.0 else f"overload-patience-{args.patience:g}"
    if args.mpm != "event":
        name += f"-{args.mpm}"
    if args.other_load:
        name += f"-load-{args.other_load}"
    return name


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure: the median and the range over the runs.

    >>> summarize([{"answered_in_time": 5, "recovery_s": 2.0}, {"answered_in_time": 7, "recovery_s": 3.0}])
    {'answered_in_time': {'median': 6.0, 'min': 5, 'max': 7}, 'recovery_s': {'median': 2.5, 'min': 2.0, 'max': 3.0}}
    """
    out = {}
    for k in runs[0]:
        vals = [r[k] for r in runs if r[k] is not None]
        out[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else None
    return out


def report(res: dict[str, Any]) -> str:
    a = res["args"]
    lines = ["## Module mode under overload from clients that give up", "",
             f"Date {res['date']}, machine: {res['machine']}; command: `{res['command']}`. Apache "
             f"(mpm_{a.get('mpm', 'event')}) on one core"
             + (f" beside {a['other_load']} busy loops at nice 0" if a.get("other_load") else "") + ", "
             f"{a['rate']:g} requests/s of {a['work']:g} s CPU each for {a['seconds']:g} s, clients closing after "
             f"{a['patience']:g} s; module mode caps the stage at {a['cap']} running (newest: newest first once "
             f"its queue has stood {a['lifo_after']:g} s). Median (range) over {a['runs']} runs.", "",
             "| arm | answered in time | their mean / p99 s | handlers run | dropped | next request after, s |",
             "|---|---:|---:|---:|---:|---:|"]
    for arm, s in res["summary"].items():
        def f(k: str, fmt: str = "{:g}", _s: dict[str, Any] = s) -> str:
            v = _s[k]
            return "–" if v is None else f"{fmt.format(v['median'])} ({fmt.format(v['min'])}–{fmt.format(v['max'])})"
        lines.append(f"| {arm} | {f('answered_in_time')} | {f('answered_mean_s', '{:.2f}')} / "
                     f"{f('answered_p99_s', '{:.2f}')} | {f('handlers_run')} | {f('dropped')} | "
                     f"{f('recovery_s', '{:.2f}')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=15.0, help="arrivals a second (default 15)")
    ap.add_argument("--seconds", type=float, default=20.0, help="how long they arrive (default 20)")
    ap.add_argument("--patience", type=float, default=2.0, help="seconds a client waits for its answer (default 2)")
    ap.add_argument("--work", type=float, default=0.1, help="CPU seconds of each request (default 0.1)")
    ap.add_argument("--cap", type=int, default=2, help="module mode: the stage's running cap (default 2)")
    ap.add_argument("--lifo-after", type=float, default=0.5,
                    help="arm newest: OvertakeStageLifoAfter, seconds (default 0.5)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each arm, interleaved (default 3)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--mpm", default="event", help="Apache's MPM: event (default) or prefork")
    ap.add_argument("--other-load", type=int, default=0,
                    help="busy loops at nice 0 on Apache's core during each run (default 0)")
    add_output_arguments(ap)
    args = ap.parse_args(argv)
    arms = [x.strip() for x in args.arms.split(",") if x.strip()]
    if not arms or any(x not in ARMS for x in arms):
        ap.error(f"--arms: give some of {', '.join(ARMS)}, e.g. --arms plain,drop")
    for name, lo, hi in (("rate", 0.1, 200), ("seconds", 1, 600), ("patience", 0.1, 60), ("work", 0.001, 5),
                         ("lifo_after", 0.001, 3600)):
        if not lo <= getattr(args, name) <= hi:
            ap.error(f"--{name.replace('_', '-')}: must be in [{lo:g}, {hi:g}], got {getattr(args, name):g}")
    if not 1 <= args.cap <= 8:
        ap.error(f"--cap: must be in 1..8, got {args.cap}")
    if not 1 <= args.runs <= 20:
        ap.error(f"--runs: must be in 1..20, got {args.runs}")
    if args.mpm not in ("event", "prefork"):
        ap.error(f"--mpm: give event or prefork, got {args.mpm!r}")
    if not 0 <= args.other_load <= 8:
        ap.error(f"--other-load: must be in 0..8 busy loops, got {args.other_load}")
    if os.geteuid() != 0:
        raise SystemExit("overload: needs root (Apache's children run as www-data)")
    if shutil.which("apxs") is None:
        raise SystemExit("overload: apxs not found: apt-get install apache2-dev "
                         "(apache-conf/install-debian-packages.sh installs it)")
    core = sorted(os.sched_getaffinity(0))[-1]
    tmp = scratch_dir("overtake-overload-")
    tmp.chmod(0o755)
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    try:
        for k in range(args.runs):
            for arm in arms:
                runs[arm].append(one_run(arm, args, tmp / f"run{k}", core))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "machine": machine(),
           "command": command_line(argv), "args": {k: getattr(args, k) for k in ("rate", "seconds", "patience", "work",
                                                                                "cap", "lifo_after", "runs", "mpm",
                                                                                "other_load")},
           "runs": runs, "summary": {arm: summarize(r) for arm, r in runs.items()}}
    # patient clients (where newest first costs the oldest), prefork, other load: a section each
    publish(args, section(args), report(res), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
