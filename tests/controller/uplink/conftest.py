"""Shared by the uplink tests: a throw-away network namespace with a veth pair."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator

import pytest

IS_ROOT = os.geteuid() == 0


@pytest.fixture
def veth_ns() -> Iterator[tuple[str, str]]:
    """A fresh namespace holding a veth pair (both ends up); deleted whatever happens."""
    if not IS_ROOT:
        pytest.skip("needs root: ip netns add / tc qdisc")
    ns = f"ovt_q_{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "add", "va", "type", "veth", "peer", "name", "vb"], check=True)
        for d in ("va", "vb"):
            subprocess.run(["ip", "-n", ns, "link", "set", d, "up"], check=True)
        yield ns, "va"
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
