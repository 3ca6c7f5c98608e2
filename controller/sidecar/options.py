"""The sidecar's options (what ``overtake sidecar`` and its config file set), their bounds, and
which of them a reload may change.

:class:`SidecarOptions` is one frozen record of a few typed sub-records (where it listens, the
policy's source, the guards, the uplink, Apache's side, what it records); :mod:`.config` reads a
config file into it, the CLI its flags, both by the config file's flat keys
(:meth:`SidecarOptions.from_flat`). :func:`check_numbers` refuses an out-of-range value naming the key and the fix;
:func:`reloaded` keeps, from a re-read config, the values a running sidecar cannot change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from overtake.controller.errors import SidecarInputError
from overtake.controller.online.settings import OnlineSettings
from overtake.controller.sidecar.admin import DEFAULT_ADMIN_LISTEN
from overtake.controller.sidecar.policies import MAX_ARRAY_BYTES, MAX_INFLATED_BYTES, MAX_POLICY_BYTES
from overtake.controller.sidecar.verify_settings import VerifySettings
from overtake.controller.uplink import bands as _bands

__all__ = ["GROUPS", "KEYS", "RELOADABLE", "ApacheSide", "Endpoints", "Guards", "Observability", "PolicyOptions",
           "SidecarOptions", "UplinkOptions", "check_numbers", "parse_addr", "parse_apache_url", "reloaded"]


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
class Endpoints:
    """Where the sidecar listens and where Apache is."""

    apache: str  #: http://HOST:PORT
    listen: str | None  #: HOST:PORT of the public listener; None in module mode (nothing listens)
    #: HOST:PORT of the admin listener (/-/metrics, /metrics, /-/policy; the public one answers only
    #: /-/healthz and /-/livez)
    admin_listen: str = DEFAULT_ADMIN_LISTEN


@dataclass(frozen=True)
class PolicyOptions:
    """Where the policy comes from and how a policy is loaded."""

    spec: str  #: a file, pi(k) or passthrough (``policy``); only the fallback with ``url`` ("" = none)
    url: str | None = None  #: API artifact URL (``policy_url``)
    poll: float = 10.0  #: seconds between polls of ``url`` (``policy_poll``)
    token: str | None = None  #: bearer token for ``url`` (``policy_token``)
    watch_interval: float = 1.0  #: seconds between looks at the policy file
    max_bytes: int = MAX_POLICY_BYTES  #: largest policy file or download read
    max_array_bytes: int = MAX_ARRAY_BYTES  #: largest inflated member of a policy archive
    max_inflated_bytes: int = MAX_INFLATED_BYTES  #: all members of one policy archive, inflated
    load_timeout: float = 10.0  #: seconds a policy load may take off the event loop


@dataclass(frozen=True)
class Guards:
    """Who may write the policy and who may steer scheduling."""

    admin_put: bool = True
    admin_token: str | None = None  #: bearer token PUT /-/policy must carry (None: writes refused)
    admin_policy_urls: tuple[str, ...] = ()  #: URL prefixes PUT /-/policy may follow (besides policy_url's origin)
    #: CIDRs whose phase and class headers are honoured; stripped from everyone else
    trusted_sources: tuple[str, ...] = ("127.0.0.0/8", "::1/128")


@dataclass(frozen=True)
class UplinkOptions:
    """How response bytes leave (:mod:`overtake.controller.uplink`)."""

    name: str = "fair"  #: fair | srpt | srrt | app (``uplink``)
    cutoffs: str | None = None  #: fixed SRPT/SRRT cutoffs ("1K,4K,16K"); adaptive when None
    top_fraction: float = _bands.TOP_FRACTION  #: adaptive cutoffs: share of responses above the highest
    lowest_writers: int = 0  #: srpt/srrt: lowest-band responses writing at once (0 = one FIFO)
    ordered_bands: int = 1  #: with lowest_writers: the lowest N bands each so ordered


@dataclass(frozen=True)
class ApacheSide:
    """What mod_overtake_prio (and the PHP extension) do inside Apache."""

    #: off | age (export its counters) | class (also set X-Overtake-Class)
    cpu_priority: str = "off"
    #: mod_overtake_prio's admission gate (controller.sidecar.gate): the file both map, or None
    gate: str | None = None
    #: requests the gate may hold inside Apache at once (each holds a worker: keep
    #: MaxRequestWorkers >= limits.max_inflight + gate_slots)
    gate_slots: int = 64
    #: queued gated requests started early at SCHED_IDLE (controller.sidecar.gate: idle starts)
    gate_backfill: int = 1
    #: the overtake_prio PHP extension's counters file (controller.php_prio), exported when given
    php_stats_file: str | None = None
    #: the PHP-FPM pool file behind Apache (controller.sidecar.fpm_pool): its pm.max_children against the policy's cap
    fpm_pool_config: str | None = None
    #: mod_overtake_prio's OvertakeControlFile: the policy's age thresholds (controller.sidecar.control_file)
    control_file: str | None = None


@dataclass(frozen=True)
class Observability:
    """What the sidecar records: the access log and Apache's status."""

    request_log: str | None = None  #: access log file ("-": stdout), one line per request
    request_log_format: str = "json"  #: json | combined
    status_interval: float = 5.0  #: seconds between scrapes of Apache's mod_status (never per /-/metrics)


