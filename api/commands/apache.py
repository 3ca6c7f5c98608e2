"""``overtake apache start|stop|status``: the private Apache of :mod:`overtake.controller.harness.apache`.

Benchmarks call exactly::

    overtake apache start --workdir DIR --listen 127.0.0.1:PORT [--cpu CORE] [--max-workers N] [--mpm prefork]
    overtake apache stop --workdir DIR
    overtake apache status --workdir DIR [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from overtake.controller.errors import ApacheError
from overtake.controller.harness import apache


def register(subparsers: Any) -> None:
    """Add the ``apache`` sub-command and its ``start``/``stop``/``status`` actions."""
    p = subparsers.add_parser(
        "apache",
        help="start/stop a private Apache with the CPU stage handler and mod_status",
        description="Private Apache from Debian's apache2 (no system service): stage handler "
        "at /stage1, /stage2 (?work=<seconds of CPU>), mod_status at /server-status, "
        "access log with %%D and the stage CPU in WORKDIR/logs/access.log.",
    )
    act = p.add_subparsers(dest="apache_action", metavar="ACTION", required=True)

    s = act.add_parser("start", help="render, test and start; return when it serves")
    s.add_argument("--workdir", required=True, help="instance directory (created if missing)")
    s.add_argument("--listen", required=True, help="IP:PORT, e.g. 127.0.0.1:8081")
    s.add_argument("--cpu", type=int, default=None, help="pin Apache to this core (taskset)")
    s.add_argument(
        "--max-workers",
        type=int,
        default=64,
        help="MaxRequestWorkers: the policy's max threads plus margin (default 64)",
    )
    s.add_argument("--mpm", choices=["event", "prefork"], default="event",
                   help="Apache's MPM: event (default, one child of --max-workers threads) or prefork "
                   "(one process per worker, a few started, as a stock Debian Apache with mod_php)")
    s.add_argument(
        "--no-raise-priority",
        dest="raise_priority",
        action="store_false",
        help="do not write -20 to /proc/<pid>/autogroup (default: do, when root)",
    )
    s.add_argument("--cpu-priority-levels", default=None, metavar="SECONDS[,SECONDS...]",
                   help="load mod_overtake_prio (per-request CPU priority of the worker threads, built with apxs): "
                   "thread-CPU seconds at which a request drops a level (OvertakePrioLevels), e.g. 0.02")
    s.add_argument("--cpu-priority-nice", default=None, metavar="N|idle[,...]",
                   help="per level a nice increment 1..19 or idle (SCHED_IDLE, last level only); "
                   "default 10 for each level but the last, idle for the last")
    s.add_argument("--cpu-priority-class-only", action="store_true",
                   help="no demotion by attained CPU: only the X-Overtake-Class header sets a level")
    s.add_argument("--gate", default=None, metavar="PATH",
                   help="mod_overtake_prio's admission gate on the sidecar's --gate file (OvertakeGate), e.g. "
                   "/dev/shm/overtake-gate; without --cpu-priority-levels the module loads for the gate only "
                   "(no demotion by age, an idle level for --gate-backfill); the key is PATH.key, created at start "
                   "when missing")
    s.add_argument("--control-file", default=None, metavar="PATH",
                   help="with --cpu-priority-levels: mod_overtake_prio reads the age thresholds of the sidecar's "
                   "policy from PATH (OvertakeControlFile; the sidecar's --control-file) and applies them instead "
                   "of --cpu-priority-levels while the file is valid; the key is PATH.key, created at start when missing")
    s.add_argument("--json", action="store_true", help="print the instance as JSON")

    t = act.add_parser("stop", help="graceful stop; return when the processes have exited")
    t.add_argument("--workdir", required=True)
    t.add_argument("--timeout", type=float, default=15.0, help="seconds (default 15)")
    t.add_argument("--now", action="store_true", help="SIGTERM at once instead of graceful")

    q = act.add_parser("status", help="mod_status ?auto of the running instance")
    q.add_argument("--workdir", required=True)
    q.add_argument("--json", action="store_true", help="print as JSON")


def _cpu_priority(args: argparse.Namespace) -> apache.CpuPriority | None:
    """mod_overtake_prio's settings from the flags, or None (module not loaded)."""
    gate = getattr(args, "gate", None)
    if args.cpu_priority_levels is None:
        if args.cpu_priority_nice is not None or args.cpu_priority_class_only:
            raise ValueError("--cpu-priority-nice/--cpu-priority-class-only: give --cpu-priority-levels too, "
                             "e.g. --cpu-priority-levels 0.02")
        if getattr(args, "control_file", None) is not None:
            raise ValueError("--control-file: give --cpu-priority-levels too (the thresholds in force while the "
                             "file is absent or invalid), e.g. --cpu-priority-levels 0.005 --cpu-priority-nice idle")
        if gate is not None:  # the gate alone: an idle level for idle starts, no age demotion
            return apache.CpuPriority(levels=(3600.0,), nice=("idle",), age=False, gate=gate)
        return None
    try:
        levels = tuple(float(x) for x in args.cpu_priority_levels.split(","))
    except ValueError:
        raise ValueError(f"--cpu-priority-levels: comma-separated seconds of thread CPU such as 0.02 or "
                         f"0.005,0.05, got {args.cpu_priority_levels!r}") from None
    nice: tuple[int | str, ...] | None = None
    if args.cpu_priority_nice is not None:
        nice = tuple(x if x == "idle" else int(x) if x.lstrip("-").isdigit() else x
                     for x in args.cpu_priority_nice.split(","))
    # CpuPriority checks every field and names it (an ApacheInputError, a ValueError)
    return apache.CpuPriority(levels=levels, nice=nice, age=not args.cpu_priority_class_only, gate=gate,
                              control_file=getattr(args, "control_file", None))


def run(args: argparse.Namespace) -> int:
    """Run one action; 0 on success, 1 on an Apache error (input errors raise ValueError)."""
    try:
        if args.apache_action == "start":
            inst = apache.start(
                args.workdir,
                args.listen,
                cpu=args.cpu,
                max_workers=args.max_workers,
                raise_priority=args.raise_priority,
                cpu_priority=_cpu_priority(args),
                mpm=args.mpm,
            )
            if args.json:
                print(json.dumps(dataclasses.asdict(inst)))
            else:
                prio = (
                    f"autogroup nice {inst.autogroup_nice}"
                    if inst.autogroup_nice is not None
                    else "autogroup priority not raised (needs root)"
                )
                pin = f"cpu {inst.cpu}" if inst.cpu is not None else "not pinned"
                print(
                    f"apache started: pid {inst.pid} (children {list(inst.child_pids)}), "
                    f"{inst.base_url}, {inst.mpm} max_workers {inst.max_workers}, {pin}, {prio}; "
                    f"logs in {inst.workdir}/logs"
                )
        elif args.apache_action == "stop":
            stopped = apache.stop(args.workdir, timeout=args.timeout, graceful=not args.now)
            print("apache stopped" if stopped else f"apache: not running in {args.workdir}")
        else:
            st = apache.status(args.workdir)
            if args.json:
                print(json.dumps(st))
            else:
                for key, value in st.items():
                    print(f"{key}: {value}")
    except ValueError:
        raise  # input errors: the dispatcher prints them and exits 2
    except ApacheError as exc:
        print(f"overtake apache {args.apache_action}: error: {exc}", file=sys.stderr)
        return 1
    return 0
