"""HTTP/1.1 for the gateway: the client connection, read and parsed by httptools.

A :class:`ClientConnection` reads one client socket and queues complete requests (keep-alive and
pipelining; parsed ``_SLICE`` bytes per turn of the event loop, at most ``_MAX_PIPELINE`` queued
ahead, then reading pauses). What it parses is held to the limits by
:class:`~overtake.controller.sidecar.request_parsing.RequestParsing`: a request it refuses, a
malformed request or an upgrade other than ``h2c`` (ignored, RFC 9113 §3.1) records the error
and ends the connection; the gateway answers it and closes. An ``h2c`` offer with a body is
ignored and the body read as the request's (llhttp stops at the head of an upgrade); a chunked
body's trailer fields are dropped. Control-endpoint bodies are refused (403) on a connection
the gateway allows none (``admin_body_max`` 0: not loopback, or not the admin listener), 413
beyond ``admin_body_max`` (:data:`ADMIN_BODY_MAX`). The heads the gateway writes are in
:mod:`overtake.controller.sidecar.heads`.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque

import httptools

from overtake.controller.sidecar.budget import ByteBudget
from overtake.controller.sidecar.request import Refusal, Request, body_framing
from overtake.controller.sidecar.request_parsing import RequestParsing
from overtake.controller.sidecar.stages import Limits

__all__ = ["ADMIN_BODY_MAX", "ClientConnection"]

#: pipelined requests parsed ahead of the one being answered, at most (then reading pauses)
_MAX_PIPELINE = 16
#: s between two looks at a paused connection's TCP state (:func:`_peer_reset`)
_RESET_POLL = 0.25
_TCP_CLOSE = 7  # tcp_states.h: what a socket becomes once the peer's RST arrived
#: bytes parsed per step of the event loop: at most _SLICE // 18 requests (the smallest request
#: line and empty header block, "GET / HTTP/1.1\r\n\r\n") beyond _MAX_PIPELINE are ever queued
_SLICE = 1024
#: control endpoints take a baseline name, a path, a URL or a small .npz; a larger artifact goes by URL
ADMIN_BODY_MAX = 1 << 20


def _peer_reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Has the client reset the connection? If the transport was still reading, it has seen the
    reset and closed (an exception waits in the reader); if not, the socket's TCP state
    (``TCP_INFO``) is CLOSE once an RST arrived: a client that closes with answers unread, or
    aborts, sends one. A FIN alone (CLOSE_WAIT) is a half-close: the client may still read its
    answers (HAProxy's default, no ``abortonclose``), so it is served."""
    transport = getattr(writer, "transport", None)
    if reader.exception() is not None or (transport is not None and transport.is_closing()):
        return True
    sock = writer.get_extra_info("socket")
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return False
    try:
        return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == _TCP_CLOSE)
    except (OSError, AttributeError, TypeError):
        return False


