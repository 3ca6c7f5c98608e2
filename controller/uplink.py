"""Uplink scheduling seam between the gateway and the kernel (papers 000-003).

The gateway (enforcement) writes every response body to its client through an
:class:`UplinkFlow`; the uplink (algorithm) decides *how* those bytes leave: FAIR (plain
writes, the kernel's default sharing), SRPT / SRRT (kernel priority bands chosen per socket from
the remaining bytes or remaining time, paper 001 §3, paper 002 §3), or an application-level
ordering when no qdisc can be installed (paper 000).

Contract used by the gateway::

    flow = uplink.open(writer, total_bytes)   # before the first byte of the response
    await flow.write(chunk)                   # header block and body chunks, in order
    flow.close()                              # exactly once, also on error/disconnect

``total_bytes`` is the size of the whole response (status line + headers + body) when known,
``None`` when streaming without Content-Length; an uplink then treats the flow as large.
``write`` must apply back-pressure (it awaits the writer's drain).

Schedulers (``make_uplink(name)``):

``fair``  nothing set: every socket drains into one FIFO (what Apache alone does).
``srpt``  paper 001 §2.2.4: ``SO_PRIORITY`` of the client socket = the band of its remaining
          bytes, ``remaining = total + backlog_at_open - (bytes_acked - bytes_acked_at_open)``
          from ``TCP_INFO``; updated before every write and every ``interval`` seconds after the
          last one until everything is acknowledged. A new priority applies to all data not
          yet handed to IP (shared/notes/apache_and_net.md §4.6), which is what SRPT needs.
          ``TCP_NOTSENT_LOWAT`` keeps little unsent data in the kernel, so the socket's
          priority is still being updated while the tail of a large response drains.
``srrt``  paper 002 §3: the band of the remaining *time* ``RTT · (1 + remaining/(cwnd·MSS))``.
``app``   paper 000 §3.3: no kernel bands; at most ``concurrency`` flows hand data to the
          kernel at once, the one with the least remaining bytes first, ``quantum`` bytes at a
          time. A holder keeps its permit until its quantum has left the send queue
          (``TCP_INFO`` notsent) and, between quanta, for as long as no smaller flow waits, so
          the backlog stays in the server where the ordering is decided; ``TCP_NOTSENT_LOWAT``
          (1 byte) keeps the kernel from holding unsent data of flows that wait. This costs
          throughput when ``concurrency`` is small (paper 000 §5.4; bench/uplink_srpt.py).

Ordering inside bands (srpt, srrt): with ``lowest_writers=k`` the responses in the lowest band
are ordered as well: at most ``k`` of them hand data to the kernel at once, the least remaining
first (paper 000 §3.3's write ordering applied to that band alone). The lowest band is one FIFO,
where TCP shares the leftover capacity among all its flows, so a large response that arrived
later slows one nearly done; HTB's eight levels are used up. ``ordered_bands=n`` orders each of
the lowest ``n`` bands the same way (its own ``k`` turns): under overload those are the bands
that starve, and a starved flow that has handed nothing to the kernel keeps no packet waiting in
the qdisc past its RTO. A holder that makes no progress for ``_GATE_STALL_S`` (client gone, RTO
backoff) passes its turn on so the band never idles behind it.

The control band (top class) is never given to a response: it carries SYN-ACKs and the first
bytes before the size is known (paper 001 §2.2.3). Bands come from :mod:`overtake.controller.qdisc`
(HTB: 7 data bands; TBF + pfifo_fast: 2), cutoffs from :mod:`overtake.controller.bands`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import logging
import socket
import subprocess
from dataclasses import dataclass, field
from typing import Any, Protocol

from overtake.controller import bands as _bands
from overtake.controller import qdisc as _qdisc
from overtake.controller import tcpinfo as _ti
from overtake.controller.uplink_errors import UplinkInputError

__all__ = [
    "AppUplink",
    "BandStats",
    "FairUplink",
    "KernelUplink",
    "NAMES",
    "Uplink",
    "UplinkFlow",
    "default_cutoffs",
    "detect_bands",
    "make_uplink",
]

log = logging.getLogger(__name__)

NAMES = ("app", "fair", "srpt", "srrt")
_LARGE = float(2**40)  # remaining bytes assumed for a response of unknown length
_TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)
_TCP_ESTABLISHED = 1
_SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
# a lowest-band write turn passes on after this long without an acknowledged byte: a gone
# client or an RTO backoff (0.2 s, 0.4 s, ...) must not idle the band for everyone behind it
_GATE_STALL_S = 1.0


class UplinkFlow(Protocol):
    """One response on its way to one client."""

    async def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class Uplink(Protocol):
    """A policy for the server's uplink: hands out one flow per response."""

    name: str

    def open(self, writer: asyncio.StreamWriter, total_bytes: int | None) -> UplinkFlow: ...


