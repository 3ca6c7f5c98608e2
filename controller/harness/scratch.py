"""Loopback ports and scratch directories for whoever launches the harness (tests, bench, demo)."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

__all__ = ["free_port", "scratch_dir"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the kernel's pick for port 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def scratch_dir(prefix: str) -> Path:
    """A new directory under ``/tmp``, mode 0755: Apache's ``www-data`` workers must read below it."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    d.chmod(0o755)
    return d
