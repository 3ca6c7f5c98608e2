"""Assembly of the sidecar: stages, policy, classifier, limiter, gateway, metrics, hot swap.

:class:`Sidecar` builds the pieces from :class:`SidecarOptions` and runs them; the control
endpoints are :mod:`overtake.controller.admin`'s, the policy's sources
:mod:`overtake.controller.policy_source`'s. It owns the running policy. :meth:`Sidecar.swap` loads and validates a new one
(:func:`overtake.controller.policies.load_policy`), and only then installs it with
:meth:`overtake.controller.limiter.Limiter.swap` — one synchronous step on the event loop, so no request
ever sees half a policy; queued requests keep their order. A policy that fails to load or does
not match the stages raises :class:`overtake.controller.errors.PolicyLoadError` and the old policy stays.
Swaps come from ``PUT /-/policy`` (loopback clients), from the policy file changing on disk
(polled every ``watch_interval`` seconds; ``SIGHUP`` forces a reload), from the REST API
(``policy_url``: polled every ``policy_poll`` seconds with the ETag, see :mod:`overtake.controller.policy_fetch`;
``PUT /-/policy`` with an ``http://`` URL follows another model), or from the online loop
(:mod:`overtake.controller.online`).

Logs are JSON lines on stderr (``{"ts":..., "level":..., "event":..., ...}``).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

from overtake.controller.admin import AdminEndpoints
from overtake.controller.classifier import Classifier
from overtake.controller.errors import PolicyLoadError, SidecarInputError
from overtake.controller.gateway import Gateway
from overtake.controller.limiter import Limiter
from overtake.controller.metrics import SidecarMetrics
from overtake.controller.online import OnlineCollector, OnlineLoop, OnlineSettings
from overtake.controller.policies import SpawnPolicy, load_policy
from overtake.controller.policy_source import PolicySource
from overtake.controller.stages import StageTable
from overtake.controller.uplink import bands as _bands
from overtake.controller.uplink import make_uplink
from overtake.controller.uplink.errors import UplinkInputError
from overtake.controller.uplink.metrics import UplinkCollector
from overtake.controller.upstream import UpstreamPool

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
        self.source = PolicySource(table, options, lambda spec, source: self.swap(spec, source=source),
                                   lambda: self.limiter.policy)
        policy = self.source.first
        self.swapped_at = time.time()
        cfg = table.config
        settings = cfg.classifier
        if options.phase_header:
            settings = settings.model_copy(update={"header": options.phase_header})
        self.classifier = Classifier(settings, policy)
        self.limiter = Limiter(
            policy, self.classifier, stage_names=table.names,
            queue_caps=tuple(table.queue_cap(i) for i in range(len(table.names))),
            max_inflight=cfg.limits.max_inflight, passthrough_cap=cfg.passthrough.cap,
            passthrough_queue_cap=cfg.limits.queue_cap,
        )
        self.metrics = SidecarMetrics(lambda: self.limiter, time_unit=cfg.classifier.time_unit)
        self.online: OnlineLoop | None = None
        if options.online is not None:
            self.online = OnlineLoop(
                options.online, table=table, time_unit=cfg.classifier.time_unit, policy=policy,
                current=lambda: self.limiter.policy,
                swap=lambda path: self.swap(path, source="online"), classifier_mode=settings.mode,
            )
            self.limiter.add_listener(self.online.recorder)
            self.metrics.registry.register(OnlineCollector(self.online))
        if self.uplink.name != "fair":  # srpt/srrt/app: per-band bytes, flows, priority changes
            self.metrics.registry.register(UplinkCollector(self.uplink))
        self.source.register(self.metrics.registry)
        self.pool = UpstreamPool(*self.apache)
        self.admin = AdminEndpoints(self)
        self.gateway = Gateway(
            table, self.limiter, self.classifier, self.pool, self.uplink, self.metrics,
            admin=self.admin.handle, phase_header=options.phase_header,
        )

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
        self.source.start()
        if self.online is not None:
            self.online.start()
        await self.admin.scrape_apache()
        self._check_apache()
        log.info("sidecar listening", extra={
            "event": "start", "listen": self.options.listen, "apache": self.options.apache,
            "policy": self.policy.name, "hash": self.policy.hash, "version": self.policy.version,
        })

    def _check_apache(self) -> None:
        """Warn when Apache is unreachable or has fewer workers than the hard cap admits."""
        st = self.metrics.apache.status
        if st is None:
            log.warning("Apache not reachable at start", extra={"event": "config_warning", "detail": self.options.apache})
            return
        workers = int(st.get("BusyWorkers", 0)) + int(st.get("IdleWorkers", 0))
        cap = self.table.config.limits.max_inflight
        if workers < cap:
            log.warning("Apache has fewer workers than the sidecar's hard cap", extra={
                "event": "config_warning", "detail": f"limits.max_inflight = {cap} "
                f"but Apache has {workers} workers (MaxRequestWorkers): excess admitted requests wait inside "
                "Apache; lower limits.max_inflight or start Apache with --max-workers >= it"})

    async def close(self) -> None:
        if self.online is not None:
            await self.online.close()
        self.source.stop()
        await self.gateway.close()

    # ---- the one swap path -----------------------------------------------------------------
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


def configure_logging(level: int = logging.INFO) -> None:
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter())
    lg = logging.getLogger("overtake")
    lg.handlers[:] = [h]
    lg.setLevel(level)
    lg.propagate = False
