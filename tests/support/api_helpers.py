"""Shared pieces of the API tests: tiny scenarios with known answers, polling, a live server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]


def exp2(load: float = 0.3, max_requests: int | None = 8, **extra: Any) -> dict[str, Any]:
    """Two exponential stages (mean 1 each): π* = π(1) (van der Weij et al., "Dynamic thread
    assignment" §3), π(∞) is M/M/1-PS: E[W] = 2/(1−ρ)."""
    sc: dict[str, Any] = {
        "load": load,
        "stages": [{"name": "front", "service": {"exponential": {"mean": 1.0}}},
                   {"name": "back", "service": {"exponential": {"mean": 1.0}}}],
        **extra,
    }
    if max_requests is not None:
        sc["truncation"] = {"max_requests": max_requests}
    return sc


def wait(client: Any, url: str, timeout: float = 90.0) -> dict[str, Any]:
    """Poll a job until it ends (done, failed or cancelled)."""
    t0 = time.monotonic()
    while True:
        doc: dict[str, Any] = client.get(url).json()
        if doc["status"] in ("done", "failed", "cancelled"):
            return doc
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{url} still {doc['status']} after {timeout} s: {doc}")
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def live_api(db: Path, *extra: str) -> Iterator[str]:
    """``overtake api`` as a real uvicorn process on a free loopback port; yields its base URL."""
    port = free_port()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    env.pop("OVERTAKE_API_TOKEN", None)
    log = db.with_suffix(".log")
    with log.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "overtake.api.cli", "api", "--listen", f"127.0.0.1:{port}",
                                 "--db", str(db), "--log-level", "warning", *extra],
                                cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            try:
                if httpx.get(base + "/healthz", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() - t0 > 30:
                raise AssertionError(f"overtake api did not start (exit {proc.poll()}):\n{log.read_text()}")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
