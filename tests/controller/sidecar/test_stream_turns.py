"""A streamed answer from Apache is read one read (64 KiB) per turn of the event loop.

``StreamReader.read`` returns bytes already buffered without suspending, so a download Apache
sends faster than the sidecar spools it was copied 256 KiB and more between two turns of the loop;
32 such downloads (sidecar_attack's slow_readers) held the loop for milliseconds per turn and a
fresh client's p99 went to 86-135 ms. A ticker rescheduling itself with ``call_soon`` marks the
turns; the answer's bytes handed to ``on_stream`` are counted per turn. No timing.
"""

from __future__ import annotations

import asyncio

from support.loop_turns import LoopTurns

from overtake.controller.sidecar.upstream import UpstreamPool, UpstreamResponse

SIZE = 8 << 20
READ = 65536  # UpstreamPool.exchange's read size


def test_a_streamed_answer_is_read_once_per_turn_of_the_loop() -> None:
    async def main() -> tuple[int, int]:
        served = asyncio.Event()

        async def apache(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % SIZE + b"x" * SIZE)
            await writer.drain()
            await reader.read()  # until the client closes
            writer.close()
            await writer.wait_closed()
            served.set()

        server = await asyncio.start_server(apache, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        per_turn: dict[int, int] = {}

        async def on_stream(resp: UpstreamResponse) -> None:
            per_turn[turns.turn] = per_turn.get(turns.turn, 0) + sum(len(b) for b in resp.body)
            resp.body.clear()

        turns = LoopTurns()
        pool = UpstreamPool("127.0.0.1", port)
        try:
            resp = await pool.exchange(b"GET", b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n", b"", buffer_bytes=0,
                                       timeout=60, on_stream=on_stream)
        finally:
            turns.stop()
            pool.close()
            await asyncio.wait_for(served.wait(), 30)
            server.close()
            await server.wait_closed()
        return sum(per_turn.values()) + sum(len(b) for b in resp.body), max(per_turn.values())

    total, most = asyncio.run(main())
    assert total == SIZE
    assert most <= READ, most
