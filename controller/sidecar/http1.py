"""HTTP/1.1 for the gateway: client connections parsed by httptools, and the heads it writes.

A :class:`ClientConnection` reads one client socket and queues complete requests (keep-alive and
pipelining; parsed ``_SLICE`` bytes per turn of the event loop, at most ``_MAX_PIPELINE`` queued
ahead, then reading pauses). A header block larger
than ``max_header_bytes`` is a 431, a body larger than ``max_body_bytes`` a 413 (admin paths
under ``/-/`` at most ``ADMIN_BODY_MAX``), a body that does not fit in the bodies' shared
:class:`~overtake.controller.sidecar.budget.ByteBudget` a 503 (its declared length is held from the head,
a chunked body's bytes as they come; given back when the gateway takes the next request or the
connection ends), a malformed request or an upgrade other than ``h2c``
(ignored, RFC 9113 §3.1) a 400: the connection records the error and ends; the gateway answers it
and closes. So is a head RFC 9112 makes an error (:func:`_head_error`: a request line other than
HTTP/1.0 or 1.1, no ``Host`` in HTTP/1.1 or two, ``Transfer-Encoding`` in HTTP/1.0) and a
WebSocket handshake with a body. An ``h2c`` offer with a body is ignored and the body read as
the request's (llhttp stops at the head of an upgrade); a chunked body's trailer fields are dropped.
Control-endpoint bodies are checked from the header block, before a byte of the body is read:
refused (403) on a connection the gateway allows none (``admin_body_max`` 0: not loopback, or
not the admin listener), 413 beyond ``admin_body_max`` (1 MiB).
``Expect: 100-continue`` is answered at once. Hop-by-hop headers (RFC 9110 §7.6.1, incl. those
named in ``Connection``) are dropped in both directions by :func:`upstream_head` and
:func:`client_head`.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque

import httptools

from overtake.controller.errors import ControllerError
from overtake.controller.sidecar.budget import ByteBudget
from overtake.controller.sidecar.stages import Limits
from overtake.controller.sidecar.upstream import UpstreamResponse

__all__ = ["REASONS", "BadTarget", "ClientConnection", "Request", "client_head", "content_length", "normalize_target",
           "simple_response", "upstream_head"]

_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
                  b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade"})
#: reason phrases of the statuses the sidecar writes itself
REASONS = {400: b"Bad Request", 403: b"Forbidden", 404: b"Not Found", 405: b"Method Not Allowed", 408: b"Request Timeout",
           413: b"Content Too Large", 431: b"Request Header Fields Too Large", 500: b"Internal Server Error",
           502: b"Bad Gateway", 503: b"Service Unavailable", 200: b"OK"}
#: pipelined requests parsed ahead of the one being answered, at most (then reading pauses)
_MAX_PIPELINE = 16
#: s between two looks at a paused connection's TCP state (:func:`_peer_reset`)
_RESET_POLL = 0.25
_TCP_CLOSE = 7  # tcp_states.h: what a socket becomes once the peer's RST arrived
#: bytes parsed per step of the event loop: at most _SLICE // 18 requests (the smallest request
#: line and empty header block, "GET / HTTP/1.1\r\n\r\n") beyond _MAX_PIPELINE are ever queued
_SLICE = 1024
#: x-overtake-gate: only the sidecar's own reaches Apache (a client's would hold a worker)
_SET_HERE = frozenset({b"content-length", b"expect", b"x-forwarded-host", b"x-overtake-gate"})
#: control endpoints take a baseline name, a path, a URL or a small .npz; a larger artifact goes by URL
ADMIN_BODY_MAX = 1 << 20
_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_HEXDIGITS = frozenset(b"0123456789abcdefABCDEF")


class BadTarget(ControllerError, ValueError):
    """A request-target the sidecar refuses (400): its routing could differ from Apache's."""