@dataclass
class BandStats:
    """Per-band counters for ``/metrics`` (band -1 = control/unbanded)."""

    bytes_written: dict[int, int] = field(default_factory=dict)
    flows_opened: dict[int, int] = field(default_factory=dict)
    priority_changes: int = 0
    active: dict[int, int] = field(default_factory=dict)
    #: per ordered band: times a response there waited for a write turn (lowest_writers)
    turn_waits: dict[int, int] = field(default_factory=dict)


class _FairFlow:
    __slots__ = ("_writer",)

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    async def write(self, data: bytes) -> None:
        self._writer.write(data)
        await self._writer.drain()

    def close(self) -> None:
        pass


class FairUplink:
    """Kernel default: every socket in one band (what Apache alone does)."""

    name = "fair"

    def open(self, writer: asyncio.StreamWriter, total_bytes: int | None) -> UplinkFlow:
        return _FairFlow(writer)

    def describe(self) -> str:
        """One line: what this uplink does."""
        return "fair: no priorities (one FIFO per qdisc band, kernel default)"


def _sock(writer: asyncio.StreamWriter) -> Any:
    return writer.get_extra_info("socket")


class _KernelFlow:
    """One response whose socket priority follows its remaining bytes or time."""

    __slots__ = (
        "_up", "_writer", "_sock", "_total", "_written", "_acked0", "_backlog0", "_band",
        "_closed", "_done", "_fd", "_metric_now", "_gated", "_acked_seen", "_stall_since", "_gband",
    )  # fmt: skip

    def __init__(self, up: KernelUplink, writer: asyncio.StreamWriter, total: int | None) -> None:
        self._up = up
        self._writer = writer
        self._sock = _sock(writer)
        self._total = total
        self._written = 0
        self._band = -1
        self._closed = False
        self._done = False
        self._acked0 = 0
        self._backlog0 = 0
        self._fd = -1
        self._metric_now = _LARGE
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
                self._sock.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, up.lowat)
            first = self._metric(float(total) if total is not None else _LARGE, info)
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
            float(self._written) if self._closed else _LARGE
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
        _check_lowest_writers(lowest_writers, ordered_bands)
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
        self._gates = {b: _Permits(lowest_writers) for b in self.ordered}

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


