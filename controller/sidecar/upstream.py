"""Keep-alive HTTP/1.1 connections to Apache and one request/response exchange on them.

The gateway reaches Apache through one call, :meth:`UpstreamPool.exchange` (one method, so
that a test or another upstream can stand in for Apache): it sends a request head and body, reads the response with
httptools, buffers the body up to ``buffer_bytes`` and hands the rest to a streaming callback.
Idle connections are reused LIFO and dropped after ``idle_timeout`` (kept below Apache's
``KeepAliveTimeout 5``) or as soon as Apache has closed them: Apache closes a kept-alive
connection at its own ``KeepAliveTimeout`` (an operator's may be shorter than ours) and, under
mpm_event, every idle kept-alive connection of a child at once when its workers are all busy, so
the pool may hold several dead connections. A reused connection that fails before the first
response byte is retried once, on a fresh connection, whatever the method: Apache closes a
connection only between requests, so the request never reached a worker (a fresh connection
cannot be dead the same way).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httptools

from overtake.controller.errors import ControllerError

__all__ = ["UpstreamError", "UpstreamPool", "UpstreamResponse", "Withdrawn"]


class UpstreamError(ControllerError):
    """Apache could not be reached or broke the exchange (answered 502 by the gateway)."""


class Withdrawn(ControllerError):
    """A request sent ahead of its admission (Apache's gate) was withdrawn before it (the
    connection is closed; the gateway answers the client itself)."""


@dataclass
class UpstreamResponse:
    """A response read from Apache: status, reason, raw headers, buffered body."""

    status: int = 0
    reason: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: list[bytes] = field(default_factory=list)
    body_bytes: int = 0
    streamed: bool = False  # the body went (partly) to the stream callback
    keep_alive: bool = False
    headers_done: bool = False
    done: bool = False


class _Conn:
    __slots__ = ("reader", "writer", "last_used")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.last_used = time.monotonic()

    def close(self) -> None:
        self.writer.close()


def _alive(c: _Conn) -> bool:
    """Not closed at either end: an idle connection Apache closed has its EOF (or its reset)
    already read by the event loop, though our end of the transport is still open."""
    return not (c.writer.transport.is_closing() or c.reader.at_eof() or c.reader.exception() is not None)


class _Parse:
    """httptools callbacks filling an UpstreamResponse."""

    __slots__ = ("resp", "head_only", "parser")

    def __init__(self, resp: UpstreamResponse, head_only: bool) -> None:
        self.resp = resp
        self.head_only = head_only
        self.parser: httptools.HttpResponseParser | None = None

    def on_status(self, status: bytes) -> None:
        self.resp.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.resp.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.resp.headers_done = True
        assert self.parser is not None
        self.resp.status = self.parser.get_status_code()
        # read here: llhttp resets its flags once the message is complete
        self.resp.keep_alive = self.parser.should_keep_alive()
        if self.head_only:
            self.resp.done = True

    def on_body(self, body: bytes) -> None:
        self.resp.body.append(body)
        self.resp.body_bytes += len(body)

    def on_message_complete(self) -> None:
        self.resp.done = True


StreamCallback = Callable[[UpstreamResponse], Awaitable[None]]


class _Reading:
    """One response read off one connection: the parser, and whether any byte came (a reused
    connection that fails before its first byte is retried: Apache had closed it between requests)."""

    __slots__ = ("c", "resp", "parser", "got_bytes")

    def __init__(self, c: _Conn, head_only: bool) -> None:
        self.c = c
        self.resp = UpstreamResponse()
        cb = _Parse(self.resp, head_only)
        self.parser = httptools.HttpResponseParser(cb)
        cb.parser = self.parser
        self.got_bytes = False

    async def read(self, deadline: asyncio.Timeout, timeout: float, buffer_bytes: int,
                   on_stream: StreamCallback) -> None:
        """Read until the response is complete, handing the body to ``on_stream`` past ``buffer_bytes``."""
        resp = self.resp
        while not resp.done:
            data = await self.c.reader.read(65536)
            if not data:
                self._eof()
                break
            self.got_bytes = True
            # a deadline per progress, not per response: an answer that trickles, or a
            # slow reader's long download, goes on as long as Apache keeps sending
            deadline.reschedule(asyncio.get_running_loop().time() + timeout)
            self.parser.feed_data(data)
            if (resp.streamed or resp.body_bytes > buffer_bytes) and resp.body and not resp.done:
                await self._stream(deadline, timeout, on_stream)
            if resp.streamed:
                # read() returns buffered bytes without suspending: one read per turn
                # of the loop, or 32 downloads copy megabytes between two turns
                await asyncio.sleep(0)

    def _eof(self) -> None:
        """Apache closed the connection: the end of a close-delimited body, else a broken exchange."""
        resp = self.resp
        if not resp.headers_done and not self.got_bytes:
            raise ConnectionResetError("connection closed before the response")
        resp.done = resp.headers_done
        if not resp.done:
            raise ConnectionResetError("connection closed mid-response")
        resp.keep_alive = False

    async def _stream(self, deadline: asyncio.Timeout, timeout: float, on_stream: StreamCallback) -> None:
        """Hand the pending body to ``on_stream``; Apache's deadline pauses meanwhile."""
        resp = self.resp
        resp.streamed = True
        # on_stream waits for the client (and the spool's room): Apache is
        # not silent meanwhile, we are not reading; the client's own deadline
        # (client_timeout per write) bounds this wait
        deadline.reschedule(None)
        await on_stream(resp)
        resp.body_bytes = sum(len(b) for b in resp.body)
        deadline.reschedule(asyncio.get_running_loop().time() + timeout)


