"""``overtake sidecar``: enforce a thread policy in front of an unmodified Apache (issue #5).

Benchmarks call exactly::

    overtake sidecar --policy (FILE | "pi(k)" | "pi(k1,k2)" | passthrough) --apache URL
                     --listen ADDR --stages FILE [--phase-header NAME] [--uplink fair]
                     [--online [--refit-interval S] [--min-samples N] [--arrival-window S]
                      [--access-log PATH] [--swap-margin F] [--refit-tolerance F]]
    overtake sidecar --policy-url http://API/v1/models/ID/policy.npz [--policy-poll 10]
                     [--policy-token TOKEN] [--policy FALLBACK] --apache URL --listen ADDR --stages FILE
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

from overtake.controller.errors import SidecarInputError
from overtake.controller.online import OnlineSettings
from overtake.controller.sidecar import Sidecar, SidecarOptions, configure_logging
from overtake.controller.stages import load_stages
from overtake.controller.uplink.bands import TOP_FRACTION


def register(subparsers: Any) -> None:
    """Add the ``sidecar`` sub-command."""
    p = subparsers.add_parser(
        "sidecar",
        help="reverse proxy that releases requests to Apache exactly when the policy starts a thread",
        description="Hold each request in its stage queue and release it to Apache when the policy "
        "says a thread should start (paper 004 §4.2). Metrics at /-/metrics, policy at /-/policy "
        "(PUT from loopback to hot-swap).",
    )
    p.add_argument("--policy", default=None,
                   help='policy file from `overtake solve --out`, "pi(k)", "pi(k1,k2)" or passthrough '
                   "(with --policy-url: the fallback while the API is unreachable at start)")
    p.add_argument("--policy-url", default=None, metavar="URL",
                   help="take the policy from `overtake api`: http://HOST:PORT/v1/models/ID/policy.npz "
                   "(or .../models/ID); polled with its ETag, hot-swapped when the model changes")
    p.add_argument("--policy-poll", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between polls of --policy-url (default 10)")
    p.add_argument("--policy-token", default=None, metavar="TOKEN",
                   help="bearer token sent with --policy-url requests")
    p.add_argument("--apache", required=True, help="Apache base URL, e.g. http://127.0.0.1:8081")
    p.add_argument("--listen", required=True, help="HOST:PORT to listen on, e.g. 127.0.0.1:8080")
    p.add_argument("--stages", required=True, help="stages YAML (see examples/sidecar/stages.yaml)")
    p.add_argument("--phase-header", default=None,
                   help="request header carrying the phase (explicit mode); overrides the stages file")
    p.add_argument("--uplink", default="fair", help="uplink scheduler for responses (controller.uplink)")
    p.add_argument("--uplink-cutoffs", default=None, metavar="LIST",
                   help="fixed SRPT band cutoffs in bytes ('1K,4K,16K,64K'; SRRT: seconds); default adaptive")
    p.add_argument("--uplink-top-fraction", type=float, default=TOP_FRACTION, metavar="F",
                   help=f"adaptive cutoffs: share of responses above the highest cutoff (default "
                        f"{TOP_FRACTION:g}, the low end of paper 001's 0.005-0.01; 0.001 measured "
                        "better on World Cup 98 sizes)")
    p.add_argument("--uplink-lowest-writers", type=int, default=0, metavar="K",
                   help="srpt/srrt: at most K responses of the lowest band write at once, least "
                   "remaining first (SRPT inside that band); 0 = one FIFO (default)")
    p.add_argument("--uplink-ordered-bands", type=int, default=1, metavar="N",
                   help="with --uplink-lowest-writers: order each of the lowest N bands so "
                   "(default 1, the lowest only)")
    p.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop", help="event loop (default uvloop)")
    o = p.add_argument_group("online loop", "measure demands and arrivals, refit the PH model, re-solve pi* in a "
                             "worker process and hot-swap it when predicted better (controller.online)")
    o.add_argument("--online", action="store_true", help="enable the online refit loop")
    o.add_argument("--refit-interval", type=float, default=60.0, metavar="SECONDS",
                   help="at most one refit per interval (default 60)")
    o.add_argument("--min-samples", type=int, default=200, metavar="N",
                   help="demand samples per stage before a refit is tried (default 200)")
    o.add_argument("--arrival-window", type=float, default=60.0, metavar="SECONDS",
                   help="window of the arrival-rate estimate (default 60)")
    o.add_argument("--access-log", default=None, metavar="PATH",
                   help="Apache access log (overtake apache's WORKDIR/logs/access.log): take service demands "
                   "from its cpu_us notes instead of the attained service under sharing")
    o.add_argument("--swap-margin", type=float, default=0.01, metavar="FRACTION",
                   help="swap only when the new policy's predicted E[W] is lower by more than this (default 0.01)")
    o.add_argument("--refit-tolerance", type=float, default=0.01, metavar="FRACTION",
                   help="relative accuracy of the re-solve (default 0.01)")


async def _main(side: Sidecar) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)  # clean shutdown, exit code 0
    await side.start()
    try:
        await stop.wait()
    finally:
        await side.close()


def run(args: argparse.Namespace) -> int:
    """Build the sidecar from the options and serve until interrupted."""
    if args.policy is None and args.policy_url is None:
        raise SidecarInputError("policy: give --policy FILE|pi(k)|passthrough or --policy-url URL")
    table = load_stages(args.stages)
    opts = SidecarOptions(
        policy=args.policy or "", apache=args.apache, listen=args.listen,
        phase_header=args.phase_header, uplink=args.uplink, uplink_cutoffs=args.uplink_cutoffs,
        uplink_top_fraction=args.uplink_top_fraction, uplink_lowest_writers=args.uplink_lowest_writers,
        uplink_ordered_bands=args.uplink_ordered_bands,
        online=OnlineSettings(
            refit_interval=args.refit_interval, min_samples=args.min_samples, arrival_window=args.arrival_window,
            reservoir=max(2000, args.min_samples), margin=args.swap_margin, tolerance=args.refit_tolerance,
            access_log=args.access_log,
        ) if args.online else None,
        policy_url=args.policy_url, policy_poll=args.policy_poll, policy_token=args.policy_token,
    )
    configure_logging()

    async def main() -> None:
        side = Sidecar(table, opts)  # validates policy, addresses and uplink before listening
        await _main(side)

    if args.loop == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
    return 0
