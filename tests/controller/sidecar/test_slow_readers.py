"""Slow readers: a client that reads a large answer slowly, or not at all, must not hold
a stage slot or the passthrough cap once Apache has finished (controller/sidecar/spool.py), and a client
that stops reading is cut after ``client_timeout`` without progress.

The known answers: with π(1) a second request for the same stage is admitted only once the
first one's slot is free, so it is served while the first client still has not read (with the
spool), or waits into its queue timeout (``response_spill_bytes: 0``, the control that shows
the test can fail); the slow client then gets every byte of its answer, in order.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from support.service_helpers import QuietHandler, SidecarProc

PATTERN = bytes(range(256)) * 4096  # 1 MiB


def body(n: int) -> bytes:
    return (PATTERN * (n // len(PATTERN) + 1))[:n]


class Sized(QuietHandler):
    """GET /big/N: N bytes of PATTERN, written as fast as the socket takes them."""

    def do_GET(self) -> None:
        if not self.path.startswith("/big/"):  # the sidecar's status scrape
            self.send_error(404)
            return
        n = int(self.path.rsplit("/", 1)[1])
        self.send_response(200)
        self.send_header("Content-Length", str(n))
        self.end_headers()
        data = body(n)
        try:
            for i in range(0, n, 1 << 16):
                self.wfile.write(data[i:i + (1 << 16)])
        except OSError:
            pass


@pytest.fixture
def upstream() -> tuple[str, ThreadingHTTPServer]:  # type: ignore[misc]
    up = ThreadingHTTPServer(("127.0.0.1", 0), Sized)
    up.daemon_threads = True
    threading.Thread(target=up.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{up.server_address[1]}", up
    up.shutdown()
    up.server_close()


def _sidecar(work: Path, url: str, limits: str) -> SidecarProc:
    stages = ('stages: [{name: stage1, path: "^/big/"}, {name: stage2, path: "^/other"}]\n'
              f"limits: {{max_inflight: 8, response_buffer_bytes: 65536, queue_timeout: 3{limits}}}\n")
    return SidecarProc(work, ["--policy", "pi(1)", "--apache", url], stages=stages)


def _stalled_client(port: int, n: int) -> socket.socket:
    """A client that asks for n bytes and reads nothing (a small receive buffer)."""
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.connect(("127.0.0.1", port))
    c.sendall(f"GET /big/{n} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return c


@contextmanager
def _stalled(work: Path, url: str, limits: str, n: int) -> Iterator[tuple[SidecarProc, socket.socket]]:
    """A sidecar with ``limits`` and a client of it that asks for n bytes and reads nothing; the
    client is closed and the sidecar stopped (cleanly) after."""
    s = _sidecar(work, url, limits)
    try:
        a = _stalled_client(s.port, n)
        try:
            yield s, a
        finally:
            a.close()
    finally:
        assert s.stop() == 0


def _read_response(c: socket.socket) -> tuple[bytes, bytes]:
    c.settimeout(30)
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += c.recv(1 << 16)
    head, _, rest = raw.partition(b"\r\n\r\n")
    n = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(rest) < n:
        chunk = c.recv(1 << 20)
        assert chunk, f"connection closed after {len(rest)} of {n} bytes"
        rest += chunk
    return head, rest


def _metric(s: SidecarProc, name: str) -> float:
    """A sample's value; a labelled counter not yet incremented is 0."""
    text = s.request("GET", "/-/metrics")[2].decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m or "{" in name, f"{name} not exported"
    return float(m.group(1)) if m else 0.0


def _wait(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_slow_reader_does_not_hold_its_stage_slot(work: Path, upstream) -> None:  # type: ignore[no-untyped-def]
    n = 12_000_000
    with _stalled(work, upstream[0], "", n) as (s, a):
        # Apache (the stub) finishes at once; the rest of the answer waits on disk, not in the slot
        _wait(lambda: _metric(s, "overtake_response_spool_bytes") > 1_000_000, 15, "the answer to spill")
        code, _, data = s.request("GET", "/big/1000", timeout=20)
        assert code == 200 and data == body(1000)  # admitted under pi(1): the slot was free
        head, got = _read_response(a)
        a.close()
        assert head.startswith(b"HTTP/1.1 200") and got == body(n)
        _wait(lambda: _metric(s, "overtake_response_spool_bytes") == 0, 10, "the spool to empty")
        assert _metric(s, "overtake_inflight") == 0


def test_without_spilling_the_slow_reader_holds_the_slot(work: Path, upstream) -> None:  # type: ignore[no-untyped-def]
    with _stalled(work, upstream[0], ", response_spill_bytes: 0", 12_000_000) as (s, _):
        time.sleep(0.5)
        code, _, _ = s.request("GET", "/big/1000", timeout=20)
        assert code == 503  # queued behind the held slot until queue_timeout


def test_a_client_that_stops_reading_is_cut_after_client_timeout(work: Path, upstream) -> None:  # type: ignore[no-untyped-def]
    with _stalled(work, upstream[0], ", client_timeout: 1", 12_000_000) as (s, a):
        _wait(lambda: _metric(s, 'overtake_gateway_errors_total{reason="client_abort"}') >= 1, 15,
              "the stalled client to be cut")
        _wait(lambda: _metric(s, "overtake_response_spool_bytes") == 0, 10, "the spool to be dropped")
        assert _metric(s, 'overtake_gateway_errors_total{reason="upstream_error"}') == 0
        a.settimeout(10)
        got = 0
        try:
            while chunk := a.recv(1 << 20):
                got += len(chunk)
        except OSError:
            pass
        assert got < 12_000_000  # cut, not completed
        a.close()
        assert s.request("GET", "/big/1000")[0] == 200


def test_spooled_answers_share_one_budget_and_apache_waits_beyond_it(work: Path, upstream) -> None:  # type: ignore[no-untyped-def]
    """Three clients not reading a 6 MB answer with ``spool_budget_bytes: 2000000``: the spool
    stays within the budget (plus at most one read of Apache's per answer: 64 KiB), Apache's
    answers wait instead of failing, and once the clients read, each gets every byte."""
    url, _ = upstream
    stages = ('stages: [{name: stage1, path: "^/stage1"}, {name: stage2, path: "^/other"}]\n'
              "limits: {max_inflight: 8, response_buffer_bytes: 65536, spool_budget_bytes: 2000000}\n")
    s = SidecarProc(work, ["--policy", "pi(1)", "--apache", url], stages=stages)
    n = 6_000_000
    try:
        clients = [_stalled_client(s.port, n) for _ in range(3)]
        _wait(lambda: _metric(s, "overtake_response_spool_bytes") > 1_500_000, 15, "the answers to spill")
        seen = []
        for _ in range(10):  # what it settles at (without the budget: nearly 3 x 6 MB)
            time.sleep(0.1)
            seen.append(_metric(s, "overtake_response_spool_bytes"))
        assert max(seen) <= 2_000_000 + 3 * (65536 + 16), seen
        assert _metric(s, "overtake_inflight") == 3  # Apache's answers are held back, not failed
        for c in clients:
            head, got = _read_response(c)
            c.close()
            assert head.startswith(b"HTTP/1.1 200") and got == body(n)
        _wait(lambda: _metric(s, "overtake_response_spool_bytes") == 0, 10, "the spool to empty")
        assert _metric(s, "overtake_inflight") == 0
        assert _metric(s, 'overtake_gateway_errors_total{reason="upstream_error"}') == 0
    finally:
        assert s.stop() == 0
