"""The gateway: an asyncio HTTP/1.1 reverse proxy in front of Apache (the front end of van der Weij
et al., "Dynamic thread assignment", §4.2).

The gateway holds the listeners and the client connections and runs each request through its
steps, in order (HAProxy's analysers, starlette's middleware): :class:`~.screening.Screening`
(refuse_bad_target, hide_private, strip_untrusted, serve_admin, route),
:class:`~.admission.Admission` (tunnel, reserve, admit) and :class:`~.dispatch.Dispatch`
(forward). HTTP parsing is in :mod:`overtake.controller.sidecar.http1`, Apache's side and the
response relay in :mod:`overtake.controller.sidecar.forward`. For every request it
asks :class:`overtake.controller.sidecar.stages.StageTable` for the stage,
:class:`overtake.controller.sidecar.classifier.Classifier` for the phase, then holds it in
:class:`overtake.controller.sidecar.limiter.Limiter` until the policy starts a thread for it, forwards it to Apache
on a keep-alive connection, and releases the permit the moment Apache's *whole* response has
been received (buffered up to ``response_buffer_bytes``, then streamed; so a slow client never
holds a stage slot unless the response is larger than the buffer). Responses go to the client
through the uplink (:mod:`overtake.controller.uplink`).

HTTP handling: keep-alive and pipelining on the client side (requests are answered in order),
hop-by-hop headers removed both ways (RFC 9110 §7.6.1, incl. those named in ``Connection``),
``X-Forwarded-For`` appended, ``Expect: 100-continue`` answered, chunked request bodies
de-chunked and sent with Content-Length. Malformed requests → 400, header block larger than
``max_header_bytes`` → 431, body larger than ``max_body_bytes`` → 413, a head or body behind its
deadline → 408, a body beyond the bodies' memory budget → 503; each closes only its own
connection. Queue full or queue timeout → 503 with ``Retry-After``; a client that disconnects
while queued is withdrawn (never sent to Apache); Apache unreachable or broken mid-answer → 502.

Admin paths (:mod:`overtake.controller.sidecar.admin`): every path of a separate admin listener
(``start_admin``), and the ``/-/`` paths of the public one, which the admin side answers knowing
they came from there (it serves only health checks to it). ``drain``
stops accepting and lets the requests already received finish (SIGTERM). ``on_request`` gets
one :class:`overtake.controller.sidecar.request_log.RequestRecord` per answered request (the access log).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from overtake.controller.sidecar.admission import Admission
from overtake.controller.sidecar.budget import ByteBudget
from overtake.controller.sidecar.classifier import Classifier
from overtake.controller.sidecar.dispatch import CpuClass, Dispatch
from overtake.controller.sidecar.exchange import Exchange, StageHistograms, Step, Wiring
from overtake.controller.sidecar.forward import Forwarder
from overtake.controller.sidecar.gate import Gate
from overtake.controller.sidecar.heads import simple_response
from overtake.controller.sidecar.http1 import ClientConnection
from overtake.controller.sidecar.limiter import Limiter
from overtake.controller.sidecar.metrics import SidecarMetrics
from overtake.controller.sidecar.request import Request
from overtake.controller.sidecar.request_log import RequestRecord
from overtake.controller.sidecar.reservations import Reservations
from overtake.controller.sidecar.screening import Screening
from overtake.controller.sidecar.stages import StageTable
from overtake.controller.sidecar.upstream import UpstreamPool
from overtake.controller.uplink import Uplink

__all__ = ["Gateway"]

log = logging.getLogger("overtake.sidecar")
_DRAIN_QUIET = 0.25  # s without a byte before an idle connection is closed by drain()


class Gateway:
    """The proxy. Build with the pieces, then ``await gateway.start(host, port)``; ``close()`` ends it."""

    def __init__(
        self,
        table: StageTable,
        limiter: Limiter,
        classifier: Classifier,
        pool: UpstreamPool,
        uplink: Uplink,
        metrics: SidecarMetrics,
        *,
        admin: Callable[[Request, bool], Awaitable[tuple[int, bytes, bytes]]] | None = None,
        phase_header: str | None = None,
        admin_body_cap: Callable[[str], tuple[int, str]] | None = None,
        on_request: Callable[[RequestRecord], None] | None = None,
        trusted_sources: Sequence[str] = ("127.0.0.0/8", "::1/128"),
        cpu_class: CpuClass | None = None,
        gate: Gate | None = None,
    ) -> None:
        self.table = table
        self.limits = table.config.limits
        self.limiter = limiter
        self.pool = pool
        self.uplink = uplink
        self.metrics = metrics
        self.admin = admin
        #: (body bytes a /-/ request from this peer may carry, the refusal when 0)
        self.admin_body_cap = admin_body_cap
        self.on_request = on_request
        self.admin_server: asyncio.base_events.Server | None = None
        self._admin_conns: set[ClientConnection] = set()
        self._draining = False
        self._current: dict[ClientConnection, Request] = {}
        self.forwarder = Forwarder(pool, uplink, limiter, metrics, self.limits)
        #: request bodies held in memory by all connections (limits.body_budget_bytes)
        self.body_budget = ByteBudget(self.limits.body_budget_bytes)
        phase = (phase_header or table.config.classifier.header).lower().encode()
        nxt = table.config.classifier.next_header.lower().encode()
        self.holds = Reservations(limiter)
        wiring = Wiring(limiter, metrics, self.forwarder, self.holds, StageHistograms(metrics), gate)
        self.screening = Screening(table, classifier, metrics, self.holds, admin=admin, phase_header=phase,
                                   next_header=nxt, trusted_sources=trusted_sources)
        self.admission = Admission(table, wiring)
        self.dispatch = Dispatch(table, wiring, classifier, next_header=nxt, withdrawn=self.admission.withdrawn,
                                 cpu_class=cpu_class)
        s, a = self.screening, self.admission
        #: the request path, in order: each step answers the request or returns None to pass it
        #: on; :meth:`Dispatch.forward` always answers
        self.steps: tuple[Step, ...] = (s.refuse_bad_target, s.hide_private, s.strip_untrusted, s.serve_admin,
                                        s.route, a.tunnel, a.reserve, a.admit, self.dispatch.forward)
        self._conns: set[ClientConnection] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self.server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def gate_on(self) -> bool:
        """Do queued requests wait in Apache's gate (the sidecar sets it once Apache reports the
        same gate file)?"""
        return self.admission.gate_on

    @gate_on.setter
    def gate_on(self, on: bool) -> None:
        self.admission.gate_on = on

    def retable(self, table: StageTable) -> None:
        """Run with ``table`` (a reloaded stages file whose stages route as the running ones)."""
        self.table = table
        self.limits = self.forwarder.limits = table.config.limits
        self.screening.table = table
        self.admission.retable(table)
        self.dispatch.retable(table)

    # ---- server ----------------------------------------------------------------------------
    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(self._client, host, port, backlog=1024, limit=1 << 16)
        prepare = getattr(self.uplink, "prepare_listener", None)
        if prepare is not None:  # SYN-ACKs in the control band, not with small responses
            # (Harchol-Balter et al., "Size-based scheduling"; Schroeder and Harchol-Balter)
            for sock in self.server.sockets:
                prepare(sock)
        self._sweeper = asyncio.create_task(self._sweep())

    async def start_admin(self, host: str, port: int) -> None:
        """Serve the /-/ paths on their own listener; the public one no longer does."""
        self.admin_server = await asyncio.start_server(self._admin_client, host, port, limit=1 << 16)
        self.screening.separate_admin = True

    async def _admin_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._client(reader, writer, admin=True)

    async def drain(self, timeout: float) -> int:
        """Stop accepting; close idle connections; let the requests already received (in Apache,
        queued, or pipelined) finish, each connection closing after its last answer; after
        ``timeout`` seconds close what is left. Returns the connections still busy then."""
        self._draining = True
        if self.server is not None:
            self.server.close()
        for c in self._conns:
            cur = self._current.get(c)
            if cur is not None and not c.ready and c not in self._admin_conns:
                cur.keep_alive = False  # its answer says Connection: close
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            public = [c for c in self._conns if c not in self._admin_conns]
            for c in public:
                # idle: nothing in progress, nothing parsed or half-received, quiet for a moment
                # (a client that connected just before the signal gets its request read)
                if c not in self._current and not c.ready and c.cur is None and now - c.last_active > _DRAIN_QUIET:
                    c.writer.close()
            if not public or now >= deadline:
                return len(public)
            await asyncio.sleep(0.02)

    async def _sweep(self) -> None:
        """Close client connections idle (no request in progress) longer than client_timeout, and
        those whose request head takes longer than header_timeout or whose body falls behind
        its deadline (408, :meth:`ClientConnection.body_late`): one timer for all connections
        instead of one per request."""
        lim = self.limits
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            cutoff = now - lim.client_timeout
            for c in list(self._conns):
                if c.head_started is not None and now - c.head_started > lim.header_timeout:
                    self._cut(c, "header_timeout", f"request head not complete within {lim.header_timeout:g} s")
                elif c.body_late(now):
                    self._cut(c, "body_timeout", f"request body too slow: due within {lim.body_timeout:g} s "
                              f"plus 1 s per {lim.body_min_rate} bytes received")
                elif not c.busy and not c.ready and c.last_active < cutoff:
                    c.writer.close()

    def _cut(self, c: ClientConnection, reason: str, message: str) -> None:
        """A request being read missed its deadline (slowloris, a stalled body): 408, then close
        (no 408 while an answer is being written: it would land inside it)."""
        self.metrics.errors.labels(reason).inc()
        if not c.busy:
            c.writer.write(simple_response(408, message, close=True))
        c.writer.close()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for srv in (self.server, self.admin_server):
            if srv is not None:
                srv.close()
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

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, admin: bool = False) -> None:
        conn = ClientConnection(self.limits, reader, writer, self.body_budget)
        if admin:
            self._admin_conns.add(conn)
        if self.admin is None or (self.admin_server is not None and not admin):
            conn.admin_body_max, conn.admin_refusal = 0, "control endpoints are not served on this listener"
        elif self.admin_body_cap is not None:
            conn.admin_body_max, conn.admin_refusal = self.admin_body_cap(conn.peer)
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
                        retry = b"Retry-After: %d\r\n" % self.limits.retry_after if status == 503 else b""
                        await self._send(writer, simple_response(status, msg, close=True, extra=retry))
                    break
                conn.busy = True
                if self._draining and not conn.ready and not admin:
                    req.keep_alive = False  # the last answer before the drain closes it
                self._current[conn] = req
                rec = RequestRecord(time.time(), time.monotonic(), conn.peer, req.method.decode("latin-1"),
                                    req.url.decode("latin-1"), req.version)
                keep = await self._handle(conn, req, rec)
                del self._current[conn]
                if self.on_request is not None:
                    self._log_request(req, rec)
                conn.busy = False
                conn.answered()
                conn.last_active = time.monotonic()
                if not keep or (self._draining and not conn.ready and not admin):
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
            conn.release_all()
            self._conns.discard(conn)
            self._admin_conns.discard(conn)
            self._current.pop(conn, None)
            hold = self.holds.drop(conn)
            if hold is not None:
                self.limiter.abandon(hold)
            writer.close()

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        await self.forwarder.send(writer, data)

    def _log_request(self, req: Request, rec: RequestRecord) -> None:
        for k, v in req.headers:
            lk = k.lower()
            if lk == b"host":
                rec.host = v.decode("latin-1")
            elif lk == b"user-agent":
                rec.user_agent = v.decode("latin-1")
            elif lk == b"referer":
                rec.referer = v.decode("latin-1")
        assert self.on_request is not None
        self.on_request(rec)

    async def _handle(self, conn: ClientConnection, req: Request, rec: RequestRecord) -> bool:
        """Answer one request through :attr:`steps`; False when the client connection must close."""
        ex = Exchange(conn, req, rec, from_admin=conn in self._admin_conns, path=req.path)
        for step in self.steps:
            answer = await step(ex)
            if answer is not None:
                if answer.data:
                    await self._send(conn.writer, answer.data)
                return answer.keep
        raise AssertionError("the last step answers every request")

