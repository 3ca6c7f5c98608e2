"""The sidecar's options (what ``overtake sidecar`` and its config file set), their bounds, and
which of them a reload may change.

:class:`SidecarOptions` is one frozen record; :mod:`.config` reads a config file into it, the CLI
its flags. :func:`check_numbers` refuses an out-of-range value naming the key and the fix;
:func:`reloaded` keeps, from a re-read config, the values a running sidecar cannot change.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from overtake.controller.errors import SidecarInputError
from overtake.controller.online.settings import OnlineSettings
from overtake.controller.sidecar.admin import DEFAULT_ADMIN_LISTEN
from overtake.controller.sidecar.policies import MAX_ARRAY_BYTES, MAX_INFLATED_BYTES, MAX_POLICY_BYTES
from overtake.controller.sidecar.verify import VerifySettings
from overtake.controller.uplink import bands as _bands

__all__ = ["RELOADABLE", "SidecarOptions", "check_numbers", "parse_addr", "parse_apache_url", "reloaded"]


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
    #: HOST:PORT of the admin listener (/-/metrics, /metrics, /-/policy; the public one answers only
    #: /-/healthz and /-/livez)
    admin_listen: str = DEFAULT_ADMIN_LISTEN
    admin_token: str | None = None  #: bearer token PUT /-/policy must carry (None: writes refused)
    admin_policy_urls: tuple[str, ...] = ()  #: URL prefixes PUT /-/policy may follow (besides policy_url's origin)
    policy_max_bytes: int = MAX_POLICY_BYTES  #: largest policy file or download read
    policy_max_array_bytes: int = MAX_ARRAY_BYTES  #: largest inflated member of a policy archive
    policy_max_inflated_bytes: int = MAX_INFLATED_BYTES  #: all members of one policy archive, inflated
    policy_load_timeout: float = 10.0  #: seconds a policy load may take off the event loop
    status_interval: float = 5.0  #: seconds between scrapes of Apache's mod_status (never per /-/metrics)
    drain_timeout: float = 30.0  #: SIGTERM: seconds to let accepted requests finish
    request_log: str | None = None  #: access log file ("-": stdout), one line per request
    request_log_format: str = "json"  #: json | combined
    #: CIDRs whose phase and class headers are honoured; stripped from everyone else
    trusted_sources: tuple[str, ...] = ("127.0.0.0/8", "::1/128")
    #: mod_overtake_prio in Apache: off | age (export its counters) | class (also set X-Overtake-Class)
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
    #: mod_overtake_prio's OvertakeControlFile: the policy's age thresholds (controller.sidecar.control_file)
    control_file: str | None = None
    #: verify the policy against Apache's default on live traffic (controller.sidecar.verify); None: off
    verify: VerifySettings | None = None
    #: sidecar: requests pass through the proxy; module: mod_overtake_prio enforces the policy's count
    #: table (controller.sidecar.count_table) and no request passes through the sidecar
    enforce: str = "sidecar"


#: options a SIGHUP can change; the others need a restart (sockets, stages, event loop, online loop)
RELOADABLE = frozenset({
    "policy", "policy_url", "policy_poll", "policy_token", "watch_interval", "admin_put", "admin_policy_urls", "admin_token",
    "policy_max_bytes", "policy_max_array_bytes", "policy_max_inflated_bytes", "policy_load_timeout",
    "status_interval", "drain_timeout", "request_log", "request_log_format",
})


def reloaded(old: SidecarOptions, new: SidecarOptions) -> tuple[SidecarOptions, list[str]]:
    """``new`` with the values of ``old`` for every changed option a reload cannot apply, and the
    names of those options (a restart applies them)."""
    fixed = [f.name for f in fields(SidecarOptions)
             if f.name not in RELOADABLE and getattr(new, f.name) != getattr(old, f.name)]
    if not fixed:
        return new, []
    keep = {k: getattr(old, k) for k in fixed}
    return SidecarOptions(**{**{f.name: getattr(new, f.name) for f in fields(SidecarOptions)}, **keep}), fixed


def check_numbers(o: SidecarOptions) -> None:
    """Bounds of the numeric options, each error naming the key and the fix."""
    for key in ("watch_interval", "policy_poll", "policy_load_timeout", "status_interval"):
        v = getattr(o, key)
        if not v > 0:
            raise SidecarInputError(f"{key}: must be > 0 seconds, got {v}")
    if not o.drain_timeout >= 0:
        raise SidecarInputError(f"drain_timeout: must be >= 0 seconds, got {o.drain_timeout}")
    for key in ("policy_max_bytes", "policy_max_array_bytes", "policy_max_inflated_bytes"):
        if not getattr(o, key) > 0:
            raise SidecarInputError(f"{key}: must be > 0 bytes, got {getattr(o, key)}")
    if o.cpu_priority not in ("off", "age", "class"):
        raise SidecarInputError(f"cpu_priority: expected off, age or class, got {o.cpu_priority!r}")
    if o.request_log_format not in ("json", "combined"):
        raise SidecarInputError(f"request_log_format: expected json or combined, got {o.request_log_format!r}")
