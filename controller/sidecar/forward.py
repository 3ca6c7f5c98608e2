"""Forwarding an admitted request to Apache and relaying the answer to the client.

The request goes to Apache on a keep-alive connection of the
:class:`overtake.controller.sidecar.upstream.UpstreamPool`; the stage is complete the moment Apache's
*whole* response has been received (buffered up to ``response_buffer_bytes``, then streamed,
chunked to HTTP/1.1 clients when Apache gave no length). The gateway's ``complete`` callback
releases the permit then. A response larger than the buffer goes to the client through a
:class:`~overtake.controller.sidecar.spool.Spool` (memory, then a temporary file up to
``response_spill_bytes``, and all spools together up to ``spool_budget_bytes``: beyond it
Apache's answer is read at its client's pace), so a slow reader does not hold a stage slot or
the passthrough cap while Apache has finished; each write to the client must make progress within
``client_timeout``. Every response goes to the client through
the uplink (:mod:`overtake.controller.uplink`). Apache unreachable or broken mid-answer
releases the permit as ``failed`` and answers 502 (or closes a response already started).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httptools

from overtake.controller.errors import ControllerError
from overtake.controller.sidecar.budget import ByteBudget
from overtake.controller.sidecar.heads import client_head, simple_response, upstream_head
from overtake.controller.sidecar.http1 import ClientConnection
from overtake.controller.sidecar.limiter import ADMITTED, Limiter, Ticket
from overtake.controller.sidecar.metrics import SidecarMetrics
from overtake.controller.sidecar.request import Request, content_length
from overtake.controller.sidecar.spool import Spool
from overtake.controller.sidecar.stages import Limits
from overtake.controller.sidecar.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from overtake.controller.uplink import Uplink

__all__ = ["Forwarder"]


class _AnswerEnd:
    """httptools callbacks: has the answer been read to its end?"""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False

    def on_message_complete(self) -> None:
        self.done = True


class ClientGone(ControllerError):
    """The client connection failed while its response streamed (counted ``client_abort``)."""


log = logging.getLogger("overtake.sidecar")


def _raise_if_gone(state: dict[str, Any]) -> None:
    """The drain task has ended early: the client stopped reading or went away."""
    d: asyncio.Task[None] | None = state["drain"]
    if d is not None and d.done():
        exc = None if d.cancelled() else d.exception()
        raise ClientGone(str(exc) if exc else "client gone")


class Forwarder:
    """Apache's side of a request and the response's way back (module docstring)."""

    def __init__(self, pool: UpstreamPool, uplink: Uplink, limiter: Limiter, metrics: SidecarMetrics,
                 limits: Limits) -> None:
        self.pool = pool
        self.uplink = uplink
        self.limiter = limiter
        self.metrics = metrics
        self.limits = limits
        self.upstream_host = f"{pool.host}:{pool.port}".encode()
        self._err_logged = -1e9
        self._err_suppressed = 0
        #: responses on their way to slow clients; their bytes on disk are a gauge
        self.spools: set[Spool] = set()
        #: bytes on disk of all of them (limits.spool_budget_bytes; beyond it, Apache waits)
        self.spool_budget = ByteBudget(limits.spool_budget_bytes)
        self.tunnels: set[asyncio.Task[Any]] = set()  #: open WebSocket tunnels (``overtake_tunnels``)
        metrics.tunnels.set_function(lambda: float(len(self.tunnels)))
        metrics.spool_bytes.set_function(lambda: float(self.spool_budget.used))

    async def send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        """Write one whole response through the uplink."""
        flow = self.uplink.open(writer, len(data))
        try:
            await flow.write(data)
        finally:
            flow.close()

    def _log_upstream_error(self, detail: str) -> None:
        """At most one line a second while Apache is failing (with the count suppressed)."""
        now = time.monotonic()
        if now - self._err_logged < 1.0:
            self._err_suppressed += 1
            return
        extra = f" (+{self._err_suppressed} more since the last line)" if self._err_suppressed else ""
        log.warning("upstream error", extra={"event": "upstream_error", "detail": detail + extra})
        self._err_logged, self._err_suppressed = now, 0

    async def forward(self, conn: ClientConnection, req: Request, t: Ticket,
                      complete: Callable[[UpstreamResponse], Awaitable[None]], cpu_class: int | None = None,
                      gate: bytes | None = None, admitted: Callable[[], Awaitable[bool]] | None = None) -> bool:
        """Send ``req`` (admitted as ``t``) to Apache, ``await complete(resp)`` once its whole
        response is in, then relay it; False when the client connection must close.
        ``cpu_class``: the ``X-Overtake-Class`` level to send (``--cpu-priority class``).
        ``gate``/``admitted``: ``t`` is still queued; the request goes out now with the gate
        header and ``admitted()`` waits for the decision (:class:`~overtake.controller.sidecar.upstream.Withdrawn`
        propagates when it is withdrawn)."""
        body = b"".join(req.body)
        head = upstream_head(req, conn.peer, len(body), self.upstream_host, cpu_class, gate=gate)
        writer = conn.writer
        state: dict[str, Any] = {"flow": None, "chunked": False, "spool": None, "drain": None}

        async def stream(resp: UpstreamResponse) -> None:
            await self._stream(writer, req, state, resp)

        try:
            resp = await self.pool.exchange(
                req.method, head, body, buffer_bytes=self.limits.response_buffer_bytes,
                timeout=self.limits.upstream_timeout, on_stream=stream, admitted=admitted,
            )
        except UpstreamError as exc:
            return await self._upstream_failed(writer, req, t, state, exc)
        except (ClientGone, ConnectionError, OSError):
            # the client went away while we streamed to it: Apache's answer is complete or dropped
            self._end_early(t, state, "client_abort")
            self.metrics.errors.labels("client_abort").inc()
            return False
        except BaseException:
            self._end_early(t, state, "failed")
            raise
        await complete(resp)  # the stage is complete: Apache has sent everything
        return await self._relay(writer, req, resp, state)

    def _end_early(self, t: Ticket, state: dict[str, Any], outcome: str) -> None:
        """The exchange ended without a response to relay: free the request's slot (if admitted)
        with ``outcome`` and drop the client response begun, if any."""
        if t.status == ADMITTED:
            self.limiter.release(t, outcome)
        if state["flow"] is not None:
            self._abandon(state)

    async def _stream(self, writer: asyncio.StreamWriter, req: Request, state: dict[str, Any],
                      resp: UpstreamResponse) -> None:
        """The response is larger than the buffer: start the client response; Apache's bytes go to
        the spool at Apache's pace, a drain task writes them at the client's."""
        if state["flow"] is None:
            self._start_client_response(writer, req, state, resp)
        _raise_if_gone(state)
        data = b"".join(resp.body)
        resp.body.clear()
        if data:
            state["spool"].append(b"%x\r\n%s\r\n" % (len(data), data) if state["chunked"] else data)
            await state["spool"].wait_room(self.limits.response_spill_bytes)  # beyond it, the client's pace
            _raise_if_gone(state)

    def _start_client_response(self, writer: asyncio.StreamWriter, req: Request, state: dict[str, Any],
                               resp: UpstreamResponse) -> None:
        """The client response's head into a new spool, its framing (Content-Length as Apache's,
        else chunked to an HTTP/1.1 client, else close-delimited) and the drain task writing it."""
        cl = content_length(resp.headers)
        state["chunked"] = chunked = cl is None and req.version == "1.1"
        if cl is None and not chunked:
            req.keep_alive = False  # HTTP/1.0 client: close-delimited body
        hd = client_head(resp, req, None, chunked)
        flow = self.uplink.open(writer, None if cl is None else len(hd) + cl)
        spool = Spool(self.limits.response_buffer_bytes, budget=self.spool_budget)
        spool.append(hd)
        state.update(flow=flow, spool=spool, drain=asyncio.create_task(self._drain(spool, flow)))

    async def _upstream_failed(self, writer: asyncio.StreamWriter, req: Request, t: Ticket, state: dict[str, Any],
                               exc: UpstreamError) -> bool:
        """Apache did not answer ``req``: free its slot, count it, and answer 502 if nothing was sent yet."""
        if t.status == ADMITTED:
            self.limiter.release(t, "failed")
        else:  # sent ahead to the gate and lost before its admission
            self.limiter.cancel(t, "upstream_error")
        self.metrics.errors.labels("upstream_timeout" if "within" in str(exc) else "upstream_error").inc()
        self._log_upstream_error(str(exc))
        if state["flow"] is not None:
            self._abandon(state)
            return False
        await self.send(writer, simple_response(502, f"overtake sidecar: Apache did not answer ({exc})", close=False))
        return req.keep_alive

    async def _relay(self, writer: asyncio.StreamWriter, req: Request, resp: UpstreamResponse,
                     state: dict[str, Any]) -> bool:
        """Apache's whole response is in: send it (buffered) or finish the stream and wait for the client."""
        if state["flow"] is None:
            data = b"".join(resp.body)
            hd = client_head(resp, req, None if req.method == b"HEAD" else len(data), False)
            await self.send(writer, hd + data)
        else:
            spool, drain = state["spool"], state["drain"]
            data = b"".join(resp.body)
            spool.append((b"%x\r\n%s\r\n" % (len(data), data) if data else b"") + b"0\r\n\r\n"
                         if state["chunked"] else data)
            spool.feed_eof()
            try:
                await drain  # the slot is free already; this connection waits for its client
            except (ConnectionError, OSError, TimeoutError):
                self.metrics.errors.labels("client_abort").inc()
                return False
            finally:
                self._abandon(state)
        return req.keep_alive

    async def tunnel(self, conn: ClientConnection, req: Request) -> int:
        """A WebSocket upgrade (RFC 6455 §4), admitted already: Apache's answer relayed and, on
        101, the bytes both ways until one side closes; the status is returned, the connection
        then closes. At most ``limits.max_tunnels`` are open (503 beyond), each on its own
        connection to Apache."""
        writer = conn.writer
        if len(self.tunnels) >= self.limits.max_tunnels:
            self.metrics.errors.labels("tunnel_limit").inc()
            await self.send(writer, simple_response(503, f"overtake sidecar: {self.limits.max_tunnels} tunnels open "
                                                    "(limits.max_tunnels)", close=True))
            return 503
        body = b"".join(req.body)
        head = upstream_head(req, conn.peer, len(body), self.upstream_host, upgrade=req.upgrade)
        try:
            async with asyncio.timeout(self.limits.upstream_connect_timeout):
                ur, uw = await asyncio.open_connection(self.pool.host, self.pool.port)
        except (OSError, TimeoutError) as exc:
            self.metrics.errors.labels("upstream_error").inc()
            await self.send(writer, simple_response(502, f"overtake sidecar: Apache did not answer ({exc})", close=True))
            return 502
        me = asyncio.current_task()
        assert me is not None
        self.tunnels.add(me)
        try:
            uw.write(head + body)
            try:
                async with asyncio.timeout(self.limits.upstream_timeout):
                    answer = await ur.readuntil(b"\r\n\r\n")
                status = int(answer[9:12])
            except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
                self.metrics.errors.labels("upstream_error").inc()
                await self.send(writer, simple_response(502, f"overtake sidecar: no upgrade answer from Apache ({exc})",
                                                        close=True))
                return 502
            if status != 101:  # refused: relay Apache's answer, then close
                await self._relay_answer(ur, writer, answer)
                return status
            writer.write(answer)

            async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, first: bytes = b"") -> None:
                with contextlib.suppress(ConnectionError, OSError):
                    if first:
                        w.write(first)
                    while data := await r.read(65536):
                        w.write(data)
                        await w.drain()
                    if w.can_write_eof():
                        w.write_eof()

            ups = asyncio.create_task(pipe(conn.reader, uw, conn.tunnel_rest or b""))
            down = asyncio.create_task(pipe(ur, writer))
            _, pending = await asyncio.wait({ups, down}, return_when=asyncio.FIRST_COMPLETED)
            if pending:  # one side closed: the other gets a moment to finish its close handshake
                _, pending = await asyncio.wait(pending, timeout=1.0)
            for t in pending:
                t.cancel()
            return 101
        finally:
            self.tunnels.discard(me)
            uw.close()

    async def _relay_answer(self, ur: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        """Apache's answer to a handshake it did not upgrade, relayed to its end: Apache may keep
        the connection open after it, and the tunnel's slot is held until this returns."""
        end = _AnswerEnd()
        parser = httptools.HttpResponseParser(end)
        data = head
        with contextlib.suppress(ConnectionError, OSError, TimeoutError, httptools.HttpParserError):
            while data:
                async with asyncio.timeout(self.limits.upstream_timeout):
                    parser.feed_data(data)
                    writer.write(data)
                    await writer.drain()
                    if end.done:
                        return
                    data = await ur.read(65536)

    async def _drain(self, spool: Spool, flow: Any) -> None:
        """Copy ``spool`` to the client; a write that makes no progress within ``client_timeout``
        ends it (TimeoutError), as a client that went away does (ConnectionError)."""
        self.spools.add(spool)
        try:
            while chunk := await spool.read():
                async with asyncio.timeout(self.limits.client_timeout):
                    await flow.write(chunk)
        finally:
            spool.close()  # wakes a producer held back by the spill cap
            self.spools.discard(spool)

    def _abandon(self, state: dict[str, Any]) -> None:
        """Stop the drain task, drop the spool, close the flow (idempotent)."""
        d: asyncio.Task[None] | None = state["drain"]
        if d is not None and not d.done():
            d.cancel()
        if d is not None and d.done() and not d.cancelled():
            d.exception()  # retrieved: a client that went away is not an unhandled error
        spool: Spool | None = state["spool"]
        if spool is not None:
            spool.close()
        if state["flow"] is not None:
            state["flow"].close()