class UpstreamPool:
    """Connections to one Apache ``host:port``."""

    def __init__(self, host: str, port: int, *, idle_timeout: float = 4.0, max_idle: int = 512,
                 connect_timeout: float = 5.0) -> None:
        self.host = host
        self.port = port
        #: a full accept queue leaves a SYN unanswered: without a bound the request would hold its slot
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.max_idle = max_idle
        self._idle: list[_Conn] = []
        self.opened = 0

    async def _get(self) -> tuple[_Conn, bool]:
        now = time.monotonic()
        while self._idle:
            c = self._idle.pop()
            if now - c.last_used < self.idle_timeout and _alive(c):
                return c, True
            c.close()
        return await self._open(), False

    async def _open(self) -> _Conn:
        try:
            async with asyncio.timeout(self.connect_timeout):
                r, w = await asyncio.open_connection(self.host, self.port)
        except TimeoutError:
            raise UpstreamError(f"connect to {self.host}:{self.port}: no answer within {self.connect_timeout:g} s "
                                "(limits.upstream_connect_timeout)") from None
        except OSError as exc:
            raise UpstreamError(f"connect to {self.host}:{self.port}: {exc.strerror or exc}") from None
        self.opened += 1
        return _Conn(r, w)

    def _put(self, c: _Conn) -> None:
        if len(self._idle) >= self.max_idle:
            c.close()
            return
        c.last_used = time.monotonic()
        self._idle.append(c)

    def close(self) -> None:
        for c in self._idle:
            c.close()
        self._idle.clear()

    async def exchange(
        self, method: bytes, head: bytes, body: bytes, *, buffer_bytes: int, timeout: float,
        on_stream: StreamCallback, admitted: Callable[[], Awaitable[bool]] | None = None,
    ) -> UpstreamResponse:
        """Send one request and read its response.

        ``admitted``: the request goes out at once and waits in Apache's gate; ``await
        admitted()`` then says whether it was admitted (True: read the response, ``timeout``
        counting from then) or withdrawn (False: :class:`Withdrawn` is raised).

        ``on_stream(resp)`` is awaited whenever more than ``buffer_bytes`` of body are pending:
        it must consume ``resp.body`` (write it to the client and clear the list). The return
        value is the complete response (``done``), its unconsumed body in ``resp.body``.

        ``timeout`` bounds each silence of Apache (from the request, or the last bytes read, to
        the next), not the whole answer.

        Raises
        ------
        UpstreamError
            Connect/read/write failure, a malformed response, or ``timeout`` without a byte.
        """
        for attempt in (0, 1):
            c, reused = await self._get() if attempt == 0 else (await self._open(), False)
            rd = _Reading(c, method == b"HEAD")
            wait, admitted = admitted, None  # a retry on a fresh connection goes out admitted
            try:
                await self._attempt(rd, head, body, wait, buffer_bytes=buffer_bytes, timeout=timeout,
                                    on_stream=on_stream)
            except TimeoutError:
                c.close()
                raise UpstreamError(f"{self.host}:{self.port} sent nothing within {timeout:g} s "
                                    "(limits.upstream_timeout: the longest silence of an answer)") from None
            except (OSError, httptools.HttpParserError) as exc:
                c.close()
                if attempt == 0 and reused and not rd.got_bytes:
                    continue
                raise UpstreamError(f"{self.host}:{self.port}: {exc.__class__.__name__}: {exc}") from None
            except BaseException:
                c.close()
                raise
            if rd.resp.keep_alive:
                self._put(c)
            else:
                c.close()
            return rd.resp
        raise AssertionError("unreachable")

    async def _attempt(self, rd: _Reading, head: bytes, body: bytes, wait: Callable[[], Awaitable[bool]] | None, *,
                       buffer_bytes: int, timeout: float, on_stream: StreamCallback) -> None:
        """One try on one connection: send (ahead of the admission when ``wait`` is given, the
        response's deadline counting from the admission), then read the response."""
        sent = False
        if wait is not None:
            self._send(rd.c, head, body)
            sent = True
            if not await wait():
                raise Withdrawn("withdrawn while held in Apache's gate")
        async with asyncio.timeout(timeout) as deadline:
            if not sent:
                self._send(rd.c, head, body)
            await rd.read(deadline, timeout, buffer_bytes, on_stream)

    @staticmethod
    def _send(c: _Conn, head: bytes, body: bytes) -> None:
        c.writer.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            c.writer.write(body)
