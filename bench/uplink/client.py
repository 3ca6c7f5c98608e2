"""Open-loop client: one TCP connection per request at the scheduled times (Harchol-Balter et al., "Size-based scheduling to improve web performance" §3.1.4).

Reads a schedule (JSON list of [arrival_s, size_bytes]) and writes one JSON record per request:
``[arrival, start, first_byte, end, size, received, error]`` (times relative to the run start;
response time = end - arrival). Run it in the client namespace::

    python bench/uplink/client.py --server 10.201.0.1:8080 --schedule S.json --out R.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time


async def one(host: str, port: int, t0: float, arrival: float, size: int, timeout: float,
              out: list[list[float | int | str | None]], prefix: bytes = b"/") -> None:
    delay = t0 + arrival - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    start = time.monotonic() - t0
    first = None
    got = 0
    err = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET %s%d HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                         % (prefix, size))
            while True:
                data = await reader.read(262144)
                if not data:
                    break
                if first is None:
                    first = time.monotonic() - t0
                got += len(data)
            writer.close()
    except (OSError, TimeoutError) as exc:
        err = type(exc).__name__
    end = time.monotonic() - t0
    out.append([arrival, start, first, end, size, got, err])


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--schedule", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--prefix", default="/", help="URL path before the size, e.g. /f/")
    ap.add_argument("--sequential", type=float, default=None, metavar="GAP",
                    help="closed loop instead: each request GAP s after the previous one ended "
                    "(arrival times ignored; recorded arrival = send time)")
    a = ap.parse_args()
    sched = json.load(open(a.schedule))
    host, port = a.server.rsplit(":", 1)
    out: list[list[float | int | str | None]] = []
    t0 = time.monotonic() + 0.2
    prefix = a.prefix.encode()
    if a.sequential is not None:
        for _, sz in sched:
            await asyncio.sleep(a.sequential)
            await one(host, int(port), t0, time.monotonic() - t0, sz, a.timeout, out, prefix)
    else:
        await asyncio.gather(*(one(host, int(port), t0, arr, sz, a.timeout, out, prefix)
                               for arr, sz in sched))
    json.dump(out, open(a.out, "w"))


if __name__ == "__main__":
    asyncio.run(main())
