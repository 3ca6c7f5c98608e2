"""The gateway: an asyncio HTTP/1.1 reverse proxy in front of Apache (paper 004, §4.2's front end).

I/O only. For every request it asks :class:`overtake.controller.stages.StageTable` for the stage,
:class:`overtake.controller.classifier.Classifier` for the phase, then holds it in
:class:`overtake.controller.limiter.Limiter` until the policy starts a thread for it, forwards it to Apache
on a keep-alive connection, and releases the permit the moment Apache's *whole* response has
been received (buffered up to ``response_buffer_bytes``, then streamed; so a slow client never
holds a stage slot unless the response is larger than the buffer). Responses go to the client
through the uplink seam (:mod:`overtake.controller.uplink`).

HTTP handling: keep-alive and pipelining on the client side (requests are answered in order),
hop-by-hop headers removed both ways (RFC 9110 §7.6.1, incl. those named in ``Connection``),
``X-Forwarded-For`` appended, ``Expect: 100-continue`` answered, chunked request bodies
de-chunked and sent with Content-Length. Malformed requests → 400, header block larger than
``max_header_bytes`` → 431, body larger than ``max_body_bytes`` → 413; each closes only its own
connection. Queue full or queue timeout → 503 with ``Retry-After``; a client that disconnects
while queued is withdrawn (never sent to Apache); Apache unreachable or broken mid-answer → 502.

Admin paths under ``/-/`` on the same listener: ``GET /-/metrics`` (Prometheus), ``GET
/-/policy`` (name, version, hash), ``PUT /-/policy`` (loopback clients only; body = a baseline
name, a server-side policy file path, or the bytes of a ``.npz`` policy), ``GET /-/healthz``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import httptools
from overtake.controller.classifier import BadPhaseHeader, Classifier
from overtake.controller.limiter import ADMITTED, PASSTHROUGH, Limiter, Ticket
from overtake.controller.metrics import SidecarMetrics
from overtake.controller.stages import StageTable
from overtake.controller.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from overtake.controller.uplink import Uplink

__all__ = ["Gateway"]

log = logging.getLogger("overtake.sidecar")

_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
                  b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade"})
_REASONS = {400: b"Bad Request", 403: b"Forbidden", 404: b"Not Found", 405: b"Method Not Allowed",
            413: b"Content Too Large", 431: b"Request Header Fields Too Large", 500: b"Internal Server Error",
            502: b"Bad Gateway", 503: b"Service Unavailable", 200: b"OK"}
_MAX_PIPELINE = 16
_ADMIN_BODY_MAX = 256 << 20  # PUT /-/policy carries a whole policy artifact


class _Request:
    __slots__ = ("method", "url", "headers", "body", "keep_alive", "version", "expect")

    def __init__(self) -> None:
        self.method = b""
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.keep_alive = True
        self.version = "1.1"
        self.expect = False


class _ClientConn:
    """Reads and parses one client connection; parsed requests queue up for the handler."""

    def __init__(self, gw: Gateway, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.gw = gw
        self.reader = reader
        self.writer = writer
        self.parser = httptools.HttpRequestParser(self)
        self.cur: _Request | None = None
        self.ready: deque[_Request] = deque()
        self.error: tuple[int, str, str] | None = None  # (status, reason key, message)
        self.eof = False
        self.wake: asyncio.Future[None] | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.head_bytes = 0
        self.body_bytes = 0
        self.in_headers = False
        peer = writer.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else "unknown"
        self.resume: asyncio.Future[None] | None = None
        self.busy = False
        self.last_active = time.monotonic()
        # a reservation for this client's next-stage request (limiter.py, tandem routing)
        self.hold: Ticket | None = None
        self.hold_timer: asyncio.TimerHandle | None = None

    # httptools callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.cur = _Request()
        self.in_headers = True
        self.head_bytes = 0
        self.body_bytes = 0

    def on_url(self, url: bytes) -> None:
        assert self.cur is not None
        self.cur.url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.cur is not None
        self.cur.headers.append((name, value))
        self._count_head(len(name) + len(value) + 4)

    def _count_head(self, n: int) -> None:
        self.head_bytes += n
        if self.head_bytes > self.gw.limits.max_header_bytes:
            raise _TooLarge(431)

    def on_headers_complete(self) -> None:
        r = self.cur
        assert r is not None
        self.in_headers = False
        r.method = self.parser.get_method()
        r.keep_alive = self.parser.should_keep_alive()
        r.version = self.parser.get_http_version()
        for k, v in r.headers:
            if k.lower() == b"expect" and v.lower() == b"100-continue":
                r.expect = True
                self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        assert self.cur is not None
        self.body_bytes += len(body)
        if self.body_bytes > self.gw.limits.max_body_bytes and not (
            self.cur.url.startswith(b"/-/") and self.body_bytes <= _ADMIN_BODY_MAX
        ):
            raise _TooLarge(413)
        self.cur.body.append(body)

    def on_message_complete(self) -> None:
        assert self.cur is not None
        self.ready.append(self.cur)
        self.cur = None
        self._wake()

    # --------------------------------------------------------------------------------------
    def _wake(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    async def read_loop(self) -> None:
        limits = self.gw.limits
        try:
            while True:
                data = await self.reader.read(65536)
                if not data:
                    break
                self.last_active = time.monotonic()
                try:
                    try:
                        self.parser.feed_data(data)
                    except httptools.HttpParserCallbackError as exc:
                        if isinstance(exc.__context__, _TooLarge):
                            raise exc.__context__ from None
                        raise
                except _TooLarge as exc:
                    if exc.status == 431:
                        self.error = (431, "header_too_large", f"request header block larger than {limits.max_header_bytes} bytes")
                    else:
                        self.error = (413, "body_too_large", f"request body larger than {limits.max_body_bytes} bytes")
                    break
                except httptools.HttpParserUpgrade:
                    self.error = (400, "bad_request", "protocol upgrade is not supported by the sidecar")
                    break
                except httptools.HttpParserError as exc:
                    self.error = (400, "bad_request", f"malformed HTTP request ({exc})")
                    break
                if len(self.ready) >= _MAX_PIPELINE:  # back-pressure on pipelining clients
                    self.resume = asyncio.get_running_loop().create_future()
                    await self.resume
                    self.resume = None
        except (ConnectionError, OSError):
            pass
        finally:
            self.eof = True
            if not self.closed.done():
                self.closed.set_result(None)
            self._wake()

    async def next_request(self) -> _Request | None:
        while True:
            if self.ready:
                r = self.ready.popleft()
                if self.resume is not None and not self.resume.done():
                    self.resume.set_result(None)
                return r
            if self.error is not None or self.eof:
                return None
            self.wake = asyncio.get_running_loop().create_future()
            await self.wake
            self.wake = None


class _TooLarge(Exception):
    def __init__(self, status: int) -> None:
        self.status = status


def _simple(status: int, text: str, *, close: bool, extra: bytes = b"") -> bytes:
    body = (text + "\n").encode()
    return (b"HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n%s%s\r\n"
            % (status, _REASONS.get(status, b"Error"), len(body), extra,
               b"Connection: close\r\n" if close else b"")) + body


class Gateway:
    """The proxy. Build with the pieces, then ``await gateway.serve(host, port)``."""

    def __init__(
        self,
        table: StageTable,
        limiter: Limiter,
        classifier: Classifier,
        pool: UpstreamPool,
        uplink: Uplink,
        metrics: SidecarMetrics,
        *,
        admin: Callable[[bytes, bytes, bytes, str], Awaitable[tuple[int, bytes, bytes]]] | None = None,
        phase_header: str | None = None,
    ) -> None:
        self.table = table
        self.limits = table.config.limits
        self.limiter = limiter
        self.classifier = classifier
        self.pool = pool
        self.uplink = uplink
        self.metrics = metrics
        self.admin = admin
        self.phase_header = (phase_header or table.config.classifier.header).lower().encode()
        self.next_header = table.config.classifier.next_header.lower().encode()
        self.upstream_host = f"{pool.host}:{pool.port}".encode()
        self._conns: set[_ClientConn] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._hist: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._err_logged = -1e9
        self._err_suppressed = 0

    # ---- server ----------------------------------------------------------------------------
    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(self._client, host, port, backlog=1024, limit=1 << 16)
        prepare = getattr(self.uplink, "prepare_listener", None)
        if prepare is not None:  # SYN-ACKs in the control band (papers 001/003), not with small responses
            for sock in self.server.sockets:
                prepare(sock)
        self._sweeper = asyncio.create_task(self._sweep())

    async def _sweep(self) -> None:
        """Close client connections idle (no request in progress) longer than client_timeout:
        one timer for all connections instead of one per request."""
        while True:
            await asyncio.sleep(1.0)
            cutoff = time.monotonic() - self.limits.client_timeout
            for c in list(self._conns):
                if not c.busy and not c.ready and c.last_active < cutoff:
                    c.writer.close()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.server is not None:
            self.server.close()
        for c in list(self._conns):
            c.writer.close()
        # end the per-connection tasks here, not in the loop's final cancel-all, which would
        # report each still-waiting handler as a CancelledError traceback
        self._closing = True
        tasks = [t for t in self._tasks if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.pool.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _ClientConn(self, reader, writer)
        self._conns.add(conn)
        reading = asyncio.create_task(conn.read_loop())
        me = asyncio.current_task()
        for t in (me, reading):
            if t is not None:
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)
        try:
            while True:
                req = await conn.next_request()
                if req is None:
                    if conn.error is not None and not conn.ready:
                        status, reason, msg = conn.error
                        self.metrics.errors.labels(reason).inc()
                        await self._send(writer, _simple(status, msg, close=True))
                    break
                conn.busy = True
                keep = await self._handle(conn, req)
                conn.busy = False
                conn.last_active = time.monotonic()
                if not keep:
                    break
        except asyncio.CancelledError:
            # close() cancels us: end normally, since Python 3.11's start_server callback calls
            # task.exception() on a cancelled task and prints a CancelledError traceback
            if not self._closing:
                raise
        except (ConnectionError, OSError):
            pass
        finally:
            reading.cancel()
            self._conns.discard(conn)
            if conn.hold is not None:
                hold = conn.hold
                self._drop_hold(conn)
                self.limiter.abandon(hold)
            writer.close()

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        flow = self.uplink.open(writer, len(data))
        try:
            await flow.write(data)
        finally:
            flow.close()

    # ---- one request -----------------------------------------------------------------------
    def _hists(self, stage: int, phase: int) -> tuple[Any, Any]:
        h = self._hist.get((stage, phase))
        if h is None:
            labels = ("passthrough", "all") if stage == PASSTHROUGH else (self.table.names[stage], str(phase + 1))
            h = (self.metrics.duration.labels(*labels), self.metrics.queue_wait.labels(*labels))
            self._hist[(stage, phase)] = h
        return h

    async def _handle(self, conn: _ClientConn, req: _Request) -> bool:
        """Answer one request; False when the client connection must close."""
        writer = conn.writer
        url = req.url
        q = url.find(b"?")
        path = (url if q < 0 else url[:q]).decode("latin-1")
        if path.startswith("/-/") and self.admin is not None:
            status, ctype, body = await self.admin(req.method, path[2:].encode(), b"".join(req.body), conn.peer)
            head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (
                status, _REASONS.get(status, b"Error"), ctype, len(body))
            await self._send(writer, head + body)
            return req.keep_alive
        method = req.method.decode("latin-1")
        routed = self.table.route(method, path)
        phase_value = None
        for k, v in req.headers:
            if k.lower() == self.phase_header:
                phase_value = v
                break
        if routed is None:
            stage, route_key, phase = PASSTHROUGH, "", 0
        else:
            stage, route_key, route_phase = routed
            route_key = method + " " + path
            try:
                phase = self.classifier.start_phase(stage, route_key, phase_value, route_phase)
            except BadPhaseHeader as exc:
                self.metrics.errors.labels("bad_phase").inc()
                await self._send(writer, _simple(400, str(exc), close=not req.keep_alive))
                return req.keep_alive
        lim = self.limiter
        t = None
        hold = conn.hold
        if hold is not None:
            self._drop_hold(conn)
            if stage == hold.stage:
                gap = lim.clock() - hold.t_arrive
                t = lim.claim(hold, phase, route_key)
                if t is not None:
                    self.metrics.follow_up_gap.labels(self.table.names[stage]).observe(gap)
            else:
                lim.abandon(hold)  # the client asked for something else
        if t is None:
            t = lim.submit(stage, phase, route_key)
        if t is None:
            await self._send(writer, self._busy("queue full"))
            return req.keep_alive
        if t.status != ADMITTED:
            if not await self._wait(conn, t, stage):
                if conn.closed.done():
                    return False
                await self._send(writer, self._busy("queue timeout"))
                return req.keep_alive
        h_dur, h_wait = self._hists(stage, t.start_phase)
        h_wait.observe(t.t_admit - t.t_arrive)
        return await self._forward(conn, req, t, h_dur)

    def _follow(self, conn: _ClientConn, req: _Request, t: Ticket) -> tuple[int, int] | None:
        """(stage, phase) of the request this client sends next, when its stage has a ``next``."""
        if t.stage == PASSTHROUGH or not req.keep_alive or conn.closed.done():
            return None
        nxt = self.table.next_stage[t.stage]
        if nxt is None:
            return None
        value = next((v for k, v in req.headers if k.lower() == self.next_header), None)
        try:
            return nxt, self.classifier.start_phase(nxt, "", value, None)
        except BadPhaseHeader:
            self.metrics.errors.labels("bad_phase").inc()
            return nxt, self.classifier.prior_phase[nxt]

    def _drop_hold(self, conn: _ClientConn) -> None:
        if conn.hold_timer is not None:
            conn.hold_timer.cancel()
        conn.hold = conn.hold_timer = None

    def _lapse(self, conn: _ClientConn, hold: Ticket) -> None:
        if conn.hold is hold:
            self._drop_hold(conn)
            self.limiter.abandon(hold)

    def _log_upstream_error(self, detail: str) -> None:
        """At most one line a second while Apache is failing (with the count suppressed)."""
        now = time.monotonic()
        if now - self._err_logged < 1.0:
            self._err_suppressed += 1
            return
        extra = f" (+{self._err_suppressed} more since the last line)" if self._err_suppressed else ""
        log.warning("upstream error", extra={"event": "upstream_error", "detail": detail + extra})
        self._err_logged, self._err_suppressed = now, 0

    def _busy(self, why: str) -> bytes:
        return _simple(503, f"overtake sidecar: {why}; retry later", close=False,
                       extra=b"Retry-After: %d\r\n" % self.limits.retry_after)

    async def _wait(self, conn: _ClientConn, t: Ticket, stage: int) -> bool:
        """Wait for admission; on timeout or client disconnect withdraw the ticket.

        The task awaits the ticket's future itself (no asyncio.wait): admission wakes it in one
        loop step, so the released request reaches Apache with the least delay."""
        fut = t.future
        assert fut is not None
        timeout = self.table.queue_timeout(stage) if stage != PASSTHROUGH else self.limits.queue_timeout

        def interrupt(_: object = None) -> None:
            if not fut.done():
                fut.set_result(None)  # wakes us; t.status says whether we were admitted

        loop = asyncio.get_running_loop()
        timer = loop.call_later(timeout, interrupt)
        conn.closed.add_done_callback(interrupt)
        try:
            await fut
        except asyncio.CancelledError:
            self.limiter.cancel(t, "client_gone")
            raise
        finally:
            timer.cancel()
            conn.closed.remove_done_callback(interrupt)
        if t.status == ADMITTED:
            return True
        self.limiter.cancel(t, "client_gone" if conn.closed.done() else "queue_timeout")
        return False

    def _upstream_head(self, req: _Request, conn: _ClientConn, body_len: int) -> bytes:
        drop = _drop_set(req.headers)
        out = [b"%s %s HTTP/1.1\r\n" % (req.method, req.url)]
        xff = None
        has_host = False
        for k, v in req.headers:
            lk = k.lower()
            if lk in drop or lk == b"content-length" or lk == b"expect":
                continue
            if lk == b"x-forwarded-for":
                xff = v if xff is None else xff + b", " + v
                continue
            if lk == b"host":
                has_host = True
            out.append(k + b": " + v + b"\r\n")
        peer = conn.peer.encode()
        out.append(b"X-Forwarded-For: " + (xff + b", " + peer if xff else peer) + b"\r\n")
        if not has_host:
            out.append(b"Host: " + self.upstream_host + b"\r\n")
        if body_len or req.method in (b"POST", b"PUT", b"PATCH"):
            out.append(b"Content-Length: %d\r\n" % body_len)
        out.append(b"\r\n")
        return b"".join(out)

    def _client_head(self, resp: UpstreamResponse, req: _Request, body_len: int | None, chunked: bool) -> bytes:
        drop = _drop_set(resp.headers)
        out = [b"HTTP/1.1 %d %s\r\n" % (resp.status, resp.reason or _REASONS.get(resp.status, b""))]
        for k, v in resp.headers:
            lk = k.lower()
            if lk in drop or (lk == b"content-length" and body_len is not None):
                continue
            out.append(k + b": " + v + b"\r\n")
        if body_len is not None and not (req.method == b"HEAD" or resp.status in (204, 304) or resp.status < 200):
            out.append(b"Content-Length: %d\r\n" % body_len)
        if chunked:
            out.append(b"Transfer-Encoding: chunked\r\n")
        if not req.keep_alive:
            out.append(b"Connection: close\r\n")
        elif req.version == "1.0":
            out.append(b"Connection: keep-alive\r\n")
        out.append(b"\r\n")
        return b"".join(out)

    async def _forward(self, conn: _ClientConn, req: _Request, t: Ticket, h_dur: Any) -> bool:
        body = b"".join(req.body)
        head = self._upstream_head(req, conn, len(body))
        writer = conn.writer
        state: dict[str, Any] = {"flow": None, "chunked": False}

        async def stream(resp: UpstreamResponse) -> None:
            # response larger than the buffer: start the client response, pass chunks through
            if state["flow"] is None:
                cl = _content_length(resp.headers)
                state["chunked"] = chunked = cl is None and req.version == "1.1"
                if cl is None and not chunked:
                    req.keep_alive = False  # HTTP/1.0 client: close-delimited body
                hd = self._client_head(resp, req, None, chunked)
                flow = self.uplink.open(writer, None if cl is None else len(hd) + cl)
                state["flow"] = flow
                await flow.write(hd)
            data = b"".join(resp.body)
            resp.body.clear()
            if data:
                await state["flow"].write(b"%x\r\n%s\r\n" % (len(data), data) if state["chunked"] else data)

        try:
            resp = await self.pool.exchange(
                req.method, head, body, buffer_bytes=self.limits.response_buffer_bytes,
                timeout=self.limits.upstream_timeout, on_stream=stream,
            )
        except UpstreamError as exc:
            self.limiter.release(t, "failed")
            self.metrics.errors.labels("upstream_timeout" if "within" in str(exc) else "upstream_error").inc()
            self._log_upstream_error(str(exc))
            if state["flow"] is not None:
                state["flow"].close()
                return False
            await self._send(writer, _simple(502, f"overtake sidecar: Apache did not answer ({exc})", close=False))
            return req.keep_alive
        except (ConnectionError, OSError):
            # the client went away while we streamed to it: Apache's answer is complete or dropped
            self.limiter.release(t, "failed")
            if state["flow"] is not None:
                state["flow"].close()
            return False
        except BaseException:
            if t.status == ADMITTED:
                self.limiter.release(t, "failed")
            raise
        # the stage is complete: Apache has sent everything
        done = self.limiter.clock()
        admitted = self.limiter.admitted_total
        hold = self.limiter.release(t, "completed", self._follow(conn, req, t))
        if hold is not None:
            conn.hold = hold
            conn.hold_timer = asyncio.get_running_loop().call_later(
                self.limits.follow_up_timeout, self._lapse, conn, hold)
        if self.limiter.admitted_total != admitted:
            # the policy released waiting requests: let them reach Apache before we spend time on
            # this client (an idle gap on Apache's core costs every request behind it)
            await asyncio.sleep(0)
        h_dur.observe(done - t.t_arrive)
        if t.stage != PASSTHROUGH and self.classifier.mode == "learned":
            self.classifier.observe(t.stage, t.route, _demand(resp, done - t.t_admit))
        if state["flow"] is None:
            data = b"".join(resp.body)
            hd = self._client_head(resp, req, None if req.method == b"HEAD" else len(data), False)
            await self._send(writer, hd + data)
        else:
            flow = state["flow"]
            try:
                data = b"".join(resp.body)
                if state["chunked"]:
                    await flow.write((b"%x\r\n%s\r\n" % (len(data), data) if data else b"") + b"0\r\n\r\n")
                elif data:
                    await flow.write(data)
            finally:
                flow.close()
        return req.keep_alive


def _drop_set(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Hop-by-hop header names: the fixed list plus any named in Connection (RFC 9110 §7.6.1)."""
    extra = None
    for k, v in headers:
        if k.lower() == b"connection":
            for x in v.split(b","):
                t = x.strip().lower()
                if t not in (b"keep-alive", b"close"):
                    extra = (extra or set()) | {t}
    return _HOP if extra is None else _HOP | extra


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for k, v in headers:
        if k.lower() == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None


def _demand(resp: UpstreamResponse, sojourn: float) -> float:
    for k, v in resp.headers:
        if k.lower() == b"x-stage-cpu-us":
            try:
                return int(v) / 1e6
            except ValueError:
                break
    return sojourn

