"""``overtake uplink install|show|remove``: the uplink's priority qdisc (controller.uplink.qdisc).

::

    overtake uplink install --dev IFACE [--netns NS] [--mode auto|htb|tbf] [--rate 10mbit] [--dry-run]
    overtake uplink show    --dev IFACE [--netns NS] [--json]
    overtake uplink remove  --dev IFACE [--netns NS] [--dry-run]

Exit codes: 0 done (or nothing to do), 1 tc/ethtool failed or no CAP_NET_ADMIN (the message
names the fallback: ``--uplink app``), 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from overtake.controller.uplink import qdisc

#: overtake.controller.uplink.qdisc.MODES, written out so that parsing the options imports nothing of the
#: controller (tests/api/test_cli_startup.py checks they agree)
MODES = ("htb", "tbf")


def register(subparsers: Any) -> None:
    """Add the ``uplink`` sub-command."""
    p = subparsers.add_parser(
        "uplink",
        help="install/show/remove the priority qdisc for uplink SRPT (HTB or TBF+pfifo_fast)",
        description="Shape IFACE's egress to --rate with priority bands the sidecar's "
        "--uplink srpt|srrt selects per socket (SO_PRIORITY). auto tries HTB (8 classes, "
        "TSO/GSO off), then TBF + pfifo_fast (3 bands). Needs CAP_NET_ADMIN; --dry-run only "
        "prints the tc commands.",
    )
    act = p.add_subparsers(dest="uplink_action", metavar="ACTION", required=True)
    for name, text in (
        ("install", "install (idempotent: an identical setup is left alone)"),
        ("show", "which arrangement is installed, rate and per-band counters"),
        ("remove", "delete the root qdisc (idempotent)"),
    ):
        a = act.add_parser(name, help=text)
        a.add_argument("--dev", required=True, help="interface, e.g. eth0 or a veth")
        a.add_argument("--netns", default=None, help="network namespace of the interface")
        if name == "install":
            a.add_argument("--mode", choices=("auto", *MODES), default="auto")
            a.add_argument("--rate", default="10mbit", help="egress rate, tc units (10mbit)")
            a.add_argument("--leaf-limit", type=int, default=1000, help="packets per band")
            a.add_argument("--floor", type=float, default=0.0,
                           help="fraction of --rate guaranteed to the lowest band (htb; 0 = "
                                "strict priority, e.g. 0.05)")  # fmt: skip
        if name in ("install", "remove"):
            a.add_argument("--dry-run", action="store_true", help="print the commands only")
        a.add_argument("--json", action="store_true", help="print as JSON")


def _print_result(res: qdisc.InstallResult, args: argparse.Namespace, verb: str) -> None:
    if args.json:
        print(json.dumps(dataclasses.asdict(res)))
        return
    if res.dry_run:
        if res.note:
            print(f"# {res.note}")
        print(res.script())
        return
    where = res.dev + (f" (netns {res.netns})" if res.netns else "")
    if res.changed:
        print(f"{verb} {res.mode} on {where}:")
        print(res.script())
    else:
        print(f"{where}: {res.note or 'nothing to do'}")


def run(args: argparse.Namespace) -> int:
    """Run one action; input errors raise ValueError (exit 2 via the dispatcher)."""
    from overtake.controller.uplink import qdisc
    from overtake.controller.uplink.errors import QdiscError, QdiscPermissionError

    try:
        if args.uplink_action == "install":
            res = qdisc.install(
                args.dev,
                mode=args.mode,
                rate=args.rate,
                netns=args.netns,
                leaf_limit=args.leaf_limit,
                floor=args.floor,
                dry_run=args.dry_run,
            )
            _print_result(res, args, "installed")
            if not res.dry_run:
                print(qdisc.show(args.dev, netns=args.netns).describe())
        elif args.uplink_action == "remove":
            _print_result(qdisc.remove(args.dev, netns=args.netns, dry_run=args.dry_run), args,
                          "removed")  # fmt: skip
        else:
            state = qdisc.show(args.dev, netns=args.netns)
            if args.json:
                d = dataclasses.asdict(state)
                d.pop("raw", None)
                print(json.dumps(d))
            else:
                print(state.describe())
                for c in state.classes:
                    prio = f" prio {c.prio}" if c.prio is not None else ""
                    print(f"  {c.classid}{prio}: {c.bytes} bytes, {c.packets} pkts, "
                          f"{c.drops} dropped")  # fmt: skip
    except QdiscPermissionError as exc:
        print(f"overtake uplink: {exc}", file=sys.stderr)
        return 1
    except QdiscError as exc:
        print(f"overtake uplink: {exc}", file=sys.stderr)
        return 1
    return 0
