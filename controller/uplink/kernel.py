"""SRPT and SRRT on the kernel's priority bands (Harchol-Balter et al., "Size-based scheduling to
improve web performance", §2.2.4; Al Sa'deh and Yahya, "A new scheduling policy in web servers", §3).

``srpt``  ``SO_PRIORITY`` of the client socket = the band of its remaining bytes,
          ``remaining = total + backlog_at_open - (bytes_acked - bytes_acked_at_open)`` from
          ``TCP_INFO``; updated before every write and every ``interval`` seconds after the last
          one until everything is acknowledged. The kernel stamps each packet's priority from the
          socket's when TCP hands the segment to IP, so a new priority applies to all data not yet
          transmitted, including what already sits in the send buffer (packets already queued in
          the qdisc keep their class), which is what SRPT needs. ``TCP_NOTSENT_LOWAT`` keeps
          little unsent data in the kernel, so the socket's priority is still being updated while
          the tail of a large response drains.
``srrt``  Al Sa'deh and Yahya §3: the band of the remaining *time* ``RTT · (1 + remaining/(cwnd·MSS))``.

Ordering inside bands: with ``lowest_writers=k`` the responses in the lowest band are ordered as
well: at most ``k`` of them hand data to the kernel at once, the least remaining first (paper
000 §3.3's write ordering applied to that band alone, through :class:`Permits`). The lowest band
is one FIFO, where TCP shares the leftover capacity among all its flows, so a large response
that arrived later slows one nearly done; HTB's eight levels are used up. ``ordered_bands=n``
orders each of the lowest ``n`` bands the same way (its own ``k`` turns): under overload those
are the bands that starve, and a starved flow that has handed nothing to the kernel keeps no
packet waiting in the qdisc past its RTO. A holder that makes no progress for ``_GATE_STALL_S``
(client gone, RTO backoff) passes its turn on so the band never idles behind it.

The control band (top class) is never given to a response: it carries SYN-ACKs and the first
bytes before the size is known (Harchol-Balter et al. §2.2.3). Bands come from
:mod:`overtake.controller.uplink.qdisc` (HTB: 7 data bands; TBF + pfifo_fast: 2), cutoffs from
:mod:`overtake.controller.uplink.bands`.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field

from overtake.controller.uplink import bands as _bands
from overtake.controller.uplink import qdisc as _qdisc
from overtake.controller.uplink import tcpinfo as _ti
from overtake.controller.uplink.errors import UplinkInputError
from overtake.controller.uplink.flow import LARGE_RESPONSE, TCP_NOTSENT_LOWAT, UplinkFlow, writer_socket
from overtake.controller.uplink.permits import Permits

__all__ = ["BandStats", "KernelUplink", "check_lowest_writers"]

_TCP_ESTABLISHED = 1
# a lowest-band write turn passes on after this long without an acknowledged byte: a gone
# client or an RTO backoff (0.2 s, 0.4 s, ...) must not idle the band for everyone behind it
_GATE_STALL_S = 1.0


@dataclass
class BandStats:
    """Per-band counters for ``/metrics`` (band -1 = control/unbanded)."""

    bytes_written: dict[int, int] = field(default_factory=dict)
    flows_opened: dict[int, int] = field(default_factory=dict)
    priority_changes: int = 0
    active: dict[int, int] = field(default_factory=dict)
    #: per ordered band: times a response there waited for a write turn (lowest_writers)
    turn_waits: dict[int, int] = field(default_factory=dict)


class _KernelFlow:
    """One response whose socket priority follows its remaining bytes or time."""

    __slots__ = (
        "_up", "_writer", "_sock", "_total", "_written", "_acked0", "_backlog0", "_band",
        "_closed", "_done", "_fd", "_metric_now", "_gated", "_acked_seen", "_stall_since", "_gband",
    )  # fmt: skip

    def __init__(self, up: KernelUplink, writer: asyncio.StreamWriter, total: int | None) -> None:
        self._up = up
        self._writer = writer
        self._sock = writer_socket(writer)
        self._total = total
        self._written = 0
        self._band = -1
        self._closed = False
        self._done = False
        self._acked0 = 0
        self._backlog0 = 0
        self._fd = -1
        self._metric_now = LARGE_RESPONSE
        self._gated = False  # holds a write turn of the ordered band _gband
        self._gband = -1
        self._acked_seen = 0
        self._stall_since = 0.0
        try:
            self._fd = self._sock.fileno()
            # a keep-alive socket's previous response may still be draining: this flow owns
            # the socket's priority from now on (its backlog counts those bytes)
            prev = up._by_sock.get(self._fd)
            if prev is not None:
                prev._finish()
            up._by_sock[self._fd] = self
            info = _ti.read_tcp_info(self._sock)
            self._acked0 = info.bytes_acked or 0
            # bytes of earlier responses on this keep-alive socket still ahead of ours
            self._backlog0 = _ti.outq_bytes(self._sock) + writer.transport.get_write_buffer_size()
            if up.lowat:
                self._sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, up.lowat)
            first = self._metric(float(total) if total is not None else LARGE_RESPONSE, info)
        except (OSError, AttributeError, ValueError):
            self._done = True
            if up._by_sock.get(self._fd) is self:
                del up._by_sock[self._fd]
            return
        up._observe(first, total)
        self._set_band(first)
        up._stats.flows_opened[self._band] = up._stats.flows_opened.get(self._band, 0) + 1

    def _metric(self, remaining: float, info: _ti.TcpInfo) -> float:
        if self._up.by_time:
            return _ti.remaining_time(remaining, info)
        return remaining

    def remaining(self, info: _ti.TcpInfo) -> float:
        """Bytes of this response not yet acknowledged (plus earlier ones still queued)."""
        total = float(self._total) if self._total is not None else (
            float(self._written) if self._closed else LARGE_RESPONSE
        )
        acked = (info.bytes_acked or 0) - self._acked0
        return max(total + self._backlog0 - acked, 0.0)

    def _set_band(self, metric: float) -> None:
        band = min(self._up.cutoffs.band(metric), len(self._up.bandmap.data) - 1)
        if band == self._band:
            return
        try:
            _ti.set_priority(self._sock, self._up.bandmap.data[band])
        except OSError:
            self._done = True
            return
        st = self._up._stats
        if self._band >= 0:
            st.priority_changes += 1
            st.active[self._band] = st.active.get(self._band, 1) - 1
        st.active[band] = st.active.get(band, 0) + 1
        self._band = band
        if self._gated and band != self._gband:
            self._ungate()  # climbed out of its ordered band: the next one there may write

    def update(self) -> bool:
        """Re-read TCP_INFO and re-band; False once the flow needs no more updates."""
        if self._done:
            return False
        try:
            info = _ti.read_tcp_info(self._sock)
        except (OSError, ValueError):
            self._finish()
            return False
        rem = self.remaining(info)
        if self._closed and (rem <= 0 or info.state != _TCP_ESTABLISHED):
            self._finish()
            return False
        self._metric_now = self._metric(rem, info)
        self._set_band(self._metric_now)
        if self._gated:
            self._check_stall(info.bytes_acked or 0)
        return True

    def _check_stall(self, acked: int) -> None:
        now = asyncio.get_running_loop().time()
        if acked != self._acked_seen or not self._stall_since:
            self._acked_seen, self._stall_since = acked, now
        elif now - self._stall_since >= _GATE_STALL_S:
            self._ungate()  # re-queues by its remaining bytes at its next write

    def _ungate(self) -> None:
        if self._gated:
            self._gated = False
            self._stall_since = 0.0
            self._up._gates[self._gband].release()

    async def _turn(self) -> None:
        """In an ordered band, wait for a write turn (least remaining first)."""
        gate = self._up._gates.get(self._band)
        if gate is None or self._done:
            return
        if self._gated and not gate.keep(self._metric_now):
            self._gated = False  # keep() handed the turn to a smaller waiter
        if not self._gated:
            if gate.busy():
                waits = self._up._stats.turn_waits
                waits[self._band] = waits.get(self._band, 0) + 1
            band = self._band  # the turn belongs to the band it was asked in
            await gate.acquire(self._metric_now)
            self._gated, self._gband = True, band
            self._stall_since = 0.0

    def _finish(self) -> None:
        self._ungate()
        if not self._done:
            self._done = True
            st = self._up._stats
            if self._band >= 0:
                st.active[self._band] = st.active.get(self._band, 1) - 1
            self._up._flows.pop(id(self), None)
            if self._up._by_sock.get(self._fd) is self:
                del self._up._by_sock[self._fd]

    async def write(self, data: bytes) -> None:
        if not self._done:
            self.update()
            await self._turn()
            st = self._up._stats
            st.bytes_written[self._band] = st.bytes_written.get(self._band, 0) + len(data)
        self._writer.write(data)
        self._written += len(data)
        await self._writer.drain()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ungate()  # everything is handed to the kernel: its tail drains, the next may write
        if self._total is None:
            self._total = self._written
        if self.update():
            self._up._track(self)


class KernelUplink:
    """SRPT (``by_time=False``) or SRRT (``by_time=True``) on kernel priority bands."""

    def __init__(
        self,
        *,
        bandmap: _qdisc.BandMap,
        cutoffs: _bands.Cutoffs,
        by_time: bool,
        adapt: bool = True,
        interval: float = 0.01,
        lowat: int = 32768,
        note: str = "",
        top_fraction: float = _bands.TOP_FRACTION,
        lowest_writers: int = 0,
        ordered_bands: int = 1,
    ) -> None:
        if cutoffs.n_bands > len(bandmap.data):
            raise UplinkInputError(
                f"cutoffs: {len(cutoffs.edges)} cutoffs make {cutoffs.n_bands} bands but "
                f"{bandmap.kind} has {len(bandmap.data)} data bands; give at most "
                f"{len(bandmap.data) - 1} cutoffs"
            )
        if not 0.001 <= interval <= 1.0:
            raise UplinkInputError(f"interval: {interval!r} s must be in [0.001, 1]")
        if not 0 <= lowat <= 1 << 24:
            raise UplinkInputError(f"notsent_lowat: {lowat} bytes must be in 0..16M (0 = off)")
        check_lowest_writers(lowest_writers, ordered_bands)
        # adaptive cutoffs never change the number of bands
        n_bands = min(cutoffs.n_bands, len(bandmap.data))
        if ordered_bands > n_bands:
            raise UplinkInputError(
                f"ordered_bands: {ordered_bands} exceeds the {n_bands} data bands in use "
                f"({bandmap.kind}); give 1..{n_bands}"
            )
        self.name = "srrt" if by_time else "srpt"
        self.by_time = by_time
        self.bandmap = bandmap
        self.lowat = lowat
        self.interval = interval
        self.note = note
        _bands.check_rule(0.5, top_fraction)  # also when fixed cutoffs leave it unused
        self._adaptive = _bands.AdaptiveCutoffs(cutoffs, top_fraction=top_fraction) if adapt else None
        self._fixed = cutoffs
        self._flows: dict[int, _KernelFlow] = {}
        self._by_sock: dict[int, _KernelFlow] = {}
        self._stats = BandStats()
        self._task: asyncio.Task[None] | None = None
        self.lowest_writers = lowest_writers
        self.ordered_bands = ordered_bands if lowest_writers else 0
        #: the bands whose responses take write turns (the lowest ordered_bands ones)
        self.ordered = range(n_bands - self.ordered_bands, n_bands)
        self._gates = {b: Permits(lowest_writers) for b in self.ordered}

    @property
    def cutoffs(self) -> _bands.Cutoffs:
        """Cutoffs in force (bytes for SRPT, seconds for SRRT)."""
        return self._adaptive.current if self._adaptive is not None else self._fixed

    def _observe(self, first_metric: float, total: int | None) -> None:
        if self._adaptive is not None and total is not None:
            self._adaptive.observe(first_metric)

    def open(self, writer: asyncio.StreamWriter, total_bytes: int | None) -> UplinkFlow:
        if total_bytes is not None and total_bytes < 0:
            raise UplinkInputError(f"total_bytes: {total_bytes} must be >= 0 or None")
        flow = _KernelFlow(self, writer, total_bytes)
        if not flow._done:
            self._track(flow)
        return flow

    def _track(self, flow: _KernelFlow) -> None:
        self._flows[id(flow)] = flow
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        # one task for all flows: re-band each live flow every `interval` seconds
        while self._flows:
            await asyncio.sleep(self.interval)
            for flow in list(self._flows.values()):
                if not flow.update():
                    self._flows.pop(id(flow), None)

    def prepare_listener(self, sock: socket.socket) -> None:
        """Put SYN-ACKs (sent with the listener's priority) and accepted sockets in the control band."""
        _ti.set_priority(sock, self.bandmap.control)

    def stats(self) -> BandStats:
        """Per-band counters (bytes written, flows opened, active flows, priority changes)."""
        return self._stats

    def describe(self) -> str:
        """One line: scheduler, bands in use, cutoffs."""
        unit = "s" if self.by_time else "bytes"
        adapt = "adaptive" if self._adaptive is not None else "fixed"
        extra = f"; {self.note}" if self.note else ""
        if self.lowest_writers:
            k, n = self.lowest_writers, self.ordered_bands
            which = "lowest band" if n == 1 else f"lowest {n} bands"
            extra = (f"; {which} ordered: {k} writer{'s' if k > 1 else ''} at a time"
                     f"{' in each' if n > 1 else ''}, least remaining first" + extra)  # fmt: skip
        return (
            f"{self.name}: {self.bandmap.describe()}; {adapt} cutoffs ({unit}) "
            f"{self.cutoffs}{extra}"
        )


def check_lowest_writers(k: int, ordered_bands: int = 1) -> None:
    """Validate ``lowest_writers`` (``k``) and ``ordered_bands``; the error names the field."""
    if not 0 <= k <= 10_000:
        raise UplinkInputError(
            f"lowest_writers: {k} must be in 0..10000 (0 = the lowest band is one FIFO; 1 = "
            "strict SRPT inside it)"
        )
    if not 1 <= ordered_bands <= 8:
        raise UplinkInputError(
            f"ordered_bands: {ordered_bands} must be in 1..8 (how many of the lowest data bands "
            "lowest_writers orders; 1 = the lowest only)"
        )
    if ordered_bands > 1 and not k:
        raise UplinkInputError(
            f"ordered_bands: {ordered_bands} needs lowest_writers >= 1 (the writers each ordered "
            "band lets through at once)"
        )
