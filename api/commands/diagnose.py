"""``overtake diagnose``: is a stage serialised? The verdict per stage from an Apache access log.

::

    overtake diagnose ACCESS_LOG [--stages FILE] [--min-samples N] [--alpha A] [--json]

The log is in the sidecar's ``LOG_FORMAT`` with mod_overtake_prio's request-time split
(``OvertakeRequestTimes On``): each request's handler time as CPU, run-queue wait and blocked
time. Requests are grouped by the stages file's routes (``--stages``, as the sidecar routes them;
unmatched requests are left out) or else by method and URL path. For each group,
:func:`overtake.controller.online.serialisation.detect` says whether its requests are blocked when
another of the group runs beside them while they are not alone (a lock), and how many progress
together at most (the lock's capacity).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from overtake.api.errors import DiagnoseUsageError

if TYPE_CHECKING:
    from overtake.controller.online.serialisation import TimedRequest, Verdict

#: overtake.controller.online.serialisation's MIN_SAMPLES and ALPHA, written out so that parsing the
#: options imports neither numpy nor the detector (tests/api/test_cli_diagnose.py checks they agree)
MIN_SAMPLES = 30
ALPHA = 0.01


def register(subparsers: Any) -> None:
    """Add the ``diagnose`` sub-command."""
    p = subparsers.add_parser(
        "diagnose",
        help="find stages that a lock serialises, from an access log with the request-time split",
        description="Per stage, decide from mod_overtake_prio's request-time split (OvertakeRequestTimes On, "
        "the sidecar's LOG_FORMAT) whether requests are blocked only when another request of the stage runs "
        "beside them (a lock), with the lock's estimated capacity.",
    )
    p.add_argument("log", metavar="ACCESS_LOG", help="Apache access log in the sidecar's LOG_FORMAT")
    p.add_argument("--stages", metavar="FILE", help="the sidecar's stages file (default: group by method and path)")
    p.add_argument("--min-samples", type=int, default=MIN_SAMPLES, metavar="N",
                   help=f"requests needed alone and overlapped, each, for a verdict (default {MIN_SAMPLES})")
    p.add_argument("--alpha", type=float, default=ALPHA, metavar="A",
                   help=f"level of the one-sided test (default {ALPHA:g})")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")


def _check(args: argparse.Namespace) -> None:
    if args.min_samples < 2:
        raise DiagnoseUsageError(f"--min-samples: must be an integer >= 2, e.g. {MIN_SAMPLES}; got {args.min_samples}")
    if not 0 < args.alpha < 1:
        raise DiagnoseUsageError(f"--alpha: must be a level in (0, 1), e.g. {ALPHA:g}; got {args.alpha:g}")


def read_groups(path: str, stages: str | None) -> tuple[dict[str, list[TimedRequest]], int, int]:
    """The log's requests with a time split, by stage (or method and path); with the counts of lines
    in no known format and of lines without the split."""
    from overtake.controller.log_format import LineParser, request_times
    from overtake.controller.online.serialisation import TimedRequest

    table = None
    if stages is not None:
        from overtake.controller.sidecar.stages import load_stages

        table = load_stages(stages)
    parser = LineParser()
    groups: dict[str, list[TimedRequest]] = {}
    bad = no_split = 0
    with Path(path).open(encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            try:
                e = parser.parse(line)
            except ValueError:
                bad += 1
                continue
            t = request_times(e)
            if t is None:
                no_split += 1
                continue
            method, _, rest = str(e["%r"]).partition(" ")
            target = rest.rsplit(" ", 1)[0]
            p, _, q = target.partition("?")
            if table is not None:
                routed = table.route(method, p, q)
                if routed is None:
                    continue
                name = table.names[routed[0]]
            else:
                name = f"{method} {p}"
            groups.setdefault(name, []).append(TimedRequest(
                start=(int(e["%{begin:usec}t"]) + t.start_us) / 1e6, wall=t.wall_us / 1e6, cpu=t.cpu_us / 1e6,
                wait=t.wait_us / 1e6, blocked=t.blocked_us / 1e6))
    return groups, bad, no_split


def run(args: argparse.Namespace) -> int:
    _check(args)
    groups, bad, no_split = read_groups(args.log, args.stages)
    if not groups:
        if bad and not no_split:
            raise DiagnoseUsageError(f"{args.log}: no line matches the sidecar's LOG_FORMAT "
                                     "(overtake.controller.log_format); log with it (LogFormat ... overtake)")
        raise DiagnoseUsageError(
            f"{args.log}: no request carries the request-time split ({no_split} lines without it); load "
            "mod_overtake_prio with `OvertakeRequestTimes On` and log with the sidecar's LOG_FORMAT")
    from overtake.controller.online.serialisation import detect

    verdicts = {name: detect(recs, min_samples=args.min_samples, alpha=args.alpha)
                for name, recs in sorted(groups.items())}
    if args.json:
        print(json.dumps({"stages": {n: v.as_dict() for n, v in verdicts.items()},
                          "lines_unparsed": bad, "lines_without_split": no_split}, indent=2))
        return 0
    _print(verdicts, bad, no_split)
    return 0


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _print(verdicts: dict[str, Verdict], bad: int, no_split: int) -> None:
    width = max(len(n) for n in verdicts)
    print(f"{'stage':<{width}}  verdict          requests  alone  overlapped  blocked alone/overlapped  capacity")
    for name, v in verdicts.items():
        word = {True: "SERIALISED", False: "not serialised", None: "undecided"}[v.serialising]
        cap = "-" if v.capacity is None else f"{v.capacity:.2f}"
        print(f"{name:<{width}}  {word:<15}  {v.requests:>8}  {v.alone:>5}  {v.overlapped:>10}  "
              f"{_pct(v.blocked_alone):>12} / {_pct(v.blocked_overlapped):<11}  {cap:>8}")
    for name, v in verdicts.items():
        print(f"{name}: {v.reason}" + (f"; lock capacity {v.lock_capacity}" if v.lock_capacity else ""))
    if bad or no_split:
        print(f"left out: {bad} lines in no known format, {no_split} without the request-time split",
              file=sys.stderr)