def _normalize_path(path: bytes) -> tuple[bytes, str]:
    """(normalised path, decoded path) of an origin-form path (starts with ``/``)."""
    if b"%" not in path and b"//" not in path and b"/." not in path:  # the common case, on every request
        return path, path.decode("utf-8", "surrogateescape")
    out = bytearray()
    i, n = 0, len(path)
    escaped = False
    while i < n:
        c = path[i]
        if c != 0x25:  # %
            out.append(c)
            i += 1
            continue
        hx = path[i + 1:i + 3]
        if len(hx) != 2 or hx[0] not in _HEXDIGITS or hx[1] not in _HEXDIGITS:
            raise BadTarget(f"bad percent-escape {path[i:i + 3].decode('latin-1')!r} in the path")
        v = int(hx, 16)
        if v in _UNRESERVED:  # RFC 3986 §6.2.2.2: %73 is s
            out.append(v)
        elif v == 0x2F or v == 0:  # Apache refuses these itself (AllowEncodedSlashes Off; %00)
            raise BadTarget(f"encoded {'slash' if v else 'NUL'} %{hx.decode()} in the path")
        else:  # RFC 3986 §6.2.2.1: upper-case hex
            out += b"%" + hx.upper()
            escaped = True
        i += 3
    # merge duplicate slashes (Apache's MergeSlashes) and remove dot segments (RFC 3986 §5.2.4);
    # "." and ".." cannot hide in a remaining escape (%2E was decoded above)
    segs = bytes(out).split(b"/")[1:]
    stack: list[bytes] = []
    last = len(segs) - 1
    for k, seg in enumerate(segs):
        if seg == b".":
            if k == last:
                stack.append(b"")
        elif seg == b"..":
            if stack:
                stack.pop()
            if k == last:
                stack.append(b"")
        elif seg or k == last:
            stack.append(seg)
    norm = b"/" + b"/".join(stack)
    if escaped:  # what Apache's r->uri (and so its <Location> and handler maps) will be
        dec = bytearray()
        j = 0
        while j < len(norm):
            if norm[j] == 0x25:
                dec.append(int(norm[j + 1:j + 3], 16))
                j += 3
            else:
                dec.append(norm[j])
                j += 1
        return norm, bytes(dec).decode("utf-8", "surrogateescape")
    return norm, norm.decode("utf-8", "surrogateescape")


def normalize_target(url: bytes, method: bytes) -> tuple[bytes, str, bytes | None]:
    """The request-target as the sidecar forwards it, the path it routes on, and the authority of
    an absolute-form target (RFC 9112 §3.2.2: it replaces ``Host``).

    The path is normalised as RFC 3986 §6.2.2 says (percent-decoding of unreserved characters,
    upper-case hex in the other escapes, dot-segment removal, §5.2.4) and duplicate slashes are
    merged, as Apache does (``MergeSlashes``); the routing path is that, percent-decoded, which
    is Apache's ``r->uri``. So ``//stage1``, ``/./stage1``, ``/%73tage1`` and ``/x/../stage1``
    route, and reach Apache, as ``/stage1``. The query is kept as sent; a fragment is dropped
    (Apache drops it too).

    Raises
    ------
    BadTarget
        A malformed percent-escape, an encoded ``/`` or NUL, a scheme other than http(s), a
        userinfo, or a target in authority-form.
    """
    authority: bytes | None = None
    if url.startswith(b"/"):
        rest = url
    elif url == b"*" and method == b"OPTIONS":
        return url, "*", None
    else:
        scheme, sep, after = url.partition(b"://")
        if not sep or scheme.lower() not in (b"http", b"https"):
            raise BadTarget("request-target must be a path (/...) or an http:// URL")
        cut = min((p for p in (after.find(b"/"), after.find(b"?"), after.find(b"#")) if p >= 0), default=len(after))
        authority, rest = after[:cut], after[cut:]
        if not authority or b"@" in authority:
            raise BadTarget("absolute request-target needs a host and no userinfo")
        if not rest.startswith(b"/"):
            rest = b"/" + rest
    h = rest.find(b"#")
    if h >= 0:
        rest = rest[:h]
    q = rest.find(b"?")
    path, query = (rest, b"") if q < 0 else (rest[:q], rest[q:])
    norm, decoded = _normalize_path(path)
    return norm + query, decoded, authority


class Request:
    """One parsed client request.

    ``url`` is the target as sent; ``target`` the normalised one forwarded to Apache and ``path``
    the decoded path routing sees (:func:`normalize_target`); ``bad_target`` says why the target
    was refused (400), if it was.
    """

    __slots__ = ("bad_target", "body", "expect", "headers", "held", "keep_alive", "method", "path", "resume_body",
                 "target", "upgrade", "url", "version")

    def __init__(self) -> None:
        self.method = b""
        self.url = b""
        self.target = b""
        self.path = ""
        self.bad_target: str | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.keep_alive = True
        self.version = "1.1"
        self.expect = False
        #: ``b"websocket"`` for a WebSocket upgrade (RFC 6455 §4.1): admitted as a request of its
        #: route, then answered as a tunnel
        self.upgrade: bytes | None = None
        #: an ``h2c`` offer with a body: the framing header of the body, which llhttp leaves
        #: unread at the upgrade point and a fresh parser reads for this request (:meth:`ClientConnection._feed`)
        self.resume_body: bytes | None = None
        #: bytes of the body budget this request holds (its declared length, or what it received)
        self.held = 0


