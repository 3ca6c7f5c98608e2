"""Raw HTTP/1.1 on a socket, for the small servers and relays tests put beside a real one."""

from __future__ import annotations

import socket

__all__ = ["read_head"]


def read_head(sock: socket.socket) -> bytes | None:
    """Read until the end of a request or response head: what was read (the head, its blank line
    and any bytes after it), or None when the peer closed first."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    return buf
