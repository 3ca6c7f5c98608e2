"""Minimal asyncio static-content server whose responses go through ``overtake.controller.uplink``.

``GET /<n> HTTP/1.x`` answers ``n`` bytes (one connection per request, ``Connection: close``),
written in 64 KiB chunks via ``flow = uplink.open(writer, total); await flow.write(..);
flow.close()`` -- the same calls the sidecar gateway makes. Run it in the server namespace::

    python bench/uplink/server.py --listen 10.201.0.1:8080 --uplink srpt --bands htb \
        [--cutoffs 1K,2K,...] [--stats-out FILE]

SIGTERM writes the uplink's per-band counters to ``--stats-out`` (JSON) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import socket
from pathlib import Path

from overtake.controller.uplink import make_uplink

CHUNK = 65536
BODY = b"x" * (4 << 20)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--listen", required=True)
    ap.add_argument("--uplink", default="fair")
    ap.add_argument("--bands", default="auto")
    ap.add_argument("--dev", default=None)
    ap.add_argument("--cutoffs", default=None)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--quantum", type=int, default=16384)
    ap.add_argument("--interval", type=float, default=0.01)
    ap.add_argument("--max-pacing-rate", type=int, default=None, help="app: bytes/s cap")
    ap.add_argument("--lowest-writers", type=int, default=0, help="srpt/srrt: order the lowest band")
    ap.add_argument("--ordered-bands", type=int, default=1,
                    help="srpt/srrt with --lowest-writers: order the lowest N bands")
    ap.add_argument("--stats-out", default=None)
    a = ap.parse_args()
    up = make_uplink(
        a.uplink,
        bands=a.bands,
        dev=a.dev,
        cutoffs=a.cutoffs,
        concurrency=a.concurrency,
        quantum=a.quantum,
        interval=a.interval,
        max_pacing_rate=a.max_pacing_rate,
        lowest_writers=a.lowest_writers,
        ordered_bands=a.ordered_bands,
    )
    host, port = a.listen.rsplit(":", 1)
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((host, int(port)))
    lsock.listen(4096)
    prep = getattr(up, "prepare_listener", None)
    if prep is not None:
        prep(lsock)
    served = {"requests": 0, "bytes": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            parts = head.split(b" ", 2)
            n = int(parts[1].lstrip(b"/"))
            hdr = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % n
            flow = up.open(writer, len(hdr) + n)
            try:
                # header and first body chunk in one write, like the sidecar's small responses
                k = min(CHUNK - len(hdr), n)
                await flow.write(hdr + BODY[:k])
                off = k
                while off < n:
                    k = min(CHUNK, n - off)
                    await flow.write(BODY[:k])
                    off += k
            finally:
                flow.close()
            served["requests"] += 1
            served["bytes"] += len(hdr) + n
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, sock=lsock, backlog=4096)
    describe = getattr(up, "describe", lambda: up.name)()
    print(f"serving {a.listen} uplink {describe}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    async with server:
        await stop.wait()
    if a.stats_out:
        st = getattr(up, "stats", None)
        out = {"describe": describe, "served": served}
        if st is not None:
            out["bands"] = dataclasses.asdict(st())
        Path(a.stats_out).write_text(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
