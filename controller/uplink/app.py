"""Application-level SRPT when no qdisc can be installed (Crovella et al., "Connection scheduling in web servers" §3.3).

No kernel bands: at most ``concurrency`` flows hand data to the kernel at once, the one with the
least remaining bytes first, ``quantum`` bytes at a time. A holder keeps its permit until its
quantum has left the send queue (``TCP_INFO`` notsent) and, between quanta, for as long as no
smaller flow waits, so the backlog stays in the server where the ordering is decided;
``TCP_NOTSENT_LOWAT`` (1 byte) keeps the kernel from holding unsent data of flows that wait.
This costs throughput when ``concurrency`` is small (Crovella et al. §5.4; bench/uplink_srpt.py).
"""

from __future__ import annotations

import asyncio
import socket

from overtake.controller.uplink import tcpinfo as _ti
from overtake.controller.uplink.errors import UplinkInputError
from overtake.controller.uplink.flow import LARGE_RESPONSE, TCP_NOTSENT_LOWAT, UplinkFlow, writer_socket
from overtake.controller.uplink.permits import Permits

__all__ = ["AppUplink"]

_SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
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
            writer_socket(writer).setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, up.lowat)
            # drain() returns only once the transport buffer is empty, i.e. the kernel took it
            writer.transport.set_write_buffer_limits(high=0)
            if up.max_pacing_rate:
                # TCP Small Queues lets a socket hold ~1 ms of its *pacing* rate in the qdisc;
                # on a LAN BBR paces far above the link, so one bulk flow fills the FIFO (and
                # every small response waits behind it) unless the pacing rate is capped
                writer_socket(writer).setsockopt(socket.SOL_SOCKET, _SO_MAX_PACING_RATE, up.max_pacing_rate)
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
                rem = float((self._total - self._written) if self._total is not None else LARGE_RESPONSE)
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
        lost (app with one writer then behaves as FAIR). Crovella et al. §3.3 needs the backlog held by
        the server.
        """
        try:
            sock = writer_socket(self._writer)
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
    """Crovella et al.: order our own writes by remaining bytes, ``concurrency`` writers at a time."""

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
        self._permits = Permits(concurrency)

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
