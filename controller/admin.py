"""The sidecar's control endpoints under ``/-/`` on its own listener, and the Apache status scrape.

``GET /-/metrics`` (Prometheus text: the sidecar's metrics and Apache's mod_status, scraped at
that moment), ``GET /-/policy`` (name, version, hash, source, swap and fetch counts, the online
loop's status), ``PUT /-/policy`` (loopback clients only, unless disabled; the body is a baseline
name, a server-side policy file path, the bytes of a ``.npz`` policy, or an ``http://`` URL of the
REST API's artifact to follow) and ``GET /-/healthz``. A refused policy answers 422 and the
running policy stays.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from prometheus_client import generate_latest

from overtake.controller.errors import PolicyLoadError, SidecarInputError
from overtake.controller.harness.apache import parse_status
from overtake.controller.policy_fetch import PolicyFetchError

if TYPE_CHECKING:
    from overtake.controller.sidecar import Sidecar

__all__ = ["AdminEndpoints"]

Answer = tuple[int, bytes, bytes]  # (status, content type, body)


class AdminEndpoints:
    """``/-/<path>`` requests of one :class:`~overtake.controller.sidecar.Sidecar`."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.side = sidecar

    async def handle(self, method: bytes, path: bytes, body: bytes, peer: str) -> Answer:
        """Answer ``/-/<path>`` (``path`` without the ``/-``) from client address ``peer``."""
        if path in (b"/metrics", b"/metrics/"):
            await self.scrape_apache()
            return 200, b"text/plain; version=0.0.4; charset=utf-8", generate_latest(self.side.metrics.registry)
        if path == b"/healthz":
            return 200, b"text/plain", b"ok\n"
        if path == b"/policy":
            if method == b"GET":
                return 200, b"application/json", _json(self.policy_info())
            if method == b"PUT":
                if not self.side.options.admin_put or peer not in ("127.0.0.1", "::1"):
                    return 403, b"text/plain", b"PUT /-/policy: only loopback clients may swap the policy\n"
                if body.strip().startswith((b"http://", b"https://")):
                    return await self._put_policy_url(body.decode("utf-8", errors="replace").strip())
                return self._put_policy(body)
            return 405, b"text/plain", b"/-/policy: use GET or PUT\n"
        return 404, b"text/plain", b"admin paths: /-/metrics, /-/policy, /-/healthz\n"

    def policy_info(self) -> dict[str, Any]:
        """The body of ``GET /-/policy``."""
        side = self.side
        p = side.policy
        online = side.online
        return {
            "name": p.name, "version": p.version, "hash": p.hash, "phases": list(p.phases),
            "per_phase_queues": p.per_phase_queues, "predicted_response_time_model_units": p.predicted_wait,
            "swapped_at": side.swapped_at, "swaps": side.metrics.swaps, "refused": side.metrics.refused,
            "classifier": side.classifier.mode, **side.source.info(),
            **({"online": online.status()} if online is not None else {}),
        }

    async def scrape_apache(self) -> None:
        """Read Apache's ``/server-status?auto`` into the metrics (``None`` and a failure counted
        when it is not reachable or not mod_status)."""
        host, port = self.side.apache
        apache = self.side.metrics.apache
        try:
            async with asyncio.timeout(2.0):
                r, w = await asyncio.open_connection(host, port)
                try:
                    w.write(b"GET /server-status?auto HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % host.encode())
                    raw = await r.read()
                finally:
                    w.close()
            head, _, body = raw.partition(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200") or b"ServerMPM" not in body:
                raise ValueError("not mod_status")
            if b"chunked" in head.lower():
                body = _dechunk(body)
            apache.status = parse_status(body.decode("latin-1"))
        except (OSError, TimeoutError, ValueError):
            apache.status = None
            apache.scrape_failures += 1

    def _put_policy(self, body: bytes) -> Answer:
        tmp = None
        if body.startswith(b"PK"):  # an .npz (zip) uploaded as bytes
            digest = hashlib.sha256(body).hexdigest()[:12]
            tmp = tempfile.mkdtemp(prefix="overtake-policy-")
            spec = os.path.join(tmp, f"upload-{digest}.npz")
            with open(spec, "wb") as f:
                f.write(body)
        else:
            spec = body.decode("utf-8", errors="replace").strip()
            if not spec:
                return (
                    400,
                    b"text/plain",
                    b"PUT /-/policy: body must be pi(k), pi(k1,...,kN), passthrough, a policy file path or .npz bytes\n",
                )
        try:
            self.side.swap(spec, source="admin")
        except (PolicyLoadError, SidecarInputError) as exc:
            return 422, b"text/plain", (f"refused, old policy kept: {exc}\n").encode()
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        self.side.source.unfollow()  # an explicit policy replaces the API's
        return 200, b"application/json", _json(self.policy_info())

    async def _put_policy_url(self, url: str) -> Answer:
        """``PUT /-/policy`` with a URL: fetch it now and, if it installs, follow it from then on."""
        try:
            await self.side.source.follow(url)
        except (PolicyFetchError, PolicyLoadError, SidecarInputError) as exc:
            return 422, b"text/plain", (f"refused, old policy kept: {exc}\n").encode()
        return 200, b"application/json", _json(self.policy_info())


def _json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True).encode() + b"\n"


def _dechunk(body: bytes) -> bytes:
    out = []
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        n = int(size_line.split(b";")[0], 16)
        if n == 0:
            break
        out.append(rest[:n])
        body = rest[n + 2:]
    return b"".join(out)
