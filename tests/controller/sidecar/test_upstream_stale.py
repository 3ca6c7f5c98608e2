"""A pooled connection Apache has closed while it sat idle must never cost a request.

Apache closes a kept-alive connection after ``KeepAliveTimeout`` and, under mpm_event, every
idle kept-alive connection of a child at once when its workers are all busy. The pool then holds
several connections that are already closed at Apache's end. A real Apache with
``KeepAliveTimeout 1``: three connections pooled, two seconds idle (under the pool's own idle
bound), then a GET and a POST through the pool both get their 200 and go out on fresh
connections.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator

import pytest

from overtake.controller.harness import apache
from overtake.controller.harness.scratch import free_port, scratch_dir
from overtake.controller.sidecar.upstream import UpstreamPool, UpstreamResponse


@pytest.fixture(scope="module")
def short_keepalive(apache_available: None) -> Iterator[tuple[str, int]]:
    parent = scratch_dir("overtake-stale-upstream-")
    conf = parent / "conf"
    shutil.copytree(apache.DEFAULT_CONF_DIR, conf, ignore=shutil.ignore_patterns("__pycache__"))
    tpl = conf / "httpd.conf.in"
    text = tpl.read_text()
    assert "KeepAliveTimeout 5\n" in text
    tpl.write_text(text.replace("KeepAliveTimeout 5\n", "KeepAliveTimeout 1\n"))
    inst = apache.start(parent / "wd", f"127.0.0.1:{free_port()}", max_workers=8, conf_dir=conf)
    try:
        yield apache.parse_listen(inst.listen)
    finally:
        apache.stop(inst.workdir, graceful=False)
        shutil.rmtree(parent, ignore_errors=True)


async def _send(pool: UpstreamPool, method: bytes, body: bytes = b"") -> UpstreamResponse:
    head = (method + b" /stage1?work=0 HTTP/1.1\r\nHost: x\r\n"
            + (b"Content-Type: text/plain\r\nContent-Length: %d\r\n" % len(body) if method == b"POST" else b"")
            + b"\r\n")

    async def keep(resp: UpstreamResponse) -> None:
        resp.body.clear()

    return await pool.exchange(method, head, body, buffer_bytes=1 << 16, timeout=10, on_stream=keep)


@pytest.mark.parametrize("method", [b"GET", b"POST"])
def test_connections_apache_closed_while_idle_cost_no_request(short_keepalive: tuple[str, int],
                                                              method: bytes) -> None:
    pool = UpstreamPool(*short_keepalive)  # idle bound 4 s: above this Apache's KeepAliveTimeout

    async def go() -> tuple[list[int], int, int]:
        first = await asyncio.gather(*(_send(pool, b"GET") for _ in range(3)))
        assert [r.status for r in first] == [200] * 3
        pooled = len(pool._idle)
        await asyncio.sleep(2.0)  # Apache closes all three; the pool still holds them
        opened = pool.opened
        resp = await _send(pool, method, b"x=1" if method == b"POST" else b"")
        pool.close()
        return [resp.status], pooled, pool.opened - opened

    statuses, pooled, fresh = asyncio.run(go())
    assert pooled == 3
    assert statuses == [200]
    assert fresh == 1  # one new connection, no retry needed: the closed ones were seen as closed


class _ClosesOnReuse:
    """An upstream that answers the first request of a connection (kept alive) and closes the
    connection unanswered when a second one arrives on it: Apache closing an idle connection just
    as the request goes out, the race no check before sending can see (a fault injected)."""

    def __init__(self) -> None:
        self.answered = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._answer_once(reader, writer)
        except asyncio.IncompleteReadError:  # the pool closed it
            pass
        finally:
            writer.close()

    async def _answer_once(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = True
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            n = int(next((ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")),
                         b"0"))
            await reader.readexactly(n)
            if not first:
                writer.transport.abort()  # a reset, no byte of an answer
                return
            first = False
            self.answered += 1
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()


@pytest.mark.parametrize("method", [b"GET", b"POST"])
def test_a_connection_closed_as_the_request_goes_out_is_retried_on_a_fresh_one(method: bytes) -> None:
    up = _ClosesOnReuse()

    async def go() -> int:
        srv = await asyncio.start_server(up.serve, "127.0.0.1", 0)
        pool = UpstreamPool("127.0.0.1", srv.sockets[0].getsockname()[1])
        head = b" / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
        await asyncio.gather(*(pool.exchange(b"GET", b"GET" + head, b"", buffer_bytes=1 << 16, timeout=5,
                                             on_stream=lambda r: asyncio.sleep(0)) for _ in range(2)))
        assert len(pool._idle) == 2  # both alive when pooled: the reuse finds them open
        resp = await pool.exchange(method, method + head, b"", buffer_bytes=1 << 16, timeout=5,
                                   on_stream=lambda r: asyncio.sleep(0))
        pool.close()
        await asyncio.sleep(0.05)  # the server's handlers see the pool's ends closed
        srv.close()
        await srv.wait_closed()
        return resp.status

    assert asyncio.run(go()) == 200
    assert up.answered == 3  # the two, then the retry's on its new connection
