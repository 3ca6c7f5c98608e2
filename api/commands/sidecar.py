"""``overtake sidecar``: enforce a thread policy in front of an unmodified Apache (issue #5).

Benchmarks call exactly::

    overtake sidecar --policy (FILE | "pi(k)" | "pi(k1,k2)" | passthrough) --apache URL
                     --listen ADDR --stages FILE [--phase-header NAME] [--uplink fair]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

from controller.sidecar import Sidecar, SidecarOptions, configure_logging
from controller.stages import load_stages


def register(subparsers: Any) -> None:
    """Add the ``sidecar`` sub-command."""
    p = subparsers.add_parser(
        "sidecar",
        help="reverse proxy that releases requests to Apache exactly when the policy starts a thread",
        description="Hold each request in its stage queue and release it to Apache when the policy "
        "says a thread should start (paper 004 §4.2). Metrics at /-/metrics, policy at /-/policy "
        "(PUT from loopback to hot-swap).",
    )
    p.add_argument("--policy", required=True,
                   help='policy file from `overtake solve --out`, "pi(k)", "pi(k1,k2)" or passthrough')
    p.add_argument("--apache", required=True, help="Apache base URL, e.g. http://127.0.0.1:8081")
    p.add_argument("--listen", required=True, help="HOST:PORT to listen on, e.g. 127.0.0.1:8080")
    p.add_argument("--stages", required=True, help="stages YAML (see examples/sidecar/stages.yaml)")
    p.add_argument("--phase-header", default=None,
                   help="request header carrying the phase (explicit mode); overrides the stages file")
    p.add_argument("--uplink", default="fair", help="uplink scheduler for responses (controller.uplink)")
    p.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop", help="event loop (default uvloop)")


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
    table = load_stages(args.stages)
    opts = SidecarOptions(
        policy=args.policy, apache=args.apache, listen=args.listen,
        phase_header=args.phase_header, uplink=args.uplink,
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
