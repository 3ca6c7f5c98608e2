"""Assembly of the sidecar: stages, policy, classifier, limiter, gateway, metrics, hot swap.

:class:`Sidecar` owns the running policy. :meth:`Sidecar.swap` loads and validates a new one
(:func:`overtake.controller.policies.load_policy`), and only then installs it with
:meth:`overtake.controller.limiter.Limiter.swap` — one synchronous step on the event loop, so no request
ever sees half a policy; queued requests keep their order. A policy that fails to load or does
not match the stages raises :class:`overtake.controller.errors.PolicyLoadError` and the old policy stays.
Swaps come from ``PUT /-/policy`` (loopback clients), from the policy file changing on disk
(polled every ``watch_interval`` seconds; ``SIGHUP`` forces a reload), or from the REST API
(``policy_url``: polled every ``policy_poll`` seconds with the ETag, see :mod:`overtake.controller.policy_fetch`;
``PUT /-/policy`` with an ``http://`` URL follows another model).

Logs are JSON lines on stderr (``{"ts":..., "level":..., "event":..., ...}``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from overtake.controller import bands as _bands
from overtake.controller.apache import parse_status
from overtake.controller.classifier import Classifier
from overtake.controller.errors import PolicyLoadError, SidecarInputError
from overtake.controller.gateway import Gateway
from overtake.controller.limiter import Limiter
from overtake.controller.metrics import SidecarMetrics
from overtake.controller.online import OnlineCollector, OnlineLoop, OnlineSettings
from overtake.controller.policies import SpawnPolicy, load_policy
from overtake.controller.policy_fetch import FETCH_RESULTS, PolicyFetcher, PolicyFetchError, fetch_counter
from overtake.controller.stages import StageTable
from overtake.controller.upstream import UpstreamPool
from overtake.controller.uplink import make_uplink
from overtake.controller.uplink_errors import UplinkInputError
from overtake.controller.uplink_metrics import UplinkCollector

__all__ = ["JsonFormatter", "Sidecar", "SidecarOptions", "parse_addr", "parse_apache_url"]

log = logging.getLogger("overtake.sidecar")


class JsonFormatter(logging.Formatter):
    """One JSON object per log line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3), "level": record.levelname.lower(), "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k in ("event", "policy", "hash", "version", "detail", "listen", "apache", "reason", "source",
                     "outcome", "refit"):
                out[k] = v
        return json.dumps(out, sort_keys=True)


def parse_addr(text: str, field: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); errors name ``field``."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SidecarInputError(f"{field}: expected HOST:PORT such as 127.0.0.1:8080, got {text!r}")
    return host.strip("[]"), int(port)


def parse_apache_url(text: str) -> tuple[str, int]:
    """``http://HOST:PORT`` -> (host, port)."""
    rest = text.removeprefix("http://")
    if rest == text or "/" in rest.rstrip("/"):
        raise SidecarInputError(
            f"apache: expected http://HOST:PORT such as http://127.0.0.1:8081 (no path, no https), got {text!r}"
        )
    return parse_addr(rest.rstrip("/"), "apache")


@dataclass(frozen=True)
class SidecarOptions:
    """Command-line level options."""

    policy: str
    apache: str
    listen: str
    phase_header: str | None = None
    uplink: str = "fair"
    uplink_cutoffs: str | None = None  #: fixed SRPT/SRRT cutoffs ("1K,4K,16K"); adaptive when None
    uplink_top_fraction: float = _bands.TOP_FRACTION  #: adaptive cutoffs: share of responses above the highest
    uplink_lowest_writers: int = 0  #: srpt/srrt: lowest-band responses writing at once (0 = one FIFO)
    uplink_ordered_bands: int = 1  #: with uplink_lowest_writers: the lowest N bands each so ordered
    watch_interval: float = 1.0
    admin_put: bool = True
    online: OnlineSettings | None = None  #: refit, re-solve and swap online (controller.online)
    policy_url: str | None = None  #: API artifact URL; ``policy`` is then only the fallback ("" = none)
    policy_poll: float = 10.0
    policy_token: str | None = None