#: the sub-records of :class:`SidecarOptions` and the config-file key of each of their fields
GROUPS: dict[str, tuple[type, dict[str, str]]] = {
    "endpoints": (Endpoints, {"apache": "apache", "listen": "listen", "admin_listen": "admin_listen"}),
    "policy": (PolicyOptions, {
        "policy": "spec", "policy_url": "url", "policy_poll": "poll", "policy_token": "token",
        "watch_interval": "watch_interval", "policy_max_bytes": "max_bytes", "policy_max_array_bytes": "max_array_bytes",
        "policy_max_inflated_bytes": "max_inflated_bytes", "policy_load_timeout": "load_timeout"}),
    "guards": (Guards, {"admin_put": "admin_put", "admin_token": "admin_token", "admin_policy_urls": "admin_policy_urls",
                        "trusted_sources": "trusted_sources"}),
    "uplink": (UplinkOptions, {"uplink": "name", "uplink_cutoffs": "cutoffs", "uplink_top_fraction": "top_fraction",
                               "uplink_lowest_writers": "lowest_writers", "uplink_ordered_bands": "ordered_bands"}),
    "apache_side": (ApacheSide, {"cpu_priority": "cpu_priority", "gate": "gate", "gate_slots": "gate_slots",
                                 "gate_backfill": "gate_backfill", "php_stats_file": "php_stats_file",
                                 "fpm_pool_config": "fpm_pool_config", "control_file": "control_file"}),
    "observability": (Observability, {"request_log": "request_log", "request_log_format": "request_log_format",
                                      "status_interval": "status_interval"}),
}
#: options outside the sub-records, under their config-file key
_TOP = ("online", "phase_header", "drain_timeout", "verify", "enforce")
#: every option's config-file key, in the order a reload names those it could not apply
KEYS = ("policy", "apache", "listen", "phase_header", "uplink", "uplink_cutoffs", "uplink_top_fraction",
        "uplink_lowest_writers", "uplink_ordered_bands", "watch_interval", "admin_put", "online", "policy_url",
        "policy_poll", "policy_token", "admin_listen", "admin_token", "admin_policy_urls", "policy_max_bytes",
        "policy_max_array_bytes", "policy_max_inflated_bytes", "policy_load_timeout", "status_interval",
        "drain_timeout", "request_log", "request_log_format", "trusted_sources", "cpu_priority", "gate",
        "gate_slots", "gate_backfill", "php_stats_file", "fpm_pool_config", "control_file", "verify", "enforce")


