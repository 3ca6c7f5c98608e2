"""``TCP_INFO`` and ``SO_PRIORITY`` on a connected socket (Linux).

Offsets of ``struct tcp_info`` (``<linux/tcp.h>``, little-endian, native alignment), checked
with ``offsetof()`` against the 6.1 userspace header and against ``ss -tin`` on a 6.18 kernel
(which returns 256 bytes). Older kernels return a shorter struct; fields beyond the returned
length read as ``None``.

The remaining-time estimate is Al Sa'deh and Yahya, "A new scheduling policy in web servers" §3,
eq. (1)-(2): a TCP flow moves at most
``R = cwnd·MSS / RTT`` bytes per second, so the remaining response time is
``RRT = RTT + RFS / R = RTT · (1 + RFS / (cwnd·MSS))`` for ``RFS`` remaining bytes.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
from dataclasses import dataclass
from typing import Protocol

__all__ = ["SockLike", "TcpInfo", "outq_bytes", "read_tcp_info", "remaining_time", "set_priority"]

_LEN = 256
_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")


class SockLike(Protocol):
    """A socket or asyncio's TransportSocket."""

    def fileno(self) -> int: ...

    def getsockopt(self, level: int, optname: int, buflen: int, /) -> bytes: ...

    def setsockopt(self, level: int, optname: int, value: int, /) -> None: ...


@dataclass(frozen=True, slots=True)
class TcpInfo:
    """The ``tcpi_*`` fields the uplink uses (times in seconds, sizes in bytes)."""

    state: int
    rtt: float  # smoothed RTT, s
    snd_cwnd: int  # segments
    snd_mss: int  # bytes
    unacked: int  # segments
    total_retrans: int
    bytes_acked: int | None  # since the connection started
    notsent_bytes: int | None  # in the send queue, not yet sent
    bytes_sent: int | None


def _u32(b: bytes, off: int) -> int | None:
    return _U32.unpack_from(b, off)[0] if len(b) >= off + 4 else None


def _u64(b: bytes, off: int) -> int | None:
    return _U64.unpack_from(b, off)[0] if len(b) >= off + 8 else None


def read_tcp_info(sock: SockLike) -> TcpInfo:
    """One ``getsockopt(IPPROTO_TCP, TCP_INFO)``; raises ``OSError`` on a closed socket."""
    b = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _LEN)
    return TcpInfo(
        state=b[0],
        rtt=(_u32(b, 68) or 0) * 1e-6,
        snd_cwnd=_u32(b, 80) or 0,
        snd_mss=_u32(b, 16) or 0,
        unacked=_u32(b, 24) or 0,
        total_retrans=_u32(b, 100) or 0,
        bytes_acked=_u64(b, 120),
        notsent_bytes=_u32(b, 144),
        bytes_sent=_u64(b, 200),
    )


def outq_bytes(sock: SockLike) -> int:
    """Bytes in the kernel send queue not yet acknowledged (``SIOCOUTQ`` = ``TIOCOUTQ``)."""
    buf = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    return int(_U32.unpack(buf)[0])


def remaining_time(remaining_bytes: float, info: TcpInfo, *, default_rtt: float = 1e-3) -> float:
    """Al Sa'deh and Yahya eq. (2): ``RTT · (1 + remaining / (cwnd · MSS))`` in seconds.

    Before the first RTT sample (``rtt == 0``) ``default_rtt`` stands in; a zero cwnd or MSS
    (closed socket) is treated as one segment of 536 bytes so the estimate stays finite.
    """
    rtt = info.rtt if info.rtt > 0 else default_rtt
    window = max(info.snd_cwnd, 1) * (info.snd_mss if info.snd_mss > 0 else 536)
    return rtt * (1.0 + max(remaining_bytes, 0.0) / window)


def set_priority(sock: SockLike, priority: int) -> None:
    """``setsockopt(SOL_SOCKET, SO_PRIORITY)``; values >= 7 need CAP_NET_ADMIN/CAP_NET_RAW."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, priority)
