"""Hand-over: how long Apache's core idles between two requests the sidecar admits one after
the other (why count-only policies keep less of the model's gain than the twin).

    python bench/handover.py [--work 0.005] [--requests 60] [--clients 4] [--rounds 5] [--json] [--no-write]

A limit of one thread (``--policy "pi(1)"``) with ``--clients`` closed-loop clients, each asking
``/stage1?work=W`` (W seconds of thread CPU) back to back: a request always waits in the
sidecar, and enters Apache only once the previous one's response has reached the sidecar. The
cycle per request is W + Apache's own per-request cost + the hand-over; the same clients
straight to Apache (processor sharing: Apache never idles between requests) give W + Apache's
own cost. So

    hand-over = (wall / request via the sidecar with pi(1)) − (wall / request direct, PS).

The model (and the ideal twin) count the hand-over as zero: the next request starts the moment
a thread frees. ``sidecar-gate-pi1`` is the same through a second sidecar with mod_overtake_prio's
admission gate (``--gate``): a waiting request is in Apache already, held on a futex, and its
admission is a wake-up; with ``--gate-backfill 1`` (the sidecar's default) the oldest waiting
request also runs meanwhile under SCHED_IDLE (Apache loads the module for every mode, with its
age levels off, so the modes share Apache's per-request cost). One client straight to Apache (``direct-serial``) shows the same gap for a
client's own round trip. Apache is pinned to the last core at autogroup −20; the sidecar and
the clients share core 0 in this process's raised autogroup. Rounds alternate the modes; the
figures are medians over rounds. The run is appended to bench/results/handover.jsonl and
replaces the ``handover`` write-up in bench/results/sections.md unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _report import autogroup_nice, command_line, machine, write_section

from overtake.controller.harness import apache
from overtake.controller.harness.loadgen import wait_sidecar
from overtake.controller.harness.scratch import free_port, scratch_dir

STAGES = 'stages:\n  - name: stage1\n    path: "^/stage1$"\n'


def cycle_ms(port: int, clients: int, requests: int, work: float) -> float:
    """Wall milliseconds per request beyond ``work``, ``clients`` closed loops of ``requests`` each."""
    done: list[int] = []
    errors: list[str] = []

    def client() -> None:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            for _ in range(requests):
                c.request("GET", f"/stage1?work={work}")
                r = c.getresponse()
                r.read()
                if r.status != 200:
                    errors.append(f"status {r.status}")
                    return
                done.append(1)
        finally:
            c.close()

    ts = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.monotonic() - t0
    if errors:
        raise SystemExit(f"handover: a request failed ({errors[0]})")
    return (wall / len(done) - work) * 1e3


def run(args: argparse.Namespace) -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("handover: needs two cores (Apache on one, the sidecar and the clients on the other)")
    server_core, client_core = cores[-1], cores[0]
    tmp = scratch_dir("overtake-handover-")
    gate_file = f"/dev/shm/overtake-handover-gate-{os.getpid()}"
    # age off, no class header: the module only gates (the same Apache for every mode)
    prio = apache.CpuPriority(levels=(3600.0,), nice=("idle",), age=False, class_header=None, gate=gate_file)
    inst = apache.start(tmp / "apache", f"127.0.0.1:{free_port()}", cpu=server_core, max_workers=16 + args.clients,
                        cpu_priority=prio)
    os.sched_setaffinity(0, {client_core})
    sides: list[subprocess.Popen[bytes]] = []
    log_file = (tmp / "sidecar.log").open("w")
    try:
        (tmp / "stages.yaml").write_text(STAGES)
        log = tmp / "sidecar.log"
        ports = []
        for extra in ([], ["--gate", gate_file, "--gate-slots", str(args.clients), "--gate-backfill",
                           str(args.gate_backfill), "--status-interval", "0.2"]):
            ports.append(free_port())
            sides.append(subprocess.Popen(
                ["taskset", "-c", str(client_core), sys.executable, "-m", "overtake.api.cli", "sidecar", "--policy",
                 "pi(1)", "--apache", inst.base_url, "--listen", f"127.0.0.1:{ports[-1]}", "--stages",
                 str(tmp / "stages.yaml"), "--admin-listen", f"127.0.0.1:{free_port()}", *extra],
                stdout=subprocess.DEVNULL, stderr=log_file))
            wait_sidecar(ports[-1], sides[-1], log)
        direct = apache.parse_listen(inst.listen)[1]
        modes = {"sidecar-pi1": (ports[0], args.clients), "sidecar-gate-pi1": (ports[1], args.clients),
                 "direct-ps": (direct, args.clients), "direct-serial": (direct, 1)}
        for p in ports:
            cycle_ms(p, args.clients, 10, args.work)  # warm-up: connections, Lua states
        st0 = apache.fetch_prio_status(*apache.parse_listen(inst.listen))
        if not st0.gate_held + st0.gate_idle_starts:
            raise SystemExit(f"handover: the gate held no request in the warm-up; sidecar log: {log.read_text()[-800:]}")
        rounds: dict[str, list[float]] = {m: [] for m in modes}
        load = []
        for r in range(args.rounds):
            names = list(modes)
            for m in names[r % 4:] + names[: r % 4]:
                p, k = modes[m]
                load.append(os.getloadavg()[0])
                rounds[m].append(cycle_ms(p, k, args.requests, args.work))
        st = apache.fetch_prio_status(*apache.parse_listen(inst.listen))
    finally:
        for side in sides:
            side.terminate()
            side.wait(15)
        log_file.close()
        apache.stop(inst.workdir, graceful=False)
        os.sched_setaffinity(0, set(cores))
        shutil.rmtree(tmp, ignore_errors=True)
        for f in (gate_file, gate_file + ".key"):  # the module and the sidecar make both
            Path(f).unlink(missing_ok=True)
    med = {m: statistics.median(v) for m, v in rounds.items()}
    per_round = [s - d for s, d in zip(rounds["sidecar-pi1"], rounds["direct-ps"])]
    per_round_gate = [s - d for s, d in zip(rounds["sidecar-gate-pi1"], rounds["direct-ps"])]
    return {"work_s": args.work, "clients": args.clients, "requests_per_client": args.requests,
            "rounds": rounds, "median_ms": med, "handover_ms_per_round": per_round,
            "handover_ms": statistics.median(per_round),
            "handover_gate_ms_per_round": per_round_gate, "handover_gate_ms": statistics.median(per_round_gate),
            "gate": {"held": st.gate_held, "wait_s": st.gate_wait_s, "timeouts": st.gate_timeouts,
                     "stale": st.gate_stale, "cancels": st.gate_cancels, "aborts": st.gate_aborts,
                     "idle_starts": st.gate_idle_starts, "promotions": st.gate_promotions},
            "gate_backfill": args.gate_backfill,
            "client_round_trip_ms": med["direct-serial"] - med["direct-ps"],
            "load_average_median": statistics.median(load), "autogroup_nice": autogroup_nice()}


def summary(res: dict[str, Any], command: str, when: str | None = None, mach: str | None = None) -> str:
    m = res["median_ms"]
    return "\n".join([
        f"`{command}`, {when or time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {mach or machine()}, load {res['load_average_median']:.1f} "
        f"(median). {res['clients']} closed-loop clients, {res['work_s'] * 1e3:g} ms of thread CPU per request, Apache on the "
        "last core: wall per request beyond the work, medians of the rounds — through the sidecar with a one-thread "
        f"limit `pi(1)` {m['sidecar-pi1']:.3f} ms, straight to Apache (processor sharing, no idle gap) "
        f"{m['direct-ps']:.3f} ms, one client straight to Apache {m['direct-serial']:.3f} ms. Conclusion: each admission "
        f"leaves Apache's core idle **{res['handover_ms']:.3f} ms** (per round "
        + ", ".join(f"{x:.3f}" for x in res["handover_ms_per_round"])
        + ") while the response reaches the sidecar, the sidecar releases the next request and Apache wakes a worker "
        f"for it; the model and the ideal twin count 0. With the admission gate in Apache (`--gate`) "
        f"{m['sidecar-gate-pi1']:.3f} ms per request: **{res['handover_gate_ms']:.3f} ms** per admission (per round "
        + ", ".join(f"{x:.3f}" for x in res["handover_gate_ms_per_round"])
        + f"; --gate-backfill {res['gate_backfill']}: {res['gate']['held']} requests released from the gate, "
        f"{res['gate']['idle_starts']} started early under SCHED_IDLE, {res['gate']['timeouts']} timeouts).",
    ])


def section(res: dict[str, Any], command: str, when: str | None = None, mach: str | None = None) -> str:
    return ("## handover: Apache's idle time per admission, with and without the admission gate\n\n"
            + summary(res, command, when, mach))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=float, default=0.005, help="seconds of thread CPU per request")
    ap.add_argument("--requests", type=int, default=60, help="requests per client per round")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gate-backfill", type=int, default=1,
                    help="the gated sidecar's --gate-backfill (0: requests only wait in the gate)")
    ap.add_argument("--json", action="store_true", help="print the run as JSON")
    ap.add_argument("--no-write", action="store_true", help="do not append to bench/results/handover.jsonl")
    args = ap.parse_args()
    if os.geteuid() == 0:
        try:  # as the other Apache benches: other jobs' autogroups would own core 0's tail
            Path("/proc/self/autogroup").write_text("-20")
        except OSError:
            pass
    res = run(args)
    command = command_line()
    print(json.dumps(res, indent=1) if args.json else summary(res, command))
    if not args.no_write:
        write_section("handover", section(res, command), run=res, bench="handover", command=command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
