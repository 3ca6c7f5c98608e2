"""Fault injection in front of a real Apache: a TCP relay that holds its first answers to
``/server-status`` for a while, as a loaded machine or a busy Apache does.

Every other request, and every later one, passes straight through to Apache.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from overtake.controller.harness.scratch import free_port
from support.raw_http import read_head

__all__ = ["SlowStatus"]


class SlowStatus:
    """Relay ``127.0.0.1:port`` to Apache at ``upstream``; the first ``slow`` requests for
    ``/server-status`` wait ``delay`` seconds before they reach Apache."""

    def __init__(self, upstream: tuple[str, int], delay: float, slow: int = 1) -> None:
        self.upstream, self.delay = upstream, delay
        self.slow = slow  # status requests still to hold
        self.held = 0  # status requests held so far
        self.port = free_port()
        self._lock = threading.Lock()
        self._srv = socket.create_server(("127.0.0.1", self.port))
        self._open = True
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._open = False
        self._srv.close()

    def _accept(self) -> None:
        while self._open:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _hold(self, head: bytes) -> bool:
        with self._lock:
            if self.slow > 0 and b" /server-status" in head.split(b"\r\n", 1)[0]:
                self.slow -= 1
                self.held += 1
                return True
            return False

    def _relay(self, client: socket.socket) -> None:
        with contextlib.suppress(OSError), client:
            head = read_head(client)
            if head is None:
                return
            if self._hold(head):
                time.sleep(self.delay)
            with socket.create_connection(self.upstream) as up:
                up.sendall(head)
                back = threading.Thread(target=_pipe, args=(client, up), daemon=True)
                back.start()
                _pipe(up, client)
                back.join(self.delay + 30)


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends; then end ``dst``'s writing side."""
    with contextlib.suppress(OSError):
        while chunk := src.recv(65536):
            dst.sendall(chunk)
        dst.shutdown(socket.SHUT_WR)