class Sidecar:
    """Everything wired together; ``await start()``, then ``await serve_forever()`` / ``close()``."""

    def __init__(self, table: StageTable, options: SidecarOptions) -> None:
        self.table = table
        self.options = options
        self.listen = parse_addr(options.listen, "listen")
        self.apache = parse_apache_url(options.apache)
        if options.uplink not in ("srpt", "srrt") and options.uplink_cutoffs is not None:
            raise UplinkInputError(f"uplink_cutoffs: only for --uplink srpt or srrt, not {options.uplink!r}")
        self.uplink = make_uplink(options.uplink, cutoffs=options.uplink_cutoffs,
                                  top_fraction=options.uplink_top_fraction,
                                  lowest_writers=options.uplink_lowest_writers,
                                  ordered_bands=options.uplink_ordered_bands)
        self.fetcher: PolicyFetcher | None = None
        self.policy_etag: str | None = None
        self.fetch_error: str | None = None
        self.fetch_counts = dict.fromkeys(FETCH_RESULTS, 0)
        self._fetch_lock = asyncio.Lock()
        first = self._initial_fetch(table) if options.policy_url else None
        policy = first if first is not None else load_policy(options.policy, table.names)
        self.policy_source = self.fetcher.url if first is not None and self.fetcher else options.policy
        self.swapped_at = time.time()
        cfg = table.config
        settings = cfg.classifier
        if options.phase_header:
            settings = settings.model_copy(update={"header": options.phase_header})
        self.classifier = Classifier(settings, policy)
        self.online: OnlineLoop | None = None
        if options.online is not None:
            self.online = OnlineLoop(
                options.online, table=table, time_unit=cfg.classifier.time_unit, policy=policy,
                current=lambda: self.limiter.policy,
                swap=lambda path: self.swap(path, source="online"), classifier_mode=settings.mode,
            )
        self.limiter = Limiter(
            policy, self.classifier, stage_names=table.names,
            queue_caps=tuple(table.queue_cap(i) for i in range(len(table.names))),
            max_inflight=cfg.limits.max_inflight, passthrough_cap=cfg.passthrough.cap,
            passthrough_queue_cap=cfg.limits.queue_cap,
        )
        if self.online is not None:
            self.limiter.add_listener(self.online.recorder)
        self.metrics = SidecarMetrics(lambda: self.limiter, time_unit=cfg.classifier.time_unit)
        if self.online is not None:
            self.metrics.registry.register(OnlineCollector(self.online))
        if self.uplink.name != "fair":  # srpt/srrt/app: per-band bytes, flows, priority changes
            self.metrics.registry.register(UplinkCollector(self.uplink))
        self.fetches = fetch_counter(self.metrics.registry)
        for result, n in self.fetch_counts.items():
            self.fetches.labels(result).inc(n)
        self.pool = UpstreamPool(*self.apache)
        self.gateway = Gateway(
            table, self.limiter, self.classifier, self.pool, self.uplink, self.metrics,
            admin=self.admin, phase_header=options.phase_header,
        )
        self._watch: asyncio.Task[None] | None = None
        self._poll: asyncio.Task[None] | None = None
        self._file_sig = self._signature()

    @property
    def policy(self) -> SpawnPolicy:
        return self.limiter.policy

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            await self.gateway.start(*self.listen)
        except OSError as exc:
            raise SidecarInputError(
                f"listen: cannot listen on {self.options.listen} ({exc.strerror}); choose a free port"
            ) from None
        self._watch = asyncio.create_task(self._watch_file())
        if self.options.policy_url:
            self._poll = asyncio.create_task(self._poll_policy())
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self._reload("sighup")))
        except (NotImplementedError, RuntimeError, ValueError):
            pass
        if self.online is not None:
            self.online.start()
        await self.scrape_apache()
        st = self.metrics.apache.status
        if st is not None:
            workers = int(st.get("BusyWorkers", 0)) + int(st.get("IdleWorkers", 0))
            if workers < self.table.config.limits.max_inflight:
                log.warning("Apache has fewer workers than the sidecar's hard cap", extra={
                    "event": "config_warning", "detail": f"limits.max_inflight = {self.table.config.limits.max_inflight} "
                    f"but Apache has {workers} workers (MaxRequestWorkers): excess admitted requests wait inside "
                    "Apache; lower limits.max_inflight or start Apache with --max-workers >= it"})
        else:
            log.warning("Apache not reachable at start", extra={"event": "config_warning", "detail": self.options.apache})
        log.info("sidecar listening", extra={
            "event": "start", "listen": self.options.listen, "apache": self.options.apache,
            "policy": self.policy.name, "hash": self.policy.hash, "version": self.policy.version,
        })

    async def close(self) -> None:
        if self.online is not None:
            await self.online.close()
        for task in (self._watch, self._poll):
            if task is not None:
                task.cancel()
        await self.gateway.close()

    # ---- policy swap -----------------------------------------------------------------------
    def swap(self, spec: str, *, source: str) -> SpawnPolicy:
        """Load ``spec`` and install it atomically; on any error keep the old policy and raise."""
        try:
            new = load_policy(spec, self.table.names)
        except (PolicyLoadError, SidecarInputError) as exc:
            self.metrics.refused += 1
            log.error("policy refused, old policy kept", extra={
                "event": "policy_refused", "source": source, "detail": str(exc), "policy": self.policy.name,
            })
            raise
        old = self.policy
        self.limiter.swap(new)
        self.metrics.swaps += 1
        self.swapped_at = time.time()
        log.info("policy swapped", extra={
            "event": "policy_swap", "source": source, "policy": new.name, "hash": new.hash,
            "version": new.version, "detail": f"from {old.name} ({old.hash})",
        })
        return new

    def _signature(self) -> tuple[float, int] | None:
        p = Path(self.policy_source)
        try:
            st = p.stat()
        except OSError:
            return None
        return (st.st_mtime, st.st_size)

    async def _reload(self, source: str) -> None:
        if Path(self.policy_source).is_file():
            try:
                self.swap(self.policy_source, source=source)
            except (PolicyLoadError, SidecarInputError):
                pass

    async def _watch_file(self) -> None:
        while True:
            await asyncio.sleep(self.options.watch_interval)
            sig = self._signature()
            if sig is not None and sig != self._file_sig:
                self._file_sig = sig
                await self._reload("file_watch")

    # ---- policy from the REST API (--policy-url) ------------------------------------------
    def _count(self, result: str) -> None:
        self.fetch_counts[result] += 1
        if hasattr(self, "fetches"):
            self.fetches.labels(result).inc()

    def _initial_fetch(self, table: StageTable) -> SpawnPolicy | None:
        """First download (blocking, before listening). Without a fallback ``--policy`` a failure is fatal."""
        assert self.options.policy_url
        if not self.options.policy_poll > 0:
            raise SidecarInputError(f"policy-poll: must be > 0 seconds, got {self.options.policy_poll}")
        self.fetcher = PolicyFetcher(self.options.policy_url, token=self.options.policy_token)
        try:
            dl = self.fetcher.fetch(None)
            if dl is None:
                raise PolicyFetchError(f"GET {self.fetcher.url}: 304 without If-None-Match")
        except PolicyFetchError as exc:
            self._count("error")
            self.fetch_error = str(exc)
            if not self.options.policy:
                raise SidecarInputError(f"policy-url: {exc}; start the API, fix the URL or give --policy as a fallback") from None
            log.warning("policy URL unreachable, using --policy", extra={"event": "policy_fetch_error", "detail": str(exc)})
            return None
        try:
            pol = load_policy(str(dl.path), table.names)
        except PolicyLoadError as exc:
            self._count("refused")
            self.fetch_error = f"refused: {exc}"
            if not self.options.policy:
                raise PolicyLoadError(f"policy-url: {self.fetcher.url} did not give a usable policy ({exc})") from None
            return None
        finally:
            dl.cleanup()
        self._count("updated")
        self.policy_etag = dl.etag
        return pol

    async def refresh_policy(self, source: str) -> bool:
        """One conditional GET of the policy URL; True when a new policy was installed.

        Raises :class:`PolicyFetchError` (API down, HTTP error) or :class:`PolicyLoadError` (bad
        download); the running policy is kept in both cases.
        """
        async with self._fetch_lock:
            fetcher = self.fetcher
            if fetcher is None:
                return False
            try:
                dl = await asyncio.to_thread(fetcher.fetch, self.policy_etag)
            except PolicyFetchError as exc:
                self._count("error")
                self.fetch_error = str(exc)
                log.warning("policy fetch failed, old policy kept", extra={
                    "event": "policy_fetch_error", "source": source, "detail": str(exc), "policy": self.policy.name})
                raise
            if dl is None:
                self._count("not_modified")
                self.fetch_error = None
                return False
            try:
                self.swap(str(dl.path), source=source)
            except (PolicyLoadError, SidecarInputError) as exc:
                self._count("refused")
                self.fetch_error = f"refused: {exc}"
                raise
            finally:
                dl.cleanup()
            self._count("updated")
            self.policy_etag = dl.etag
            self.fetch_error = None
            self.policy_source = fetcher.url
            return True

    async def _poll_policy(self) -> None:
        while True:
            await asyncio.sleep(self.options.policy_poll)
            try:
                await self.refresh_policy("policy_poll")
            except (PolicyFetchError, PolicyLoadError, SidecarInputError):
                pass  # counted and logged; retry at the next poll

    async def _put_policy_url(self, url: str) -> tuple[int, bytes, bytes]:
        """``PUT /-/policy`` with a URL: fetch it now and, if it installs, follow it from then on."""
        try:
            new = PolicyFetcher(url, token=self.options.policy_token)
        except SidecarInputError as exc:
            return 422, b"text/plain", (f"refused, old policy kept: {exc}\n").encode()
        old_fetcher, old_etag = self.fetcher, self.policy_etag
        self.fetcher, self.policy_etag = new, None
        try:
            await self.refresh_policy("admin_url")
        except (PolicyFetchError, PolicyLoadError, SidecarInputError) as exc:
            self.fetcher, self.policy_etag = old_fetcher, old_etag
            return 422, b"text/plain", (f"refused, old policy kept: {exc}\n").encode()
        if self._poll is None:
            self._poll = asyncio.create_task(self._poll_policy())
        return 200, b"application/json", _json(self.policy_info())

    def policy_info(self) -> dict[str, Any]:
        p = self.policy
        return {
            "name": p.name, "version": p.version, "hash": p.hash, "phases": list(p.phases),
            "per_phase_queues": p.per_phase_queues, "predicted_response_time_model_units": p.predicted_wait,
            "swapped_at": self.swapped_at, "swaps": self.metrics.swaps, "refused": self.metrics.refused,
            "classifier": self.classifier.mode, "source": self.policy_source,
            "policy_url": self.fetcher.url if self.fetcher else None, "etag": self.policy_etag,
            "fetches": dict(self.fetch_counts), "fetch_error": self.fetch_error,
            **({"online": self.online.status()} if self.online is not None else {}),
        }

    # ---- admin -----------------------------------------------------------------------------
    async def scrape_apache(self) -> None:
        host, port = self.apache
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
            self.metrics.apache.status = parse_status(body.decode("latin-1"))
        except (OSError, TimeoutError, ValueError):
            self.metrics.apache.status = None
            self.metrics.apache.scrape_failures += 1

    async def admin(self, method: bytes, path: bytes, body: bytes, peer: str) -> tuple[int, bytes, bytes]:
        """``/-/<path>`` handler: (status, content type, body)."""
        if path in (b"/metrics", b"/metrics/"):
            await self.scrape_apache()
            return 200, b"text/plain; version=0.0.4; charset=utf-8", generate_latest(self.metrics.registry)
        if path == b"/healthz":
            return 200, b"text/plain", b"ok\n"
        if path == b"/policy":
            if method == b"GET":
                return 200, b"application/json", _json(self.policy_info())
            if method == b"PUT":
                if not self.options.admin_put or peer not in ("127.0.0.1", "::1"):
                    return 403, b"text/plain", b"PUT /-/policy: only loopback clients may swap the policy\n"
                if body.strip().startswith((b"http://", b"https://")):
                    return await self._put_policy_url(body.decode("utf-8", errors="replace").strip())
                return self._put_policy(body)
            return 405, b"text/plain", b"/-/policy: use GET or PUT\n"
        return 404, b"text/plain", b"admin paths: /-/metrics, /-/policy, /-/healthz\n"

    def _put_policy(self, body: bytes) -> tuple[int, bytes, bytes]:
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
                return 400, b"text/plain", b"PUT /-/policy: body must be pi(k), pi(k1,...,kN), passthrough, a policy file path or .npz bytes\n"
        try:
            self.swap(spec, source="admin")
        except (PolicyLoadError, SidecarInputError) as exc:
            return 422, b"text/plain", (f"refused, old policy kept: {exc}\n").encode()
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        # an explicit policy replaces the API's: stop following --policy-url
        self.fetcher, self.policy_etag, self.fetch_error = None, None, None
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


def configure_logging(level: int = logging.INFO) -> None:
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter())
    lg = logging.getLogger("overtake")
    lg.handlers[:] = [h]
    lg.setLevel(level)
    lg.propagate = False