class ClientConnection(RequestParsing):
    """Reads and parses one client connection; parsed requests queue up for the handler.

    Also carries the gateway's per-connection flags its timers read: ``busy`` (a request in
    progress) and ``last_active`` (for the idle sweep).
    """

    def __init__(self, limits: Limits, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 budget: ByteBudget | None = None) -> None:
        self.limits = limits
        #: request bodies held in memory by every connection (``limits.body_budget_bytes``)
        self.budget = budget if budget is not None else ByteBudget(limits.body_budget_bytes)
        #: the request the gateway took last: its body is held until it asks for the next one
        self._served: Request | None = None
        self.reader = reader
        self.writer = writer
        self.parser = httptools.HttpRequestParser(self)
        self.cur: Request | None = None
        self.ready: deque[Request] = deque()
        self.parsed = 0  # requests completed on this connection
        self.error: tuple[int, str, str] | None = None  # (status, reason key, message)
        self.eof = False
        #: a WebSocket upgrade was read: parsing stops, the bytes after its head (the client's
        #: first frames) wait here for the tunnel, which takes the reader over
        self.tunnel_rest: bytes | None = None
        self.wake: asyncio.Future[None] | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.head_bytes = 0
        self.body_bytes = 0
        self.in_headers = False
        self._resuming = False  # parsing the synthetic head of :meth:`_resume_body`
        #: when the request head being read began (None between heads): slowloris keeps a
        #: connection active with a byte a second, so the deadline is on the whole head
        self.head_started: float | None = None
        #: when the body being read began to be due (the end of its head, or the 100 Continue):
        #: due within body_timeout plus a second per body_min_rate bytes (:meth:`body_late`)
        self.body_started: float | None = None
        peer = writer.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else "unknown"
        self.resume: asyncio.Future[None] | None = None
        self.busy = False
        self.last_active = time.monotonic()
        #: body bytes a /-/ request may carry on this connection (0: none; set by the gateway)
        self.admin_body_max = ADMIN_BODY_MAX
        self.admin_refusal = "control endpoints under /-/ take a request body only from loopback clients"

    # the socket ---------------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        """Parse ``data``. An ``Upgrade: h2c`` request is served as plain HTTP/1.1 (RFC 9113 §3.1:
        a server that does not speak h2c ignores the offer), and parsing goes on after it with a
        fresh parser; any other upgrade raises ``HttpParserUpgrade``."""
        while True:
            try:
                self.parser.feed_data(data)
                return
            except httptools.HttpParserCallbackError as exc:
                if isinstance(exc.__context__, Refusal):
                    raise exc.__context__ from None
                raise
            except httptools.HttpParserUpgrade as exc:
                offset = int(exc.args[0]) if exc.args and isinstance(exc.args[0], int) else len(data)
                if self.cur is not None and self.cur.resume_body is not None:
                    self._resume_body(self.cur)
                    data = data[offset:]
                    if not data:
                        return
                    continue
                last = self.ready[-1] if self.ready else None
                offer = next((v for k, v in last.headers if k.lower() == b"upgrade"), b"") if last else b""
                protocols = {p.strip().split(b"/")[0].lower() for p in offer.split(b",")}
                if last is not None and b"websocket" in protocols and last.method == b"GET":
                    last.upgrade = b"websocket"
                    self.tunnel_rest = data[offset:]
                    self._wake()
                    return
                if last is None or offer.strip().lower() != b"h2c":
                    raise
                self.parser = httptools.HttpRequestParser(self)
                data = data[offset:]
                if not data:
                    return

    def _resume_body(self, r: Request) -> None:
        """Read the body of ``r`` (an ``h2c`` offer, ignored) with a fresh parser: it is given a
        head with the body's framing first, whose callbacks leave ``r`` in place, so the bytes
        after the upgrade point are parsed as ``r``'s body, then as the next requests."""
        framing, r.resume_body = r.resume_body, None
        assert framing is not None
        self.parser = httptools.HttpRequestParser(self)
        self._resuming = True
        try:
            self.parser.feed_data(b"POST / HTTP/1.1\r\nHost: h\r\n" + framing + b"\r\n\r\n")
        finally:
            self._resuming = False

    async def _feed_bounded(self, data: bytes) -> None:
        """Parse ``data`` ``_SLICE`` bytes at a time. After a slice that completed a request, the
        loop runs the other connections before the next one, and once ``_MAX_PIPELINE`` requests
        wait, parsing (and so reading: the socket's buffers fill and TCP pushes back) stops until
        the gateway takes one. One 64 KiB read holds ~1,500 small pipelined GETs: parsed in one
        go they held the loop for tens of ms and queued them all (sidecar-attack's pipeline_flood);
        HAProxy and nginx likewise read ahead of the request being served only a buffer's worth."""
        pos, n = 0, len(data)
        while pos < n:
            piece = data if pos == 0 and n <= _SLICE else data[pos:pos + _SLICE]
            before = self.parsed
            self._feed(piece)
            pos += len(piece)
            if self.tunnel_rest is not None:
                self.tunnel_rest += data[pos:]  # the client's first frames, past this slice too
                return
            if len(self.ready) >= _MAX_PIPELINE:  # back-pressure on pipelining clients
                self.resume = asyncio.get_running_loop().create_future()
                paused = time.monotonic()
                try:
                    # reading is paused, so a client's reset would go unseen until the next
                    # write: watch the socket's TCP state meanwhile
                    while not self.resume.done():
                        await asyncio.wait({self.resume}, timeout=_RESET_POLL)
                        if not self.resume.done() and _peer_reset(self.reader, self.writer):
                            for r in self.ready:  # its pipelined requests go unanswered: drop them
                                self.release(r)
                            self.ready.clear()
                            raise ConnectionResetError("the client reset its connection while its requests waited")
                finally:
                    self.resume = None
                    self._postpone(time.monotonic() - paused)
            elif self.parsed != before and pos < n:
                await asyncio.sleep(0)  # a request per slice at most between two turns of the others

    def _postpone(self, dt: float) -> None:
        """Reading was paused ``dt`` seconds by the sidecar (pipelining back-pressure): the head
        or body being read gets that time back."""
        if self.head_started is not None:
            self.head_started += dt
        if self.body_started is not None:
            self.body_started += dt

    def answered(self) -> None:
        """The gateway finished an answer: send a deferred ``100 Continue`` for the request being
        read now, if it still waits for one (its body not yet received; its deadline starts)."""
        r = self.cur
        if r is not None and r.expect and not self.ready and not self.writer.is_closing():
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            r.expect = False
            if body_framing(r.headers) is not None:
                self.body_started = time.monotonic()

    async def read_loop(self) -> None:
        limits = self.limits
        try:
            while True:
                data = await self.reader.read(65536)
                if not data:
                    break
                self.last_active = time.monotonic()
                try:
                    await self._feed_bounded(data)
                except Refusal as exc:
                    if exc.message:
                        self.error = (exc.status, exc.reason, exc.message)
                    elif exc.status == 431:
                        msg = f"request header block larger than {limits.max_header_bytes} bytes"
                        self.error = (431, "header_too_large", msg)
                    else:
                        self.error = (413, "body_too_large", f"request body larger than {limits.max_body_bytes} bytes")
                    break
                except httptools.HttpParserUpgrade:
                    self.error = (400, "bad_request", "protocol upgrade is not supported by the sidecar (only "
                                  "websocket, tunnelled, and h2c, which is ignored: the answer comes in HTTP/1.1)")
                    break
                except httptools.HttpParserError as exc:
                    self.error = (400, "bad_request", f"malformed HTTP request ({exc})")
                    break
                if self.tunnel_rest is not None:
                    return  # the tunnel reads from here on; the connection stays open
        except (ConnectionError, OSError):
            pass
        finally:
            if self.tunnel_rest is None:  # a tunnel's reader lives on
                self.eof = True
                if not self.closed.done():
                    self.closed.set_result(None)
            self._wake()

    async def watch_close(self) -> None:
        """For a connection whose reading stopped (a tunnel waiting for its admission): resolve
        ``closed`` once the client has closed or reset it; cancel it when no longer needed."""
        while not self.closed.done():
            if self.reader.at_eof() or _peer_reset(self.reader, self.writer):
                self.closed.set_result(None)
                return
            await asyncio.sleep(_RESET_POLL)

    async def next_request(self) -> Request | None:
        """The next complete request (None once the connection has ended); the one returned
        before is done with, its body's bytes given back to the budget."""
        self.release(self._served)
        self._served = None
        while True:
            if self.ready:
                r = self.ready.popleft()
                self._served = r
                if self.resume is not None and not self.resume.done():
                    self.resume.set_result(None)
                return r
            if self.error is not None or self.eof:
                return None
            self.wake = asyncio.get_running_loop().create_future()
            await self.wake
            self.wake = None

