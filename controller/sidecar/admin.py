"""The sidecar's control endpoints, and who may use them.

They live on the admin listener (``admin_listen``, default ``127.0.0.1:9089``, loopback only),
never on the public one:

* ``GET /-/metrics`` and ``GET /metrics`` (Prometheus's default ``metrics_path``): the sidecar's
  metrics and Apache's mod_status as last scraped (:mod:`overtake.controller.sidecar.apache_probe`);
* ``GET /-/policy``: name, version, hash, source, swap and fetch counts, the online loop's status;
* ``PUT /-/policy``: swap the policy (below);
* ``GET /-/healthz`` (readiness): ``ok``, or 503 ``draining`` after SIGTERM, or 503 ``degraded:``
  with the reason while Apache is down; ``GET /-/livez`` (liveness): ``ok`` while the process
  runs, draining or not.

The public listener answers only ``/-/healthz`` and ``/-/livez`` (a load balancer probes the
address it sends traffic to); every other ``/-/`` path there is a 404.

``PUT /-/policy`` needs ``Authorization: Bearer TOKEN`` with the ``admin_token`` (or the content
of ``admin_token_file``), whatever the client's address; with no token configured every write is
refused (403, naming the key), and so it is with ``admin_put: false``. A body is refused from its
header block before it is read when no write can succeed, and is at most 1 MiB
(:mod:`overtake.controller.sidecar.http1`). It holds a baseline name, a server-side path (regular files
only, at most ``policy_max_bytes``), the bytes of a ``.npz`` policy, or an ``http(s)://`` URL to
follow, on the ``--policy-url`` origin or under an ``admin_policy_urls`` prefix (403 otherwise,
and the URL is not contacted). A refused policy answers 422 with one line naming the field and the
running policy stays; 503 when the policy loads already running or waiting are the most the
sidecar takes (:mod:`overtake.controller.sidecar.policy_loads`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest

from overtake.controller.errors import PolicyLoadError, SidecarInputError
from overtake.controller.sidecar.apache_probe import Health
from overtake.controller.sidecar.http1 import ADMIN_BODY_MAX
from overtake.controller.sidecar.policy_fetch import PolicyFetchError
from overtake.controller.sidecar.policy_loads import LoadBusy
from overtake.controller.sidecar.request import Request

__all__ = ["DEFAULT_ADMIN_LISTEN", "AdminAccess", "AdminEndpoints", "PolicyControl"]

#: the admin listener's default: loopback, off Prometheus's own ports (9090-9094) and off the
#: exporter range 9100-9999, every port of which some exporter has registered
DEFAULT_ADMIN_LISTEN = "127.0.0.1:9089"

Answer = tuple[int, bytes, bytes]  # (status, content type, body)
_TEXT = b"text/plain; charset=utf-8"
_METRICS = b"text/plain; version=0.0.4; charset=utf-8"
_PUBLIC = frozenset({"/-/healthz", "/-/livez"})
_NO_TOKEN = ("PUT /-/policy needs the admin token: set admin_token_file (or admin_token) in the sidecar's "
             "config, or --admin-token-file, and send Authorization: Bearer TOKEN")


@dataclass(frozen=True)
class AdminAccess:
    """Who may write: ``put`` (``admin_put``) and the bearer ``token`` (``admin_token``)."""

    put: bool
    token: str | None


class PolicyControl(Protocol):
    """What the endpoints need from the sidecar's policy (:class:`~overtake.controller.sidecar.service.Sidecar`)."""

    def policy_info(self) -> dict[str, Any]: ...

    async def install(self, spec: str, *, source: str, data: bytes | None = None) -> object: ...

    def url_allowed(self, url: str) -> bool: ...

    async def follow(self, url: str) -> None: ...

    def unfollow(self) -> None: ...