class _Permits:
    """At most ``n`` holders; waiters served smallest key first (paper 000's SRPT queue)."""

    def __init__(self, n: int) -> None:
        self._free = n
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    async def acquire(self, key: float) -> None:
        if self._free > 0 and not self._heap:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (key, next(self._seq), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted just before the cancel: hand it on
            raise

    def busy(self) -> bool:
        """An :meth:`acquire` now would wait."""
        return self._free <= 0 or bool(self._heap)

    def keep(self, key: float) -> bool:
        """The holder, now with ``key`` left, may go on unless a smaller key waits; in that
        case the permit passes to that waiter and False is returned."""
        while self._heap and self._heap[0][2].done():
            heapq.heappop(self._heap)  # waiters cancelled while queued
        if self._heap and self._heap[0][0] < key:
            self.release()
            return False
        return True

    def release(self) -> None:
        while self._heap:
            _, _, fut = heapq.heappop(self._heap)
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1


# a flow gives its permit back when at most this much of its quantum is still unsent: the
# next holder's first segments are queued before the link idles (about two MSS)
_APP_RELEASE_BYTES = 2896
# a flow keeps its permit this long after a write() while more of its response is expected
_APP_LINGER_S = 0.002


class _AppFlow:
    __slots__ = ("_up", "_writer", "_total", "_written", "_held", "_linger")

    def __init__(self, up: AppUplink, writer: asyncio.StreamWriter, total: int | None) -> None:
        self._up = up
        self._writer = writer
        self._total = total
        self._written = 0
        self._held = False  # this flow holds a write permit
        self._linger: asyncio.TimerHandle | None = None
        try:
            # a flow without a permit keeps at most ~one segment unsent in the kernel, so only
            # permit holders compete in the qdisc (otherwise the kernel shares among all flows)
            _sock(writer).setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, up.lowat)
            # drain() returns only once the transport buffer is empty, i.e. the kernel took it
            writer.transport.set_write_buffer_limits(high=0)
            if up.max_pacing_rate:
                # TCP Small Queues lets a socket hold ~1 ms of its *pacing* rate in the qdisc;
                # on a LAN BBR paces far above the link, so one bulk flow fills the FIFO (and
                # every small response waits behind it) unless the pacing rate is capped
                _sock(writer).setsockopt(socket.SOL_SOCKET, _SO_MAX_PACING_RATE, up.max_pacing_rate)
        except (OSError, AttributeError):
            pass

    async def write(self, data: bytes) -> None:
        q = self._up.quantum
        permits = self._up._permits
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        view = memoryview(data)
        try:
            for off in range(0, len(data), q):
                piece = view[off : off + q]
                rem = float((self._total - self._written) if self._total is not None else _LARGE)
                # between quanta the holder keeps the link while it has the least remaining;
                # releasing and re-queueing would alternate it with a larger flow (= FAIR)
                if self._held and not permits.keep(rem):
                    self._held = False
                if not self._held:
                    await permits.acquire(rem)
                    self._held = True
                self._writer.write(piece)
                self._written += len(piece)
                await self._writer.drain()
                await self._until_sent()
        except BaseException:
            self._drop()
            raise
        self._up.bytes_written += len(data)
        if self._total is not None and self._written >= self._total:
            self._drop()
        elif self._held:
            # more of this response is coming (the next chunk is being read): keep the permit a
            # moment so that chunk does not queue behind a larger flow
            self._linger = asyncio.get_running_loop().call_later(_APP_LINGER_S, self._drop)

    def _drop(self) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if self._held:
            self._held = False
            self._up._permits.release()

    async def _until_sent(self) -> None:
        """Hold the permit until the quantum has left the socket's send queue.

        drain() returns once the kernel *accepted* the bytes (the send buffer is large), and
        TCP_NOTSENT_LOWAT only gates poll(), not send(): releasing there lets every flow park
        its data unsent in the kernel, where the qdisc shares it FAIRly and the ordering is
        lost (measured: app:1 = FAIR). Paper 000 §3.3 needs the backlog held by the server.
        """
        try:
            sock = _sock(self._writer)
        except AttributeError:
            return
        rate = self._up.max_pacing_rate or 0
        while not self._writer.transport.is_closing():
            try:
                left = _ti.read_tcp_info(sock).notsent_bytes
            except OSError:
                return
            if left is None or left <= _APP_RELEASE_BYTES:
                return
            # sleep about as long as the excess takes at the link rate, polling at least every 5 ms
            await asyncio.sleep(min((left - _APP_RELEASE_BYTES) / rate, 0.005) if rate else 0.001)

    def close(self) -> None:
        self._drop()


