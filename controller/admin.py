"""The sidecar's control endpoints under ``/-/`` and the Apache status scrape.

``GET /-/metrics`` (Prometheus text: the sidecar's metrics and Apache's mod_status as last
scraped), ``GET /-/policy`` (name, version, hash, source, swap and fetch counts, the online
loop's status), ``PUT /-/policy`` and ``GET /-/healthz`` (503 while draining). They are served on
the public listener, or only on ``admin_listen`` when that is set.

``PUT /-/policy`` (loopback clients only, unless ``admin_put`` is off) takes a body of at most
1 MiB, checked from the header block before it is read (:mod:`overtake.controller.http1`): a
baseline name, a server-side path (regular files only, at most ``policy_max_bytes``), the bytes
of a ``.npz`` policy, or an ``http(s)://`` URL to follow, on the ``--policy-url`` origin or under
an ``admin_policy_urls`` prefix (403 otherwise, and the URL is not contacted). The policy is
loaded off the event loop under a deadline (:meth:`overtake.controller.sidecar.Sidecar.install`).
A refused policy answers 422 with one line naming the field; the running policy stays.

Apache's ``/server-status?auto`` is scraped every ``status_interval`` seconds by one task, never
per ``/-/metrics`` request, so scrapes add no load on Apache. An Apache that answers 401, 403, 404
or 410 there (no mod_status, or not for the sidecar's address) is said so once in the log, and
the ``apache_*`` series are left out; ``apache_up 0`` means Apache could not be reached. With
``cpu_priority`` age or class the same task reads mod_overtake_prio's ``/overtake-prio-status`` and
passes its counters through; an Apache without the module is said so once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from overtake.controller.errors import PolicyLoadError, SidecarInputError
from overtake.controller.harness.apache import parse_status
from overtake.controller.http1 import ADMIN_BODY_MAX
from overtake.controller.policies import PolicySet
from overtake.controller.policy_fetch import PolicyFetchError

if TYPE_CHECKING:
    from overtake.controller.sidecar import Sidecar

__all__ = ["AdminEndpoints"]

log = logging.getLogger("overtake.sidecar")

Answer = tuple[int, bytes, bytes]  # (status, content type, body)
LOOPBACK = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})
_NO_STATUS = (401, 403, 404, 410)  # Apache answers, but not with mod_status for us


class AdminEndpoints:
    """``/-/<path>`` requests of one :class:`~overtake.controller.sidecar.Sidecar`."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.side = sidecar
        self.draining = False
        self._scraper: asyncio.Task[None] | None = None
        self._state = "unknown"  # ok | absent | unreachable: the scrape's last outcome
        self._prio_ok: bool | None = None  # mod_overtake_prio's counters: last scrape answered

    def body_cap(self, peer: str) -> tuple[int, str]:
        """(largest control-endpoint body from ``peer``, the refusal when none is allowed)."""
        if not self.side.options.admin_put:
            return 0, "PUT /-/policy is disabled (admin_put: false); control endpoints take no request body"
        if peer not in LOOPBACK:
            return 0, "control endpoints under /-/ take a request body only from loopback clients (127.0.0.1, ::1)"
        return ADMIN_BODY_MAX, ""

    async def handle(self, method: bytes, path: bytes, body: bytes, peer: str) -> Answer:
        """Answer ``/-/<path>`` (``path`` without the ``/-``) from client address ``peer``."""
        if path in (b"/metrics", b"/metrics/"):
            return 200, b"text/plain; version=0.0.4; charset=utf-8", generate_latest(self.side.metrics.registry)
        if path == b"/healthz":
            if self.draining:
                return 503, b"text/plain", b"draining\n"
            return 200, b"text/plain", b"ok\n"
        if path == b"/policy":
            if method == b"GET":
                return 200, b"application/json", _json(self.policy_info())
            if method == b"PUT":
                if not self.side.options.admin_put or peer not in LOOPBACK:
                    return 403, b"text/plain", b"PUT /-/policy: only loopback clients may swap the policy\n"
                return await self._put_policy(body)
            return 405, b"text/plain", b"/-/policy: use GET or PUT\n"
        return 404, b"text/plain", b"admin paths: /-/metrics, /-/policy, /-/healthz\n"

    def policy_info(self) -> dict[str, Any]:
        """The body of ``GET /-/policy``."""
        side = self.side
        p = side.policy
        online = side.online
        return {
            "name": p.name, "version": p.version, "hash": p.hash, "phases": list(p.phases),
            "per_phase_queues": p.per_phase_queues, "phase_info": p.phase_info,
            "predicted_response_time_model_units": p.predicted_wait,
            "predicted_response_time_seconds": None if p.predicted_wait is None else p.predicted_wait * side.time_unit,
            "time_unit": side.time_unit,
            "phase_names": None if p.model_phases is None else [list(n) for n in p.model_phases],
            "swapped_at": side.swapped_at, "swaps": side.metrics.swaps, "refused": side.metrics.refused,
            "classifier": side.classifier.mode, "cpu_priority": side.options.cpu_priority, **side.source.info(),
            **({"auto": {"chosen": p.chosen.name, "phase_info": p.chosen.phase_info, "reason": p.reason,
                         "predicted_gain": p.predicted_gain, "candidates": [m.name for m in p.members]}}
               if isinstance(p, PolicySet) else {}),
            **({"online": online.status()} if online is not None else {}),
        }

    # ---- the mod_status scrape -------------------------------------------------------------
    def start(self) -> None:
        """Scrape Apache every ``status_interval`` seconds from now on."""
        self._scraper = asyncio.create_task(self._scrape_loop())

    async def stop(self) -> None:
        if self._scraper is not None:
            self._scraper.cancel()
            await asyncio.gather(self._scraper, return_exceptions=True)

    async def _scrape_loop(self) -> None:
        while True:
            await asyncio.sleep(self.side.options.status_interval)
            await self.scrape_apache()

    async def _get(self, path: bytes) -> tuple[int, bytes]:
        """GET ``path`` from Apache (2 s, 1 MiB at most): (status, de-chunked body)."""
        host, port = self.side.apache
        async with asyncio.timeout(2.0):
            r, w = await asyncio.open_connection(host, port)
            try:
                w.write(b"GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (path, host.encode()))
                raw = b""
                while len(raw) < 1 << 20:  # mod_status ?auto and the module's counters are a few kB
                    chunk = await r.read(65536)
                    if not chunk:
                        break
                    raw += chunk
            finally:
                w.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        try:
            code = int(head.split(b" ", 2)[1])
        except (IndexError, ValueError):
            raise ValueError("not HTTP") from None
        if b"chunked" in head.lower():
            body = _dechunk(body)
        return code, body

    async def scrape_apache(self) -> None:
        """Read Apache's ``/server-status?auto`` into the metrics: the parsed status, or absent
        (Apache answers 401/403/404/410 or not with mod_status), or unreachable (a failure)."""
        apache = self.side.metrics.apache
        if self.side.options.cpu_priority != "off" or self.side.gate is not None:
            await self.scrape_prio()
        try:
            code, body = await self._get(b"/server-status?auto")
            if code in _NO_STATUS or (code == 200 and b"ServerMPM" not in body):
                apache.status, apache.absent = None, True
                self._enter("absent", f"GET /server-status?auto answered HTTP {code}" + (
                    " without mod_status fields" if code == 200 else ""))
                return
            if code != 200:
                raise ValueError(f"HTTP {code}")
            apache.status, apache.absent = parse_status(body.decode("latin-1")), False
            self._enter("ok", "")
        except (OSError, TimeoutError, ValueError) as exc:
            apache.status, apache.absent = None, False
            apache.scrape_failures += 1
            self._enter("unreachable", f"{exc.__class__.__name__}: {exc}")

    async def scrape_prio(self) -> None:
        """mod_overtake_prio's counters into the metrics (left out while it does not answer)."""
        prio = self.side.metrics.prio
        try:
            code, body = await self._get(b"/overtake-prio-status")
            if code != 200 or b"overtake_cpu_prio_enabled" not in body:
                raise ValueError(f"HTTP {code}" + (" without the module's counters" if code == 200 else ""))
            prio.families = list(text_string_to_metric_families(body.decode("utf-8", errors="replace")))
            ok, detail = True, ""
        except (OSError, TimeoutError, ValueError) as exc:
            prio.families = []
            ok, detail = False, f"{exc.__class__.__name__}: {exc}"
        token = next((int(s.value) for f in prio.families if f.name == "overtake_gate_token" for s in f.samples), None)
        self.side.check_gate(token, "" if ok else f"GET /overtake-prio-status: {detail}")
        if ok != self._prio_ok:
            self._prio_ok = ok
            if not ok:
                log.warning("Apache's mod_overtake_prio does not answer: overtake_cpu_prio_* metrics left out", extra={
                    "event": "cpu_priority_absent", "detail": f"GET /overtake-prio-status: {detail}; cpu_priority "
                    f"{self.side.options.cpu_priority} needs mod_overtake_prio loaded in Apache "
                    "(apache-conf/mod_overtake_prio/README.md)"})
            else:
                log.info("mod_overtake_prio counters scraped", extra={"event": "cpu_priority_ok"})

    def _enter(self, state: str, detail: str) -> None:
        """Log a change of the scrape's outcome once (not at every scrape)."""
        if state == self._state:
            return
        first, self._state = self._state == "unknown", state
        if state == "absent":
            log.warning("Apache has no mod_status for the sidecar: apache_* metrics left out", extra={
                "event": "apache_status_absent", "detail": f"{detail}; to get them, load mod_status and allow "
                "the sidecar's address to /server-status (apache-conf/examples/vhost-behind-sidecar.conf)"})
        elif state == "unreachable" and not first:  # at start, Sidecar._check_apache says so
            log.warning("Apache not reachable for the status scrape", extra={
                "event": "apache_unreachable", "detail": detail})
        elif state == "ok" and not first:
            log.info("Apache status scrape ok", extra={"event": "apache_status_ok"})

    # ---- PUT /-/policy ---------------------------------------------------------------------
    async def _put_policy(self, body: bytes) -> Answer:
        side = self.side
        text = body.strip()
        try:
            if body.startswith(b"PK"):  # an .npz (zip) uploaded as bytes
                name = f"upload-{hashlib.sha256(body).hexdigest()[:12]}.npz"
                await side.install(name, source="admin", data=body)
            elif text.startswith((b"http://", b"https://")):
                url = text.decode("utf-8", errors="replace")
                if not side.source.url_allowed(url):
                    return 403, b"text/plain", (
                        f"PUT /-/policy: {url} is not on the policy_url origin nor under admin_policy_urls; "
                        "add its prefix to admin_policy_urls in the sidecar's config\n").encode()
                await side.source.follow(url)
                return 200, b"application/json", _json(self.policy_info())
            elif not text:
                return 400, b"text/plain", (b"PUT /-/policy: body must be pi(k), pi(k1,...,kN), passthrough, "
                                            b"a policy file path, .npz bytes or an allowed URL\n")
            else:
                await side.install(text.decode("utf-8", errors="replace"), source="admin")
        except (PolicyFetchError, PolicyLoadError, SidecarInputError) as exc:
            return 422, b"text/plain", (f"refused, old policy kept: {_one_line(str(exc))}\n").encode()
        side.source.unfollow()  # an explicit policy replaces the API's
        return 200, b"application/json", _json(self.policy_info())


def _one_line(text: str) -> str:
    return " ".join(text.split())


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