@dataclass(frozen=True)
class SidecarOptions:
    """Command-line level options, grouped by concept; :meth:`from_flat` builds them from the
    config file's (and the CLI's) flat keys, :meth:`flat` gives those back."""

    endpoints: Endpoints
    policy: PolicyOptions
    guards: Guards = Guards()
    uplink: UplinkOptions = UplinkOptions()
    apache_side: ApacheSide = ApacheSide()
    observability: Observability = Observability()
    online: OnlineSettings | None = None  #: refit, re-solve and swap online (controller.online)
    phase_header: str | None = None  #: the header that carries a request's phase (default: the stages file's)
    drain_timeout: float = 30.0  #: SIGTERM: seconds to let accepted requests finish
    #: verify the policy against Apache's default on live traffic (controller.sidecar.verify); None: off
    verify: VerifySettings | None = None
    #: sidecar: requests pass through the proxy; module: mod_overtake_prio enforces the policy's count
    #: table (controller.sidecar.count_table) and no request passes through the sidecar
    enforce: str = "sidecar"

    @classmethod
    def from_flat(cls, **keys: Any) -> SidecarOptions:
        """The options of config-file keys (``policy`` and ``apache`` required, and ``listen``
        except in module mode)."""
        unknown = set(keys) - set(_TOP) - {k for _, names in GROUPS.values() for k in names}
        if unknown:
            raise TypeError(f"unknown sidecar options: {sorted(unknown)}")
        groups = {g: kind(**{f: keys[k] for k, f in names.items() if k in keys})
                  for g, (kind, names) in GROUPS.items()}
        return cls(**groups, **{k: keys[k] for k in _TOP if k in keys})

    def flat(self) -> dict[str, Any]:
        """Every option under its config-file key, in :data:`KEYS`' order."""
        out = {k: getattr(self, k) for k in _TOP}
        for g, (_, names) in GROUPS.items():
            sub = getattr(self, g)
            out.update({k: getattr(sub, f) for k, f in names.items()})
        return {k: out[k] for k in KEYS}


#: options a SIGHUP can change; the others need a restart (sockets, stages, event loop, online loop)
RELOADABLE = frozenset({
    "policy", "policy_url", "policy_poll", "policy_token", "watch_interval", "admin_put", "admin_policy_urls", "admin_token",
    "policy_max_bytes", "policy_max_array_bytes", "policy_max_inflated_bytes", "policy_load_timeout",
    "status_interval", "drain_timeout", "request_log", "request_log_format",
})


def reloaded(old: SidecarOptions, new: SidecarOptions) -> tuple[SidecarOptions, list[str]]:
    """``new`` with the values of ``old`` for every changed option a reload cannot apply, and the
    names of those options (a restart applies them)."""
    was, now = old.flat(), new.flat()
    fixed = [k for k in now if k not in RELOADABLE and now[k] != was[k]]
    if not fixed:
        return new, []
    return SidecarOptions.from_flat(**{**now, **{k: was[k] for k in fixed}}), fixed


def with_cpu_priority(o: SidecarOptions, value: str) -> SidecarOptions:
    """``o`` with ``cpu_priority`` set to ``value`` (``auto`` resolved, controller.sidecar.cpu_choice)."""
    return dataclasses.replace(o, apache_side=dataclasses.replace(o.apache_side, cpu_priority=value))


def check_numbers(o: SidecarOptions) -> None:
    """Bounds of the numeric options, each error naming the key and the fix."""
    flat = o.flat()
    for key in ("watch_interval", "policy_poll", "policy_load_timeout", "status_interval"):
        v = flat[key]
        if not v > 0:
            raise SidecarInputError(f"{key}: must be > 0 seconds, got {v}")
    if not o.drain_timeout >= 0:
        raise SidecarInputError(f"drain_timeout: must be >= 0 seconds, got {o.drain_timeout}")
    for key in ("policy_max_bytes", "policy_max_array_bytes", "policy_max_inflated_bytes"):
        if not flat[key] > 0:
            raise SidecarInputError(f"{key}: must be > 0 bytes, got {flat[key]}")
    if flat["cpu_priority"] not in ("off", "auto", "age", "class"):
        raise SidecarInputError(f"cpu_priority: expected off, auto, age or class, got {flat['cpu_priority']!r}")
    if flat["request_log_format"] not in ("json", "combined"):
        raise SidecarInputError(f"request_log_format: expected json or combined, got {flat['request_log_format']!r}")
