"""Loopback ports and scratch directories for whoever launches the harness (tests, bench, demo)."""

from __future__ import annotations

import random
import socket
import tempfile
from pathlib import Path

__all__ = ["free_port", "scratch_dir"]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago, below the kernel's ephemeral range: a
    port the kernel picks for port 0 is also what it hands the next outgoing connection, which
    can take it before the server the caller starts binds it. The kernel's pick where that range
    starts too low to leave room."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64) if low > 12000 else ():
        port = rng.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def scratch_dir(prefix: str) -> Path:
    """A new directory under ``/tmp``, mode 0755: Apache's ``www-data`` workers must read below it."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    d.chmod(0o755)
    return d