class _Refusal(ControllerError):
    """A request refused from what was parsed so far: the connection answers ``status`` and ends."""

    def __init__(self, status: int, reason: str = "", message: str = "") -> None:
        self.status = status
        self.reason = reason
        self.message = message


def _head_error(r: Request) -> str | None:
    """Why a parsed request head is refused (400), or None: RFC 9112 §2.3 (the sidecar speaks
    HTTP/1.0 and 1.1; llhttp also accepts 0.9 and 2.0 request lines), §3.2 (exactly one ``Host``
    in HTTP/1.1, at most one in 1.0) and §6.1 (``Transfer-Encoding`` in HTTP/1.0 is faulty
    framing). Forwarded, each would reach Apache framed or routed otherwise than here."""
    if r.version not in ("1.0", "1.1"):
        return f"HTTP/{r.version} request line: the sidecar speaks HTTP/1.1 (and 1.0)"
    hosts = 0
    for k, _ in r.headers:
        lk = k.lower()
        if lk == b"host":
            hosts += 1
        elif lk == b"transfer-encoding" and r.version == "1.0":
            return "Transfer-Encoding in an HTTP/1.0 request is faulty framing (RFC 9112 §6.1); send Content-Length"
    if hosts > 1:
        return "more than one Host header field (RFC 9112 §3.2)"
    if hosts == 0 and r.version == "1.1":
        return "an HTTP/1.1 request needs a Host header field (RFC 9112 §3.2)"
    return None


def _upgrade_offer(headers: list[tuple[bytes, bytes]]) -> set[bytes] | None:
    """The protocols (lower case, no version) of an ``Upgrade`` that ``Connection`` names, which
    is what makes llhttp stop at the end of the head; None without one."""
    offer: bytes | None = None
    named = False
    for k, v in headers:
        lk = k.lower()
        if lk == b"upgrade":
            offer = v
        elif lk == b"connection":
            named = named or any(t.strip().lower() == b"upgrade" for t in v.split(b","))
    if offer is None or not named:
        return None
    return {p.strip().split(b"/")[0].lower() for p in offer.split(b",")}


