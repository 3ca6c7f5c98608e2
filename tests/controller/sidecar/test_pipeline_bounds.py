"""A pipelining client's read-ahead is bounded, and its parsing yields to the other connections
(a few connections pipelining thousands of GETs each must not hold up a fresh client).

The mechanism is checked on :class:`overtake.controller.sidecar.http1.ClientConnection` directly: a
socket's worth of pipelined requests arrives at once, nobody answers them, and we count what
the connection parsed and queued, and how many requests it completed within one turn of the
event loop (a ticker rescheduling itself with ``call_soon`` marks the turns). No timing.
"""

from __future__ import annotations

import asyncio
from typing import Any

from support.loop_turns import LoopTurns

from overtake.controller.sidecar import http1
from overtake.controller.sidecar.http1 import ClientConnection
from overtake.controller.sidecar.stages import Limits

REQ = b"GET /static/hello.txt HTTP/1.1\r\nHost: x\r\n\r\n"
N = 2000
#: the most requests 1 KiB can complete (the smallest request is "GET / HTTP/1.1\r\n\r\n"): the
#: read-ahead allowed beyond _MAX_PIPELINE, and per turn of the loop
PER_SLICE = 1024 // len(b"GET / HTTP/1.1\r\n\r\n")


def test_the_slice_is_at_most_1_kib() -> None:
    assert 0 < http1._SLICE <= 1024


class _Writer:
    def __init__(self) -> None:
        self.out = bytearray()

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else None

    def write(self, data: bytes) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return False


async def _connection(data: bytes) -> tuple[ClientConnection, asyncio.StreamReader]:
    reader = asyncio.StreamReader(limit=1 << 16)
    reader.feed_data(data)
    conn = ClientConnection(Limits(), reader, _Writer())  # type: ignore[arg-type]
    return conn, reader


def test_read_ahead_is_bounded_while_nobody_answers() -> None:
    """2,000 pipelined GETs, none answered: at most _MAX_PIPELINE plus one slice's worth are
    parsed and queued, the rest stays unread (the socket's buffers then push back on the
    client); answering them releases the rest, all 2,000 in order."""

    async def main() -> tuple[int, list[bytes]]:
        conn, reader = await _connection(REQ * N)
        reading = asyncio.create_task(conn.read_loop())
        for _ in range(200):  # many turns of the loop: a bounded reader stops on its own
            await asyncio.sleep(0)
        queued = len(conn.ready)
        reader.feed_eof()
        urls = []
        while (req := await conn.next_request()) is not None:
            urls.append(req.url + b"#%d" % len(urls))
        await reading
        return queued, urls

    queued, urls = asyncio.run(main())
    assert http1._MAX_PIPELINE <= queued <= http1._MAX_PIPELINE + PER_SLICE, queued
    assert len(urls) == N and all(u.startswith(b"/static/hello.txt#") for u in urls)


def test_parsing_yields_to_the_loop_between_slices() -> None:
    """Requests taken as fast as they come: no turn of the event loop completes more than one
    slice's worth of this connection's requests, so other connections run in between."""

    async def main() -> tuple[int, int]:
        conn, reader = await _connection(REQ * N)
        reader.feed_eof()
        per_turn: dict[int, int] = {}
        complete = conn.on_message_complete

        def counted() -> None:
            per_turn[turns.turn] = per_turn.get(turns.turn, 0) + 1
            complete()

        conn.on_message_complete = counted  # type: ignore[method-assign]
        conn.parser = http1.httptools.HttpRequestParser(conn)  # bound to the counting callback
        turns = LoopTurns()
        reading = asyncio.create_task(conn.read_loop())
        got = 0
        while await conn.next_request() is not None:
            got += 1
        await reading
        turns.stop()
        return got, max(per_turn.values())

    got, most = asyncio.run(main())
    assert got == N
    assert most <= PER_SLICE, most


def _serve_pipelined(finish: str) -> tuple[bool, int, int]:
    """A real loopback connection: the client pipelines 2,000 GETs, nobody answers, so reading
    pauses at _MAX_PIPELINE; then the client resets (``reset``) or half-closes (``fin``).
    Returns (connection closed, requests still queued, requests parsed)."""
    import socket
    import struct

    async def main() -> tuple[bool, int, int]:
        conns: list[ClientConnection] = []
        loops: list[asyncio.Task[None]] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = ClientConnection(Limits(), reader, writer)
            conns.append(conn)
            loops.append(asyncio.create_task(conn.read_loop()))

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        cli = socket.create_connection(("127.0.0.1", port))
        cli.sendall(REQ * N)
        while not conns or conns[0].resume is None:  # reading paused: 16 requests wait
            await asyncio.sleep(0.01)
        if finish == "reset":
            cli.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            cli.close()
        else:
            cli.shutdown(socket.SHUT_WR)
        conn = conns[0]
        # a liveness bound, not a speed target: twenty looks at the socket
        done, _ = await asyncio.wait({conn.closed}, timeout=20 * http1._RESET_POLL)
        out = (bool(done), len(conn.ready), conn.parsed)
        for t in loops:
            t.cancel()
        for c in conns:
            c.writer.close()
        if finish != "reset":
            cli.close()
        server.close()
        await server.wait_closed()
        return out

    return asyncio.run(main())


def test_a_reset_while_reading_is_paused_closes_the_connection_and_drops_its_requests() -> None:
    closed, queued, _ = _serve_pipelined("reset")
    assert closed and queued == 0


def test_a_half_close_while_reading_is_paused_keeps_the_requests() -> None:
    # a FIN after the last request: the client may still read its answers (HAProxy's default)
    closed, queued, parsed = _serve_pipelined("fin")
    assert not closed and queued >= http1._MAX_PIPELINE and parsed < N