class AdminEndpoints:
    """Answers the admin paths of one sidecar.

    Parameters
    ----------
    registry
        The metrics served at ``/-/metrics`` and ``/metrics``.
    control
        The running policy: shown, swapped, followed.
    access
        The current :class:`AdminAccess` (read per request: a reload may change it).
    health
        Apache's health as last probed.
    """

    def __init__(self, registry: CollectorRegistry, control: PolicyControl, access: Callable[[], AdminAccess],
                 health: Callable[[], Health]) -> None:
        self.registry = registry
        self.control = control
        self.access = access
        self.health = health
        self.draining = False

    def body_cap(self, peer: str) -> tuple[int, str]:
        """(largest request body the admin listener reads, the refusal when none is allowed)."""
        acc = self.access()
        if not acc.put:
            return 0, "PUT /-/policy is disabled (admin_put: false); control endpoints take no request body"
        if not acc.token:
            return 0, _NO_TOKEN
        return ADMIN_BODY_MAX, ""

    async def handle(self, req: Request, public: bool) -> Answer:
        """Answer ``req`` (a ``/-/`` path on the public listener, any path on the admin one)."""
        path = req.path.rstrip("/") or "/"
        if path in _PUBLIC:
            return self._live() if path == "/-/livez" else self._ready()
        if public:
            return 404, _TEXT, b"the control endpoints are on the admin listener (admin_listen); here only " \
                               b"/-/healthz and /-/livez\n"
        if path in ("/-/metrics", "/metrics"):
            return 200, _METRICS, generate_latest(self.registry)
        if path == "/-/policy":
            if req.method == b"GET":
                return 200, b"application/json", _json(self.control.policy_info())
            if req.method == b"PUT":
                refusal = self._write_refusal(req)
                return refusal if refusal is not None else await self._put_policy(b"".join(req.body))
            return 405, _TEXT, b"/-/policy: use GET or PUT\n"
        return 404, _TEXT, b"admin paths: /-/metrics (or /metrics), /-/policy, /-/healthz, /-/livez\n"

    # ---- health ----------------------------------------------------------------------------
    @staticmethod
    def _live() -> Answer:
        return 200, _TEXT, b"ok\n"

    def _ready(self) -> Answer:
        if self.draining:
            return 503, _TEXT, b"draining\n"
        h = self.health()
        if not h.up:
            since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(h.since))
            return 503, _TEXT, f"degraded: {h.reason} (since {since})\n".encode()
        return 200, _TEXT, b"ok\n"

    # ---- PUT /-/policy ---------------------------------------------------------------------
    def _write_refusal(self, req: Request) -> Answer | None:
        """403 unless writes are on, a token is configured and the request carries it."""
        acc = self.access()
        if not acc.put:
            return 403, _TEXT, b"PUT /-/policy is disabled (admin_put: false)\n"
        if not acc.token:
            return 403, _TEXT, _NO_TOKEN.encode() + b"\n"
        if not _bearer_matches(req.headers, acc.token):
            return 403, _TEXT, (b"PUT /-/policy: missing or wrong Authorization: Bearer token "
                                b"(the sidecar's admin_token / admin_token_file)\n")
        return None

    async def _put_policy(self, body: bytes) -> Answer:
        ctl = self.control
        text = body.strip()
        try:
            if body.startswith(b"PK"):  # an .npz (zip) uploaded as bytes
                name = f"upload-{hashlib.sha256(body).hexdigest()[:12]}.npz"
                await ctl.install(name, source="admin", data=body)
            elif text.startswith((b"http://", b"https://")):
                url = text.decode("utf-8", errors="replace")
                if not ctl.url_allowed(url):
                    return 403, _TEXT, (
                        f"PUT /-/policy: {url} is not on the policy_url origin nor under admin_policy_urls; "
                        "add its prefix to admin_policy_urls in the sidecar's config\n").encode()
                await ctl.follow(url)
                return 200, b"application/json", _json(ctl.policy_info())
            elif not text:
                return 400, _TEXT, (b"PUT /-/policy: body must be pi(k), pi(k1,...,kN), passthrough, "
                                    b"a policy file path, .npz bytes or an allowed URL\n")
            else:
                await ctl.install(text.decode("utf-8", errors="replace"), source="admin")
        except LoadBusy as exc:
            return 503, _TEXT, (f"busy, old policy kept: {_one_line(str(exc))}\n").encode()
        except (PolicyFetchError, PolicyLoadError, SidecarInputError) as exc:
            return 422, _TEXT, (f"refused, old policy kept: {_one_line(str(exc))}\n").encode()
        ctl.unfollow()  # an explicit policy replaces the API's
        return 200, b"application/json", _json(ctl.policy_info())


def _bearer_matches(headers: list[tuple[bytes, bytes]], token: str) -> bool:
    """Does an ``Authorization: Bearer`` header carry ``token`` (compared in constant time)?"""
    want = token.encode()
    for k, v in headers:
        if k.lower() == b"authorization":
            scheme, _, given = v.strip().partition(b" ")
            if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), want):
                return True
    return False


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True).encode() + b"\n"