class AppUplink:
    """Paper 000: order our own writes by remaining bytes, ``concurrency`` writers at a time."""

    name = "app"

    def __init__(
        self,
        *,
        concurrency: int = 4,
        quantum: int = 16384,
        lowat: int = 1,
        max_pacing_rate: int | None = None,
        note: str = "",
    ) -> None:
        if not 1 <= concurrency <= 10_000:
            raise UplinkInputError(f"concurrency: {concurrency} must be in 1..10000, e.g. 4")
        if not 1024 <= quantum <= 1 << 22:
            raise UplinkInputError(f"quantum: {quantum} bytes must be in 1024..4194304")
        if not 1 <= lowat <= quantum:
            raise UplinkInputError(f"notsent_lowat: {lowat} must be in 1..quantum ({quantum})")
        self.concurrency = concurrency
        self.quantum = quantum
        if max_pacing_rate is not None and not 1000 <= max_pacing_rate <= 1 << 40:
            raise UplinkInputError(
                f"max_pacing_rate: {max_pacing_rate} must be bytes/s >= 1000 (the link rate / 8)"
            )
        self.lowat = lowat
        self.max_pacing_rate = max_pacing_rate
        self.note = note
        self.bytes_written = 0
        self._permits = _Permits(concurrency)

    def open(self, writer: asyncio.StreamWriter, total_bytes: int | None) -> UplinkFlow:
        if total_bytes is not None and total_bytes < 0:
            raise UplinkInputError(f"total_bytes: {total_bytes} must be >= 0 or None")
        return _AppFlow(self, writer, total_bytes)

    def describe(self) -> str:
        """One line: concurrency and quantum."""
        extra = f"; {self.note}" if self.note else ""
        return (
            f"app: application-level SRPT, {self.concurrency} concurrent writers, "
            f"{self.quantum}-byte quanta, "
            + (f"pacing <= {self.max_pacing_rate} B/s, " if self.max_pacing_rate else "")
            + f"no kernel bands{extra}"
        )


def _check_lowest_writers(k: int, ordered_bands: int = 1) -> None:
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


