"""Loopback ports for the harness: outside the range the kernel hands outgoing connections."""

from __future__ import annotations

import socket

import pytest

from overtake.controller.harness import scratch


def test_a_free_port_is_below_the_ephemeral_range_and_can_be_bound() -> None:
    low = scratch._ephemeral_low()
    ports = {scratch.free_port() for _ in range(20)}
    assert all(10000 <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 1  # drawn, not one fixed port every caller would share
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_a_taken_port_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        real, calls = scratch.random.SystemRandom.randrange, []

        def draw(self: object, a: int, b: int) -> int:
            calls.append(a)
            return busy if len(calls) <= 2 else real(self, a, b)  # type: ignore[arg-type]

        monkeypatch.setattr(scratch.random.SystemRandom, "randrange", draw)
        monkeypatch.setattr(scratch, "_ephemeral_low", lambda: 65536)
        assert scratch.free_port() != busy and len(calls) >= 3
