"""``overtake prometheus start|stop``: a private Prometheus scraping the sidecar (and the API).

::

    overtake prometheus start --workdir DIR --listen 127.0.0.1:9090 --sidecar 127.0.0.1:9089 [--api HOST:PORT] [--interval 1]
    overtake prometheus stop --workdir DIR

Apache's series arrive through the sidecar's scrape (``apache_*``, apache_exporter's names).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("prometheus", help="private Prometheus (Debian package) scraping the sidecar and the API")
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("start", help="write DIR/prometheus.yml and start prometheus in the background")
    s.add_argument("--workdir", required=True, metavar="DIR")
    s.add_argument("--listen", default="127.0.0.1:9090", metavar="HOST:PORT")
    s.add_argument("--sidecar", action="append", default=[], metavar="HOST:PORT",
                   help="a sidecar's admin listener (admin_listen, default 127.0.0.1:9089): scrape HOST:PORT/metrics")
    s.add_argument("--api", action="append", default=[], metavar="HOST:PORT", help="scrape HOST:PORT/metrics")
    s.add_argument("--interval", type=float, default=1.0, help="scrape interval in seconds (default 1)")
    t = sub.add_parser("stop", help="stop the instance of DIR")
    t.add_argument("--workdir", required=True, metavar="DIR")


def run(args: argparse.Namespace) -> int:
    from overtake.controller.harness import prometheus

    if args.action == "start":
        inst = prometheus.start(args.workdir, args.listen, sidecars=args.sidecar, apis=args.api,
                                interval=args.interval)
        print(json.dumps({"url": inst.url, "pid": inst.pid, "config": str(inst.workdir / "prometheus.yml")}))
        return 0
    print("stopped" if prometheus.stop(args.workdir) else "not running")
    return 0
