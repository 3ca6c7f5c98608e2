"""The gateway's last step: to Apache and back (:class:`~overtake.controller.sidecar.forward.Forwarder`).
The permit is released the moment Apache's whole answer is in; the client's next-stage request
is then reserved (:class:`~overtake.controller.sidecar.reservations.Reservations`) and the
request's demand observed by the classifier.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from overtake.controller.sidecar.classifier import BadPhaseHeader, Classifier
from overtake.controller.sidecar.exchange import Answer, Exchange, TicketSteps, Wiring
from overtake.controller.sidecar.http1 import ClientConnection
from overtake.controller.sidecar.limiter import PASSTHROUGH, Ticket
from overtake.controller.sidecar.request import Request, content_length
from overtake.controller.sidecar.request_log import RequestRecord
from overtake.controller.sidecar.stages import StageTable
from overtake.controller.sidecar.upstream import UpstreamResponse, Withdrawn

__all__ = ["CpuClass", "Dispatch"]

#: a queued request that timed out or whose client went away: answers it (:meth:`Admission.withdrawn`)
Withdraw = Callable[[ClientConnection, Request, RequestRecord, Ticket], Awaitable[bool]]
#: (stage, label, learned key, method) -> the ``X-Overtake-Class`` level to send, or None
CpuClass = Callable[[int, int, str, str], int | None]


class Dispatch(TicketSteps):
    """The step :meth:`forward` and the completion of a forwarded request."""

    def __init__(self, table: StageTable, wiring: Wiring, classifier: Classifier, *, next_header: bytes,
                 withdrawn: Withdraw, cpu_class: CpuClass | None) -> None:
        super().__init__(table, wiring)
        self.classifier = classifier
        self.next_header = next_header
        self._withdrawn = withdrawn
        #: (stage, label, learned key, method) -> mod_overtake_prio starting level to send, or None
        #: (--cpu-priority class)
        self.cpu_class = cpu_class

    async def forward(self, ex: Exchange) -> Answer:
        """To Apache and back; the permit is released when Apache's whole answer is in."""
        t, conn, rec = ex.ticket, ex.conn, ex.rec
        assert t is not None
        h_dur = self.hists.get(ex.stage, t.start_phase, self.table.names)[0]

        async def complete(resp: UpstreamResponse) -> None:
            rec.status = resp.status
            rec.bytes = content_length(resp.headers) if resp.streamed else resp.body_bytes
            rec.upstream = self.limiter.clock() - t.t_admit
            await self._complete(conn, ex.req, t, resp, h_dur)

        level = (self.cpu_class(ex.stage, t.start_phase, t.route, ex.req.method.decode("latin-1"))
                 if self.cpu_class is not None and ex.stage != PASSTHROUGH else None)
        try:
            keep = await self.forwarder.forward(conn, ex.req, t, complete, level,
                                                gate=None if ex.gate is None else ex.gate[1], admitted=ex.admitted)
        except Withdrawn:
            return Answer(await self._withdrawn(conn, ex.req, rec, t))
        finally:
            if ex.gate is not None:
                t.gate = None
                assert self.gate is not None
                self.gate.free(ex.gate[0])
        if rec.status == 0 and not conn.closed.done():
            rec.status = 502  # the forwarder answered Apache's failure
        return Answer(keep)

    def _follow(self, conn: ClientConnection, req: Request, t: Ticket) -> tuple[int, int] | None:
        """(stage, phase) of the request this client sends next, when its stage has a ``next``."""
        if t.stage == PASSTHROUGH or not req.keep_alive or conn.closed.done():
            return None
        nxt = self.table.next_stage[t.stage]
        if nxt is None:
            return None
        value = next((v for k, v in req.headers if k.lower() == self.next_header), None)
        # a linked stage learns per previous request: its follow-up's phase is predicted from it
        try:
            return nxt, self.classifier.start_phase(nxt, self.table.follow_up_key(nxt, t.route), value, None,
                                                    observe=False)
        except BadPhaseHeader:
            self.metrics.errors.labels("bad_phase").inc()
            return nxt, self.classifier.prior_phase[nxt]

    async def _complete(self, conn: ClientConnection, req: Request, t: Ticket, resp: UpstreamResponse,
                        h_dur: Any) -> None:
        """Apache has sent everything: release the permit (reserving the client's next stage),
        let the requests it admitted go first, and record the duration and the demand."""
        done = self.limiter.clock()
        admitted = self.limiter.admitted_total
        hold = self.limiter.release(t, "completed", self._follow(conn, req, t))
        if hold is not None:
            hold.route = t.route  # the link a linked stage's follow-up is learned under (_route)
            self.holds.keep(conn, hold, self.limits.follow_up_timeout)
        if self.limiter.admitted_total != admitted:
            # the policy released waiting requests: let them reach Apache before we spend time on
            # this client (an idle gap on Apache's core costs every request behind it)
            await asyncio.sleep(0)
        h_dur.observe(done - t.t_arrive)
        if t.stage != PASSTHROUGH and self.classifier.collects:
            self.classifier.observe(t.stage, t.route, _demand(resp, done - t.t_admit))


def _demand(resp: UpstreamResponse, sojourn: float) -> float:
    for k, v in resp.headers:
        if k.lower() == b"x-stage-cpu-us":
            try:
                return int(v) / 1e6
            except ValueError:
                break
    return sojourn