def _body_framing(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The framing header of a request body (``Content-Length: N`` with N > 0, or a chunked
    ``Transfer-Encoding``), or None for a request without a body."""
    for k, _ in headers:
        if k.lower() == b"transfer-encoding":
            return b"Transfer-Encoding: chunked"  # llhttp refuses any other final coding
    n = content_length(headers)
    return b"Content-Length: %d" % n if n else None


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


class ClientConnection:
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

    # httptools callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._resuming:
            return  # the synthetic head before an h2c offer's body: the request is self.cur
        self.cur = Request()
        self.in_headers = True
        self.head_started = time.monotonic()
        self.body_started = None
        self.head_bytes = 0
        self.body_bytes = 0

    def on_url(self, url: bytes) -> None:
        assert self.cur is not None
        if self._resuming:
            return
        self.cur.url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.cur is not None
        if not self.in_headers:
            return  # a chunked body's trailer: not a header field (a second Host, a forged X-Forwarded-For)
        self.cur.headers.append((name, value))
        self._count_head(len(name) + len(value) + 4)

    def _count_head(self, n: int) -> None:
        self.head_bytes += n
        if self.head_bytes > self.limits.max_header_bytes:
            raise _Refusal(431)

    def on_headers_complete(self) -> None:
        if self._resuming:
            return
        r = self.cur
        assert r is not None
        self.in_headers = False
        self.head_started = None
        r.method = self.parser.get_method()
        r.keep_alive = self.parser.should_keep_alive()
        r.version = self.parser.get_http_version()
        err = _head_error(r)
        if err is not None:
            raise _Refusal(400, "bad_request", err)
        self._check_upgrade_body(r)
        try:
            r.target, r.path, _ = normalize_target(r.url, r.method)
        except BadTarget as exc:
            r.bad_target, r.target = str(exc), r.url
        if r.path.startswith("/-/"):
            self._check_admin_body(r)
        has_body = self._hold_declared(r)
        for k, v in r.headers:
            if k.lower() == b"expect" and v.lower() == b"100-continue":
                r.expect = True
                # behind an answer still being written (pipelining), the interim response waits
                # for it (:meth:`answered`): written now it would land inside that answer's body
                if not (self.busy or self.ready):
                    self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    r.expect = False
        if has_body and not r.expect:  # a deferred 100 Continue starts it (answered)
            self.body_started = time.monotonic()

    def _hold_declared(self, r: Request) -> bool:
        """A request with a body: hold its declared length in the body budget, refused before a
        byte of it is read when it does not fit (503) or exceeds ``max_body_bytes`` (413). True
        if the request has a body."""
        if _body_framing(r.headers) is None:
            return False
        declared = content_length(r.headers) or 0  # chunked: held as it comes (on_body)
        if declared > self.limits.max_body_bytes and not r.path.startswith("/-/"):
            raise _Refusal(413)
        self._hold(r, declared)
        return True

    def _hold(self, r: Request, n: int) -> None:
        if not self.budget.take(n):
            raise _Refusal(503, "body_budget", f"overtake sidecar: request bodies held in memory would exceed "
                           f"limits.body_budget_bytes ({self.budget.limit} bytes); retry later")
        r.held += n

    def release(self, r: Request | None) -> None:
        """``r``'s body is no longer held: give its bytes back to the budget."""
        if r is not None and r.held:
            self.budget.give(r.held)
            r.held = 0

    def release_all(self) -> None:
        """The connection ends: every request it still holds gives its bytes back."""
        for r in (self._served, self.cur, *self.ready):
            self.release(r)

    def body_late(self, now: float) -> bool:
        """Is the body being read behind its deadline: ``body_timeout`` seconds plus one per
        ``body_min_rate`` bytes received (Apache's RequestReadTimeout ``body=…,MinRate=…``), so
        a body that stalls or trickles ends while one at a fair rate goes on?"""
        t0 = self.body_started
        return t0 is not None and now - t0 > self.limits.body_timeout + self.body_bytes / self.limits.body_min_rate

    def _check_upgrade_body(self, r: Request) -> None:
        """An upgrade offer on a request with a body: llhttp stops at the head and would take the
        body for the next request (a smuggled one). An ``h2c`` offer is ignored and its body read
        for it (``resume_body``); a WebSocket handshake has no body (RFC 6455 §4.1): 400."""
        protocols = _upgrade_offer(r.headers)
        framing = _body_framing(r.headers) if protocols is not None and r.method != b"CONNECT" else None
        if framing is None or protocols is None:
            return
        if protocols == {b"h2c"}:
            r.resume_body = framing
        elif b"websocket" in protocols:
            raise _Refusal(400, "bad_request", "a WebSocket handshake carries no body (RFC 6455 §4.1)")

    def _check_admin_body(self, r: Request) -> None:
        """Refuse a control-endpoint body from its header block, before reading it."""
        declared, chunked = 0, False
        for k, v in r.headers:
            lk = k.lower()
            if lk == b"content-length" and v.strip().isdigit():
                declared = int(v)
            elif lk == b"transfer-encoding":
                chunked = True
        if (declared or chunked) and self.admin_body_max <= 0:
            raise _Refusal(403, "admin_body_refused", self.admin_refusal)
        if declared > self.admin_body_max:
            raise self._admin_too_large()

    def _admin_too_large(self) -> _Refusal:
        return _Refusal(413, "body_too_large", f"control endpoint body larger than {self.admin_body_max} bytes; "
                         "give a larger policy artifact as a URL")

    def on_body(self, body: bytes) -> None:
        assert self.cur is not None
        self.body_bytes += len(body)
        if self.cur.path.startswith("/-/"):
            if self.body_bytes > self.admin_body_max:
                raise self._admin_too_large()
        elif self.body_bytes > self.limits.max_body_bytes:
            raise _Refusal(413)
        if self.body_bytes > self.cur.held:  # beyond its declared length: a chunked body
            self._hold(self.cur, self.body_bytes - self.cur.held)
        self.cur.body.append(body)

    def on_message_complete(self) -> None:
        assert self.cur is not None
        if self.cur.resume_body is not None:
            return  # llhttp's upgrade point: the body follows (_feed)
        self.parsed += 1
        self.ready.append(self.cur)
        self.cur = None
        self.body_started = None
        self._wake()

    # --------------------------------------------------------------------------------------
    def _wake(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    def _feed(self, data: bytes) -> None:
        """Parse ``data``. An ``Upgrade: h2c`` request is served as plain HTTP/1.1 (RFC 9113 §3.1:
        a server that does not speak h2c ignores the offer), and parsing goes on after it with a
        fresh parser; any other upgrade raises ``HttpParserUpgrade``."""
        while True:
            try:
                self.parser.feed_data(data)
                return
            except httptools.HttpParserCallbackError as exc:
                if isinstance(exc.__context__, _Refusal):
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
            if _body_framing(r.headers) is not None:
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
                except _Refusal as exc:
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


def simple_response(status: int, text: str, *, close: bool, extra: bytes = b"") -> bytes:
    """A whole plain-text response written by the sidecar itself."""
    body = (text + "\n").encode()
    return (b"HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n%s%s\r\n"
            % (status, REASONS.get(status, b"Error"), len(body), extra,
               b"Connection: close\r\n" if close else b"")) + body


def upstream_head(req: Request, peer: str, body_len: int, upstream_host: bytes, cpu_class: int | None = None,
                  upgrade: bytes | None = None, gate: bytes | None = None) -> bytes:
    """The request head sent to Apache: hop-by-hop headers dropped, ``X-Forwarded-For`` appended,
    ``X-Forwarded-Proto`` kept if the request has one (the gateway strips it from untrusted
    clients: a trusted front end that terminated TLS says ``https``), else ``http`` (the scheme
    the client used to reach the sidecar), ``X-Forwarded-Host`` (the client's ``Host``) set in
    place of any the client sent, ``Host``
    added if missing, the (de-chunked) body's ``Content-Length``; with ``cpu_class`` the sidecar's
    ``X-Overtake-Class`` (mod_overtake_prio's starting level) replaces the client's; ``gate`` is the
    ``X-Overtake-Gate`` value of a request sent while queued (:mod:`overtake.controller.sidecar.gate`); a
    client's own ``X-Overtake-Gate`` never passes."""
    drop = _drop_set(req.headers)
    if cpu_class is not None:
        drop = drop | {b"x-overtake-class"}
    out = [b"%s %s HTTP/1.1\r\n" % (req.method, req.target or req.url)]
    xff = None
    has_host = has_proto = False
    host = b""
    for k, v in req.headers:
        lk = k.lower()
        if lk in drop or lk in _SET_HERE:
            continue
        if lk == b"x-forwarded-for":
            xff = v if xff is None else xff + b", " + v
            continue
        if lk == b"host":
            has_host, host = True, v
        elif lk == b"x-forwarded-proto":
            has_proto = True
        out.append(k + b": " + v + b"\r\n")
    p = peer.encode()
    out.append(b"X-Forwarded-For: " + (xff + b", " + p if xff else p) + b"\r\n")
    if not has_proto:
        out.append(b"X-Forwarded-Proto: http\r\n")
    if host:
        out.append(b"X-Forwarded-Host: " + host + b"\r\n")
    if not has_host:
        out.append(b"Host: " + upstream_host + b"\r\n")
    if cpu_class is not None:
        out.append(b"X-Overtake-Class: %d\r\n" % cpu_class)
    if gate is not None:
        out.append(b"X-Overtake-Gate: " + gate + b"\r\n")
    if upgrade is not None:  # hop-by-hop: the sidecar asks Apache for the upgrade itself
        out.append(b"Connection: Upgrade\r\nUpgrade: %s\r\n" % upgrade)
    if body_len or req.method in (b"POST", b"PUT", b"PATCH"):
        out.append(b"Content-Length: %d\r\n" % body_len)
    out.append(b"\r\n")
    return b"".join(out)


def client_head(resp: UpstreamResponse, req: Request, body_len: int | None, chunked: bool) -> bytes:
    """The response head sent to the client: Apache's, hop-by-hop headers dropped, with
    ``Content-Length`` (``body_len``) or chunked framing and the client's keep-alive."""
    drop = _drop_set(resp.headers)
    out = [b"HTTP/1.1 %d %s\r\n" % (resp.status, resp.reason or REASONS.get(resp.status, b""))]
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


def content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The ``Content-Length`` header's value; None if absent or not a number."""
    for k, v in headers:
        if k.lower() == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None
