"""Uplink capacity: byte throughput at saturation under FAIR, SRPT, SRRT and app-level ordering.

    sudo python bench/uplink_capacity.py --policies fair,srpt,app:4,app:1 --duration 20 --connections 64

What does the application-level fallback (Crovella et al.'s connection scheduling) cost in throughput? At loads below
1 every policy carries the offered bytes (bench/uplink_srpt.py: equal Mbit/s), so the cost only
shows at saturation: wrk (Debian package) in the client namespace keeps ``--connections``
requests outstanding, one connection per request, sizes drawn from the World Cup 98 model
(the same seeded list for every policy), against bench/uplink/server.py on the 10 Mbit/s testbed.
Reports bytes/s over the run, requests/s and the ratio to FAIR; policies are interleaved over
``--repeat`` rounds and medians reported. Writes the bench/results/sections.md section ``uplink-capacity``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _report import machine, write_section
from uplink.testbed import Testbed
from uplink.workload import HEADER_BYTES, MODELS
from uplink_srpt import PORT, raise_priority, start_server, stop_process

from overtake.controller.uplink import bands as _bands

ROOT = Path(__file__).resolve().parents[1]

LUA = """
local sizes = {%s}
local i = 0
request = function()
  i = i %% #sizes + 1
  return wrk.format("GET", "/" .. sizes[i], {["Connection"] = "close"})
end
"""


def _wrk(tb: Testbed, lua: Path, conns: int, duration: float) -> dict[str, float]:
    cmd = [*tb.exec_prefix(tb.cli_ns), "wrk", "-t1", f"-c{conns}", f"-d{duration:g}s", "--timeout", "30s",
           "-s", str(lua), f"http://{tb.srv_ip}:{PORT}/"]  # fmt: skip
    cp = subprocess.run(cmd, capture_output=True, text=True, check=True)
    text = cp.stdout
    reqs = re.search(r"(\d+) requests in ([0-9.]+)(m?s), ([0-9.]+)([KMG]?B) read", text)
    errs = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    if reqs is None:
        raise RuntimeError(f"wrk output not understood: {text} {cp.stderr}")
    span = float(reqs.group(2)) * (1e-3 if reqs.group(3) == "ms" else 1.0)
    scale = {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}[reqs.group(5)]
    return {"requests": int(reqs.group(1)), "span_s": span, "bytes": float(reqs.group(4)) * scale,
            "socket_errors": sum(int(x) for x in errs.groups()) if errs else 0,
            "non_2xx": int(non2xx.group(1)) if non2xx else 0}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = MODELS["wc98"]
    sizes = model.sample(args.sizes_n, np.random.default_rng(args.seed))
    ref = model.sample(200_000, np.random.default_rng(args.seed + 1)) + HEADER_BYTES
    tb = Testbed.up(rate=args.rate, mode="htb")
    cut = _bands.cutoffs_from_samples(ref, 7)
    out: dict[str, Any] = {"runs": {p: [] for p in args.policies}}
    try:
        with tempfile.TemporaryDirectory(prefix="ovt_cap_") as td:
            tmp = Path(td)
            lua = tmp / "sizes.lua"
            lua.write_text(LUA % ",".join(str(int(s)) for s in sizes))
            srv_args = argparse.Namespace(server="asyncio", app_concurrency=4, app_quantum=16384,
                                          app_pacing=True, rate=args.rate)  # fmt: skip
            for _ in range(args.repeat):
                for pol in args.policies:
                    p = start_server(tb, pol, srv_args, str(cut), tmp / "stats.json")
                    try:
                        r = _wrk(tb, lua, args.connections, args.duration)
                    finally:
                        stop_process(p)
                    # wrk's own count of the bytes it read (headers included, as on the wire)
                    r["bytes_per_s"] = r["bytes"] / r["span_s"]
                    r["requests_per_s"] = r["requests"] / r["span_s"]
                    r["uplink"] = p.describe  # type: ignore[attr-defined]
                    out["runs"][pol].append(r)
                    print(f"  {pol}: {r['bytes_per_s'] * 8 / 1e6:.2f} Mbit/s, {r['requests_per_s']:.0f} req/s, "
                          f"errors {r['socket_errors']}", file=sys.stderr, flush=True)
                    time.sleep(1.0)
    finally:
        tb.down()
    return out


def render(out: dict[str, Any], command: str, args: argparse.Namespace) -> str:
    med = {p: float(np.median([r["bytes_per_s"] for r in rs])) for p, rs in out["runs"].items()}
    fair = med.get("fair")
    lines = [
        "## uplink-capacity: byte throughput at saturation (app-level cost)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine()}.",
        f"Command: `{command}`. wrk -t1 -c{args.connections} (closed loop, one connection per request, "
        f"World Cup 98 sizes cycled from one seeded list of {args.sizes_n}) in the client namespace against "
        f"bench/uplink/server.py on the {args.rate} HTB testbed (TSO/GSO off); {args.duration:g} s per run, "
        f"policies interleaved over {args.repeat} rounds, medians.",
        "",
        "| policy | Mbit/s (median) | vs FAIR | req/s | runs Mbit/s | socket errors |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for p, rs in out["runs"].items():
        ratio = f"{med[p] / fair:.3f}" if fair else "-"
        lines.append(
            f"| {p} | {med[p] * 8 / 1e6:.2f} | {ratio} | "
            f"{np.median([r['requests_per_s'] for r in rs]):.0f} | "
            f"{', '.join('%.2f' % (r['bytes_per_s'] * 8 / 1e6) for r in rs)} | "
            f"{sum(r['socket_errors'] for r in rs)} |")
    lines.append("")
    lines.append("Uplinks: " + "; ".join(f"{p}: {rs[0]['uplink']}" for p, rs in out["runs"].items()))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="fair,srpt,srrt,app:4,app:1")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per wrk run")
    ap.add_argument("--connections", type=int, default=64, help="requests kept outstanding")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rate", default="10mbit")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sizes-n", type=int, default=5000, help="length of the cycled size list")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in args.policies:
        if p.split(":")[0] not in ("fair", "srpt", "srrt", "app"):
            ap.error(f"--policies: unknown {p!r}; use fair, srpt, srrt, app or app:K")
    if not 1 <= args.connections <= 10_000:
        ap.error(f"--connections: {args.connections} must be in 1..10000")
    if os.geteuid() != 0:
        print("uplink_capacity: needs root (network namespaces, qdiscs)", file=sys.stderr)
        return 2
    raise_priority()
    out = run(args)
    text = render(out, "python bench/uplink_capacity.py " + " ".join(sys.argv[1:]), args)
    if not args.no_write:
        write_section("uplink-capacity", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
