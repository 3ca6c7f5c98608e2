"""mod_overtake_prio's cost per request counted, not timed: instructions and simulated cache misses.

    python bench/module_cost.py [--kinds age,module-mode] [--seconds 25] [--record] [--json] [--no-write]

Timing the module on a tiny static request resolves a 2 % difference only with many paired
windows, and reads differently when Apache has its core to itself than when it shares it. This
bench counts instead. Each kind of Apache (the private one, ``apache2 -X``: one child with its
threads) runs under valgrind's callgrind with cache and branch simulation (``--cache-sim=yes
--branch-sim=yes``: valgrind takes the host's L1 geometry) pinned to one core, while
``wrk -t1 -c8`` on the other fetches a 13-byte static file, twice: 5 s, then ``--seconds``. Per
request is the difference of the two runs' totals over the difference of their requests, so
start-up and exit cancel. Kinds:

- ``plain``: Apache without the module (always measured: the others are compared with it);
- ``class``: the module with age priority off (class priority only: nothing to watch);
- ``age``: the module's defaults (age priority: levels 5 ms / 50 ms, 1 ms interval);
- ``module-mode``: age priority and the static file a stage with a count table in force that never
  holds (as ``bench/cpu_priority.py --module-mode``).

Events, per request: instructions (``Ir``), L1 instruction-fetch misses (``I1mr``), L1 data read
and write misses (``D1mr``, ``D1mw``), mispredicted conditional and indirect branches (``Bcm``,
``Bim``); and the same for the module's own code alone (its object's functions, exclusive).
Under valgrind Apache serves requests many times more slowly, so work done per unit of time
(the monitor's passes, every ``OvertakePrioInterval``) weighs as many times more per request than
at full speed: it is reported apart (``monitor``: the passes a request start makes and the monitor
thread's), and left out of ``module_code_less_monitor``.

Appends the run to ``bench/results/module_cost.jsonl`` and its write-up to
``bench/results/sections.md`` with ``--record``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from _report import add_output_arguments, command_line, machine, publish
from _wrk import wrk
from cpu_priority import module_mode_priority, put_table

from overtake.controller.harness import apache
from overtake.controller.harness.apache.cpu_priority import CpuPriority
from overtake.controller.harness.apache.lifecycle import APACHE_BIN
from overtake.controller.harness.scratch import free_port, scratch_dir

#: the events reported, as callgrind names them
EVENTS = ("Ir", "I1mr", "D1mr", "D1mw", "Bcm", "Bim")
KINDS = ("class", "age", "module-mode")
MODULE_OBJECT = "mod_overtake_prio.so"
#: functions of the monitor's passes (time-driven work, over-weighted under valgrind: see above)
MONITOR_FUNCTIONS = ("monitor_scan", "op_monitor_pass_due", "monitor_main", "pass", "arm", "count_late")
SHORT_SECONDS = 5
URL_PATH = "/static/hello.txt"


def callgrind_totals(path: Path) -> dict[str, int]:
    """A callgrind output file's event totals (its ``events:`` and ``summary:``/``totals:`` lines).

    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "cg.out"
    >>> _ = p.write_text("version: 1\\nevents: Ir I1mr D1mr\\nfn=(1) f\\n0 5 1 0\\nsummary: 100 7 3\\n")
    >>> callgrind_totals(p)
    {'Ir': 100, 'I1mr': 7, 'D1mr': 3}
    """
    events: list[str] = []
    totals: list[int] = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith(("summary:", "totals:")):
            totals = [int(x) for x in line.split()[1:]]
    if not events or len(totals) != len(events):
        raise RuntimeError(f"{path}: no callgrind events and totals (an interrupted run?)")
    return dict(zip(events, totals, strict=True))


def function_costs(annotated: str, events: tuple[str, ...]) -> dict[tuple[str, str], list[int]]:
    """Exclusive costs by (object, function) from ``callgrind_annotate --show=E1,E2,...`` output
    (its columns in ``events``' order; ``.`` is 0).

    >>> text = (" 1,200 (1.0%)  30 (0.5%)  .           op_prio.c:op_end_filter [/x/mod_overtake_prio.so]\\n"
    ...         " 9,000 (7.0%)  90 (2.0%)  4 (0.1%)    ???:apr_palloc [/usr/lib/libapr-1.so.0]\\n")
    >>> function_costs(text, ("Ir", "I1mr", "D1mr"))[("mod_overtake_prio.so", "op_end_filter")]
    [1200, 30, 0]
    """
    cell = r"([\d,]+|\.)(?: \([^)]*\))?"
    row = re.compile(r"^\s*" + r"\s+".join([cell] * len(events)) + r"\s+(\S.*)$")
    out: dict[tuple[str, str], list[int]] = {}
    for line in annotated.splitlines():
        m = row.match(line)
        if not m or "PROGRAM TOTALS" in line:
            continue
        values = [0 if v == "." else int(v.replace(",", "")) for v in m.groups()[:len(events)]]
        name = m.groups()[-1]
        obj = name.rsplit(" [", 1)[1].rstrip("]").rsplit("/", 1)[-1] if " [" in name else "?"
        fn = name.split(" [", 1)[0].rsplit(":", 1)[-1].split("'")[0]
        acc = out.setdefault((obj, fn), [0] * len(events))
        for i, v in enumerate(values):
            acc[i] += v
    return out


def per_request(short: Mapping[str, float], long: Mapping[str, float], n_short: int, n_long: int) -> dict[str, float]:
    """(long − short) / (n_long − n_short) per event: start-up and exit cancel.

    >>> per_request({"Ir": 1000 + 5 * 10}, {"Ir": 1000 + 5 * 30}, 10, 30)
    {'Ir': 5.0}
    """
    if n_long <= n_short:
        raise RuntimeError(f"the long run served {n_long} requests, the short one {n_short}: raise --seconds")
    return {e: (long[e] - short[e]) / (n_long - n_short) for e in long}


def _cpu_priority(kind: str) -> CpuPriority | None:
    if kind == "plain":
        return None
    if kind == "class":
        return CpuPriority(age=False)
    if kind == "age":
        return CpuPriority()
    return module_mode_priority(0)  # as bench/cpu_priority.py --module-mode


def _one_run(kind: str, conf: Path, port: int, seconds: int, out: Path, cores: tuple[int, int]) -> int:
    """Apache under callgrind for one wrk window; the requests served (the output written at exit)."""
    out.touch()
    shutil.chown(out, "www-data", "www-data")  # the child writes it at exit, as Apache's user
    out.chmod(0o666)
    proc = subprocess.Popen(["taskset", "-c", str(cores[0]), "valgrind", "--tool=callgrind", "--cache-sim=yes",
                             "--branch-sim=yes", f"--callgrind-out-file={out}", APACHE_BIN, "-X", "-f", str(conf)],
                            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}{URL_PATH}"
    try:
        deadline = time.monotonic() + 180
        while subprocess.run(["curl", "-s", "-o", "/dev/null", "-m", "5", url]).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{kind}: Apache under valgrind did not answer on port {port}")
            time.sleep(1)
        run = wrk(url, 8, seconds, cores[1])
        if run["non2xx"]:
            raise RuntimeError(f"{kind}: {run['non2xx']:.0f} answers were not 2xx")
        return int(run["requests"])
    finally:
        proc.terminate()
        proc.wait(120)


def measure(kind: str, tmp: Path, seconds: int, cores: tuple[int, int]) -> dict[str, Any]:
    """One kind: its per-request totals, its module's own code and the monitor's part."""
    port = free_port()
    cp = _cpu_priority(kind)
    inst = apache.start(tmp / kind / "wd", f"127.0.0.1:{port}", max_workers=64, cpu_priority=cp)
    runs = {}
    try:
        try:
            if cp is not None and cp.control_file:
                put_table(inst, cp.control_file, 32)  # the file stays for the runs under valgrind
        finally:
            apache.stop(inst.workdir, graceful=False)
        conf = Path(inst.workdir) / "httpd.conf"
        for label, secs in (("short", SHORT_SECONDS), ("long", seconds)):
            out = tmp / f"{kind}-{label}.cg"
            n = _one_run(kind, conf, port, secs, out, cores)
            annotated = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", "--auto=no",
                                        f"--show={','.join(EVENTS)}", str(out)], capture_output=True, text=True,
                                       check=True).stdout
            runs[label] = (n, callgrind_totals(out), function_costs(annotated, EVENTS))
    finally:
        if cp is not None and cp.control_file:
            for suffix in ("", ".key"):
                Path(cp.control_file + suffix).unlink(missing_ok=True)
    (n0, tot0, fn0), (n1, tot1, fn1) = runs["short"], runs["long"]
    def part(select: Any) -> dict[str, float]:
        a = {e: float(sum(v[i] for k, v in fn0.items() if select(k))) for i, e in enumerate(EVENTS)}
        b = {e: float(sum(v[i] for k, v in fn1.items() if select(k))) for i, e in enumerate(EVENTS)}
        return per_request(a, b, n0, n1)
    total = per_request({e: float(tot0[e]) for e in EVENTS}, {e: float(tot1[e]) for e in EVENTS}, n0, n1)
    module = part(lambda k: k[0] == MODULE_OBJECT)
    monitor = part(lambda k: k[0] == MODULE_OBJECT and k[1] in MONITOR_FUNCTIONS)
    return {"requests": [n0, n1], "per_request": total, "module_code": module, "monitor": monitor,
            "module_code_less_monitor": {e: module[e] - monitor[e] for e in EVENTS}}


def report(res: dict[str, Any]) -> str:
    plain = res["kinds"]["plain"]["per_request"]
    lines = ["## mod_overtake_prio's cost per request, counted (callgrind)", "",
             f"Date {res['date']}, machine: {res['machine']}; command: `{res['command']}`. Per request of a "
             f"13-byte static file, `apache2 -X` under callgrind with cache and branch simulation, wrk -c8; "
             f"(long − short run) / (their requests' difference). In brackets: against plain Apache. The "
             f"monitor's passes (time-driven) weigh more per request under valgrind, which serves requests "
             f"many times more slowly, than at full speed: shown apart.", "",
             "| kind | instructions | L1 I misses | L1 D read misses | branch mispredicts | the monitor's passes: "
             "instructions, I, D misses | the module's other code: instructions, I, D misses |",
             "|---|---:|---:|---:|---:|---|---|"]
    for kind, r in res["kinds"].items():
        p, mon, own = r["per_request"], r["monitor"], r["module_code_less_monitor"]
        def d(e: str, _p: Mapping[str, float] = p, _kind: str = kind) -> str:
            return f"{_p[e]:,.0f}" + ("" if _kind == "plain" else f" ({_p[e] - plain[e]:+,.0f}, "
                                      f"{100 * (_p[e] / plain[e] - 1):+.1f} %)")
        def t(m: Mapping[str, float], _kind: str = kind) -> str:
            return "" if _kind == "plain" else f"{m['Ir']:,.0f}, {m['I1mr']:.0f}, {m['D1mr']:.0f}"
        lines.append(f"| {kind} | {d('Ir')} | {d('I1mr')} | {d('D1mr')} | {p['Bcm'] + p['Bim']:,.0f} | "
                     f"{t(mon)} | {t(own)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help=f"comma-separated, of {', '.join(KINDS)} (plain Apache is always measured)")
    ap.add_argument("--seconds", type=int, default=25, help=f"the long wrk window (the short one is {SHORT_SECONDS} s)")
    add_output_arguments(ap)
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if bad := [k for k in kinds if k not in KINDS]:
        ap.error(f"--kinds: {', '.join(bad)} is not one of {', '.join(KINDS)}")
    if args.seconds <= SHORT_SECONDS:
        ap.error(f"--seconds: must exceed the short window ({SHORT_SECONDS} s), e.g. 25")
    if os.geteuid() != 0:
        raise SystemExit("module_cost: needs root (Apache's child runs as www-data)")
    for tool, package in (("valgrind", "valgrind"), ("callgrind_annotate", "valgrind"), ("wrk", "wrk"),
                          ("apxs", "apache2-dev"), ("taskset", "util-linux"), ("curl", "curl")):
        if shutil.which(tool) is None:
            raise SystemExit(f"module_cost: {tool} not found: apt-get install {package} "
                             "(apache-conf/install-debian-packages.sh installs it)")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("module_cost: needs two cores (Apache under valgrind on one, wrk on the other)")
    tmp = scratch_dir("overtake-module-cost-")
    tmp.chmod(0o755)
    try:
        results = {k: measure(k, tmp, args.seconds, (cpus[-1], cpus[0])) for k in ("plain", *kinds)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "machine": machine(),
           "command": command_line(argv), "seconds": args.seconds, "kinds": results}
    publish(args, "module-cost", report(res), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
