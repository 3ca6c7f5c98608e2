"""``overtake api``: serve the REST API (and its page at ``/``) with uvicorn.

::

    overtake api [--listen 127.0.0.1:8080] --db PATH [--token TOKEN] [--workers N] [--max-states N]
                 [--request-deadline SECONDS] [--job-deadline SECONDS]

Binds loopback by default. ``--token`` (or ``OVERTAKE_API_TOKEN``) makes every POST need
``Authorization: Bearer TOKEN``. Jobs, fits and policies persist in the SQLite database; on
restart, jobs that were queued run again and jobs that were running are marked failed.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
from typing import Any

from overtake.api.errors import ApiUsageError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("api", help="serve the REST API and its HTML page",
                              description="Serve the REST API (OpenAPI at /docs) and the page at /.")
    p.add_argument("--listen", default="127.0.0.1:8080", metavar="HOST:PORT", help="default 127.0.0.1:8080 (loopback)")
    p.add_argument("--db", required=True, metavar="PATH", help="SQLite file or sqlite:///PATH URL (created if missing)")
    p.add_argument("--token", default=os.environ.get("OVERTAKE_API_TOKEN"),
                   help="bearer token required on POST (default: $OVERTAKE_API_TOKEN; none = open)")
    p.add_argument("--workers", type=int, default=1, help="solver processes, i.e. jobs running at once (default 1)")
    p.add_argument("--max-states", type=int, default=300_000, help="413 above this estimated state space")
    p.add_argument("--max-queued", type=int, default=32, help="429 above this many waiting jobs")
    p.add_argument("--request-deadline", type=float, default=10.0, metavar="SECONDS",
                   help="503 when a request's own work (validation, parsing, reading jobs) takes longer (default 10)")
    p.add_argument("--job-deadline", type=float, default=3600.0, metavar="SECONDS",
                   help="a job still running after this long is stopped and fails saying so (default 3600)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[::1]:PORT``) → (host, port)."""
    host, sep, port_s = value.rpartition(":")
    if not sep or not host:
        raise ApiUsageError(f"--listen must be HOST:PORT, got {value!r}")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            raise ApiUsageError(f"--listen host must be an IP address or localhost, got {host!r}") from None
    if not (port_s.isascii() and port_s.isdigit()) or not 0 < int(port_s) < 65536:
        raise ApiUsageError(f"--listen port must be 1..65535, got {port_s!r}")
    return host, int(port_s)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from overtake.api.app import Settings, create_app

    host, port = parse_listen(args.listen)
    for opt in ("workers", "max_states", "max_queued"):
        if getattr(args, opt) < 1:
            raise ApiUsageError(f"--{opt.replace('_', '-')} must be >= 1, got {getattr(args, opt)}")
    if not (math.isfinite(args.request_deadline) and args.request_deadline > 0):
        raise ApiUsageError(f"--request-deadline must be > 0 seconds, got {args.request_deadline}")
    if not (math.isfinite(args.job_deadline) and args.job_deadline > 0):
        raise ApiUsageError(f"--job-deadline must be > 0 seconds, got {args.job_deadline}")
    if args.token is not None and not args.token:
        raise ApiUsageError("--token must not be empty")
    app = create_app(Settings(db=args.db, token=args.token, workers=args.workers, max_states=args.max_states,
                              max_queued=args.max_queued, request_deadline=args.request_deadline,
                              job_deadline=args.job_deadline))
    uvicorn.run(app, host=host, port=port, log_level=args.log_level)
    return 0
