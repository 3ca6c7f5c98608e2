"""The parser's side of a client connection: httptools' callbacks build each :class:`Request`
and hold it to the connection's limits as it is read.

A header block larger than ``max_header_bytes`` is a 431, a body larger than ``max_body_bytes``
a 413 (admin paths under ``/-/`` at most ``admin_body_max``), a body that does not fit in the
bodies' shared :class:`~overtake.controller.sidecar.budget.ByteBudget` a 503 (its declared length
is held from the head, a chunked body's bytes as they come; given back when the gateway takes
the next request or the connection ends). A head RFC 9112 makes an error
(:func:`~overtake.controller.sidecar.request.head_error`) and a WebSocket handshake with a body
are a 400. Control-endpoint bodies are checked from the header block, before a byte of the body
is read. ``Expect: 100-continue`` is answered at once, or after the answer being written.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import httptools

from overtake.controller.sidecar.budget import ByteBudget
from overtake.controller.sidecar.request import Refusal, Request, body_framing, content_length, head_error, upgrade_offer
from overtake.controller.sidecar.stages import Limits
from overtake.controller.sidecar.target import BadTarget, normalize_target

__all__ = ["RequestParsing"]


class RequestParsing:
    """httptools' callbacks and the limits they enforce; :class:`~overtake.controller.sidecar.http1.ClientConnection`
    adds the socket (reading, pipelining, upgrades)."""

    limits: Limits
    budget: ByteBudget
    writer: asyncio.StreamWriter
    parser: httptools.HttpRequestParser
    cur: Request | None
    ready: deque[Request]
    parsed: int
    busy: bool
    head_bytes: int
    body_bytes: int
    in_headers: bool
    head_started: float | None
    body_started: float | None
    admin_body_max: int
    admin_refusal: str
    _served: Request | None
    _resuming: bool
    wake: asyncio.Future[None] | None

    def _wake(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

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
            raise Refusal(431)

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
        err = head_error(r)
        if err is not None:
            raise Refusal(400, "bad_request", err)
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
        if body_framing(r.headers) is None:
            return False
        declared = content_length(r.headers) or 0  # chunked: held as it comes (on_body)
        if declared > self.limits.max_body_bytes and not r.path.startswith("/-/"):
            raise Refusal(413)
        self._hold(r, declared)
        return True

    def _hold(self, r: Request, n: int) -> None:
        if not self.budget.take(n):
            raise Refusal(503, "body_budget", f"overtake sidecar: request bodies held in memory would exceed "
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
        protocols = upgrade_offer(r.headers)
        framing = body_framing(r.headers) if protocols is not None and r.method != b"CONNECT" else None
        if framing is None or protocols is None:
            return
        if protocols == {b"h2c"}:
            r.resume_body = framing
        elif b"websocket" in protocols:
            raise Refusal(400, "bad_request", "a WebSocket handshake carries no body (RFC 6455 §4.1)")

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
            raise Refusal(403, "admin_body_refused", self.admin_refusal)
        if declared > self.admin_body_max:
            raise self._admin_too_large()

    def _admin_too_large(self) -> Refusal:
        return Refusal(413, "body_too_large", f"control endpoint body larger than {self.admin_body_max} bytes; "
                         "give a larger policy artifact as a URL")

    def on_body(self, body: bytes) -> None:
        assert self.cur is not None
        self.body_bytes += len(body)
        if self.cur.path.startswith("/-/"):
            if self.body_bytes > self.admin_body_max:
                raise self._admin_too_large()
        elif self.body_bytes > self.limits.max_body_bytes:
            raise Refusal(413)
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