def _priority_allowed(priority: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        _ti.set_priority(s, priority)
        return True
    except PermissionError:
        return False
    finally:
        s.close()


def detect_bands(dev: str | None = None, *, netns: str | None = None) -> _qdisc.BandMap | None:
    """Band map of the qdisc in use: ``dev``'s, or the first of ours on any interface.

    HTB (ours) wins, then TBF + pfifo_fast or a plain pfifo_fast root; ``None`` when no
    interface has either (e.g. a bare veth with ``noqueue``).
    """
    if dev is not None:
        state = _qdisc.show(dev, netns=netns)
        if state.bands is not None:
            return state.bands
        return _qdisc.PFIFO_FAST_BANDS if state.root_kind == "pfifo_fast" else None
    cmd = (["tc", "-n", netns] if netns else ["tc"]) + ["-j", "qdisc", "show"]
    try:
        cp = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    try:
        qdiscs = json.loads(cp.stdout or "[]")
    except ValueError:
        return None
    devs = sorted({q.get("dev") for q in qdiscs if q.get("root") and q.get("dev")})
    found: _qdisc.BandMap | None = None
    for d in devs:
        try:
            st = _qdisc.show(d, netns=netns)
        except Exception:  # noqa: BLE001 - a vanished interface must not stop detection
            continue
        if st.bands is _qdisc.HTB_BANDS:
            return st.bands
        if st.bands is not None or st.root_kind == "pfifo_fast":
            found = _qdisc.PFIFO_FAST_BANDS
    return found


def make_uplink(
    name: str,
    *,
    bands: str = "auto",
    dev: str | None = None,
    netns: str | None = None,
    cutoffs: _bands.Cutoffs | str | None = None,
    adapt: bool | None = None,
    interval: float = 0.01,
    notsent_lowat: int = 32768,
    concurrency: int = 4,
    quantum: int = 16384,
    max_pacing_rate: int | None = None,
    top_fraction: float = _bands.TOP_FRACTION,
    lowest_writers: int = 0,
    ordered_bands: int = 1,
) -> Uplink:
    """Build the uplink named on the command line (``--uplink fair|srpt|srrt|app``).

    ``bands``: ``auto`` (inspect ``dev`` or every interface, see :func:`detect_bands`),
    ``htb`` or ``pfifo_fast``. SRPT/SRRT fall back to ``app`` when no band arrangement is
    found or HTB priorities are refused (no CAP_NET_ADMIN/CAP_NET_RAW); ``describe()`` says
    which is in use. ``cutoffs``: fixed cutoffs (bytes for SRPT, seconds for SRRT; a string
    like ``"1K,4K,16K"``); by default they start log-spaced (paper 001's 1K-50K for SRPT) and
    adapt to the observed distribution (``adapt``; off when cutoffs are given) with
    ``top_fraction`` of the responses above the highest cutoff (paper 001: 0.005-0.01; default
    0.005: at load 0.8 its largest 1 % took 0.97-1.06x their FAIR time over seeds 1-3, 0.01's
    1.16-1.33x; 0.001 measured better still on World Cup 98 sizes, BENCHMARKS.md
    ``uplink-sweep-60s``).
    ``concurrency``, ``quantum``, ``max_pacing_rate`` (bytes/s, the link rate) shape ``app``;
    ``lowest_writers`` (srpt, srrt) orders the lowest band's responses, ``ordered_bands`` the
    lowest that many bands' (each its own ``lowest_writers`` turns), see the module docstring.
    """
    _check_lowest_writers(lowest_writers, ordered_bands)  # before a fallback could drop it
    if lowest_writers and name not in ("srpt", "srrt"):
        raise UplinkInputError(
            f"lowest_writers: orders the lowest kernel band, only for srpt or srrt, not {name!r}"
        )
    if name == "fair":
        return FairUplink()
    if name == "app":
        return AppUplink(concurrency=concurrency, quantum=quantum, max_pacing_rate=max_pacing_rate)
    if name not in ("srpt", "srrt"):
        raise UplinkInputError(
            f"uplink: unknown scheduler {name!r}; choose one of: {', '.join(NAMES)}"
        )
    if bands not in ("auto", "htb", "pfifo_fast"):
        raise UplinkInputError(f"bands: {bands!r} must be auto, htb or pfifo_fast")
    note = ""
    bandmap: _qdisc.BandMap | None
    if bands == "htb":
        bandmap = _qdisc.HTB_BANDS
    elif bands == "pfifo_fast":
        bandmap = _qdisc.PFIFO_FAST_BANDS
    else:
        bandmap = detect_bands(dev, netns=netns)
        if bandmap is None:
            note = "no HTB or pfifo_fast qdisc found (install with `overtake uplink install`)"
    if bandmap is not None and not _priority_allowed(bandmap.data[0]):
        note = (
            f"SO_PRIORITY {bandmap.data[0]:#x} refused: needs CAP_NET_ADMIN or CAP_NET_RAW"
        )
        bandmap = None
    if bandmap is None:
        log.warning("uplink %s: %s; falling back to application-level ordering", name, note)
        return AppUplink(
            concurrency=concurrency,
            quantum=quantum,
            max_pacing_rate=max_pacing_rate,
            note=f"fallback from {name}: {note}",
        )
    by_time = name == "srrt"
    if isinstance(cutoffs, str):
        cutoffs = _bands.parse_cutoffs(cutoffs, unit="seconds" if by_time else "bytes")
    if adapt is None:
        adapt = cutoffs is None
    if cutoffs is None:
        cutoffs = default_cutoffs(len(bandmap.data), by_time=by_time)
    return KernelUplink(
        bandmap=bandmap,
        cutoffs=cutoffs,
        by_time=by_time,
        adapt=adapt,
        interval=interval,
        lowat=notsent_lowat,
        note=note,
        top_fraction=top_fraction,
        lowest_writers=lowest_writers,
        ordered_bands=ordered_bands,
    )


def default_cutoffs(n_bands: int, *, by_time: bool) -> _bands.Cutoffs:
    """Starting cutoffs: 1K-50K log-spaced (paper 001 §2.2.4); for SRRT the same sizes as
    remaining times of a fresh LAN connection (RTT 1 ms, cwnd 10, MSS 1448; paper 002 eq. 2)."""
    sizes = _bands.log_spaced(1024.0, 51200.0, n_bands - 1)
    if not by_time:
        return sizes
    fresh = _ti.TcpInfo(1, 1e-3, 10, 1448, 0, 0, 0, 0, 0)
    return _bands.Cutoffs(tuple(_ti.remaining_time(x, fresh) for x in sizes.edges))

