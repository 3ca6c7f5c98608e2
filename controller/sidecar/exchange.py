"""What the gateway's steps pass along: the :class:`Exchange` (one request and what the steps
learned about it), a step's :class:`Answer`; and what the steps that hold a ticket share
(:class:`TicketSteps`: the limiter, the forwarder, the reservations, the gate and the
per-(stage, phase) histograms).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from overtake.controller.sidecar.forward import Forwarder
from overtake.controller.sidecar.gate import Gate
from overtake.controller.sidecar.heads import simple_response
from overtake.controller.sidecar.http1 import ClientConnection
from overtake.controller.sidecar.limiter import PASSTHROUGH, Limiter, Ticket
from overtake.controller.sidecar.metrics import SidecarMetrics
from overtake.controller.sidecar.request import Request
from overtake.controller.sidecar.request_log import RequestRecord
from overtake.controller.sidecar.reservations import Reservations
from overtake.controller.sidecar.stages import StageTable

__all__ = ["Answer", "Exchange", "StageHistograms", "Step", "TicketSteps", "Wiring"]


@dataclass(frozen=True)
class Answer:
    """A step's answer: whether the connection stays open, and the bytes to write first (none
    when the step wrote its answer itself)."""

    keep: bool
    data: bytes = b""


@dataclass
class Exchange:
    """One request on its way through the steps, and what they learned about it."""

    conn: ClientConnection
    req: Request
    rec: RequestRecord
    from_admin: bool  #: received on the admin listener
    path: str  #: normalised (RFC 3986 §6.2.2, dot segments, merged slashes): what Apache routes on
    stage: int = PASSTHROUGH
    phase: int = 0
    route_key: str = ""
    ticket: Ticket | None = None
    gate: tuple[int, bytes] | None = None  #: the gate slot and header value, when it waits in Apache
    admitted: Callable[[], Awaitable[bool]] | None = None  #: with a gate slot: waits for the admission

    def refuse(self, status: int, message: str) -> Answer:
        """A plain-text error answer; the connection stays open when the client asked so."""
        self.rec.status = status
        return Answer(self.req.keep_alive, simple_response(status, message, close=not self.req.keep_alive))

#: a step of the request path: answers the request, or returns None to pass it on
Step = Callable[[Exchange], Awaitable[Answer | None]]


class StageHistograms:
    """The request-duration and queue-wait histograms of each (stage, phase), labelled once."""

    def __init__(self, metrics: SidecarMetrics) -> None:
        self.metrics = metrics
        self._hist: dict[tuple[int, int], tuple[Any, Any]] = {}

    def get(self, stage: int, phase: int, names: Sequence[str]) -> tuple[Any, Any]:
        """(duration, queue wait) of ``stage`` (named from ``names``) and ``phase``."""
        h = self._hist.get((stage, phase))
        if h is None:
            labels = ("passthrough", "all") if stage == PASSTHROUGH else (names[stage], str(phase + 1))
            h = (self.metrics.duration.labels(*labels), self.metrics.queue_wait.labels(*labels))
            self._hist[(stage, phase)] = h
        return h


@dataclass(frozen=True)
class Wiring:
    """What the steps that hold a ticket share, built once by the gateway."""

    limiter: Limiter
    metrics: SidecarMetrics
    forwarder: Forwarder
    holds: Reservations
    hists: StageHistograms
    #: Apache's admission gate (controller.sidecar.gate), or None
    gate: Gate | None


class TicketSteps:
    """Base of the steps that hold a ticket: the stage table and its limits (replaced together
    by :meth:`retable` on a reload) and the shared :class:`Wiring`."""

    def __init__(self, table: StageTable, wiring: Wiring) -> None:
        self.retable(table)
        self.limiter, self.metrics, self.forwarder = wiring.limiter, wiring.metrics, wiring.forwarder
        self.holds, self.hists, self.gate = wiring.holds, wiring.hists, wiring.gate

    def retable(self, table: StageTable) -> None:
        self.table = table
        self.limits = table.config.limits
