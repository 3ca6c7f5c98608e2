"""The counters mod_overtake_prio serves at ``/overtake-prio-status``, parsed and fetched.

One child's view of the module (see ``apache-conf/mod_overtake_prio/op_status.c``): its CPU
levels, demotions and restores, the admission gate and the exemptions.
"""

from __future__ import annotations

import http.client
import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from overtake.controller.errors import ApacheNotRunningError

__all__ = ["STATUS_PATH", "PrioStatus", "fetch_prio_status", "parse_prio_status"]

#: Where the private Apache serves the module's counters (local clients only).
STATUS_PATH = "/overtake-prio-status"


@dataclass(frozen=True)
class PrioStatus:
    """The counters of ``/overtake-prio-status`` (one child's view; see the C module).

    Level 0 is the original priority. Tuples indexed by level have ``levels + 1`` entries
    (index 0 is always 0 for the demotion counts).

    Attributes
    ----------
    enabled : bool
        The answering child demotes and restores (its self-test passed).
    levels : int
        Demoted levels.
    thresholds : tuple of float
        Thread CPU (s) at which level 1, 2, ... starts.
    in_flight : tuple of int
        Requests in flight in the answering child, by current level.
    requests : tuple of int
        Requests ended, by deepest level reached (all children, since start).
    demotions_age, demotions_class : tuple of int
        Entries into each level by attained CPU or by the class header.
    restores, restore_errors, demote_errors, untracked, class_invalid, handoffs : int
        Cumulative counters (all children).
    monitor_ticks : int
        Monitor passes (all children).
    clock_reads : int
        Thread CPU clock reads at request start (all children): at most one per request and
        per ``cpu_resolution`` of a thread's time.
    cpu_resolution : float
        ``OvertakePrioCpuResolution`` in effect, seconds.
    monitor_late_max : float
        Worst delay of a monitor pass in the answering child, seconds.
    monitor_late_buckets : tuple of (float, int)
        Cumulative histogram of the answering child's monitor pass delays: (upper bound
        in seconds, count), the last bound ``inf``.
    monitor_late_sum : float
        Sum of those delays, seconds.
    rlimit_nice : int
        RLIMIT_NICE of the answering child.
    child_pid : int
        PID of the answering child.
    gate_mapped : bool
        The answering child has mapped the ``OvertakeGate`` file.
    gate_token : int
        Pairing token in that file (the sidecar's; 0 when none is mapped).
    gate_key_loaded : bool
        Apache read the gate's key file (``OvertakeGate`` path + ``.key``) at start.
    gate_held, gate_cancels, gate_stale, gate_timeouts, gate_aborts, gate_invalid, gate_forged, gate_unmapped : int
        Gated requests (all children): let through on admission, withdrawn, stale, let
        through after ``OvertakeGateTimeout``, connection closed while held, bad header, a
        MAC not of the key (403), no usable file.
    gate_faults : int
        Loads that found the gate file shrunk under its mapping (truncated): the requests held
        there were let through.
    gate_wait_s : float
        Total time gated requests waited for their admission, seconds.
    gate_idle_starts, gate_promotions : int
        Gated requests started at the lowest level before their admission, and those given
        their priority back on it.
    exempt_method, exempt_path, exempt_header : int
        Requests never demoted (they may hold a lock), by the rule that exempted them.
    limit_releases : int
        Demoted requests given their priority back by ``OvertakePrioDemotionLimit``.
    demotion_limit : float
        That limit, seconds (0: none).
    """

    enabled: bool
    levels: int
    thresholds: tuple[float, ...]
    in_flight: tuple[int, ...]
    requests: tuple[int, ...]
    demotions_age: tuple[int, ...]
    demotions_class: tuple[int, ...]
    restores: int
    restore_errors: int
    demote_errors: int
    untracked: int
    class_invalid: int
    handoffs: int
    monitor_ticks: int
    clock_reads: int
    cpu_resolution: float
    monitor_late_max: float
    monitor_late_buckets: tuple[tuple[float, int], ...]
    monitor_late_sum: float
    rlimit_nice: int
    child_pid: int
    gate_mapped: bool = False
    gate_token: int = 0
    gate_key_loaded: bool = False
    gate_held: int = 0
    gate_cancels: int = 0
    gate_stale: int = 0
    gate_timeouts: int = 0
    gate_aborts: int = 0
    gate_invalid: int = 0
    gate_forged: int = 0
    gate_unmapped: int = 0
    gate_faults: int = 0
    gate_wait_s: float = 0.0
    gate_idle_starts: int = 0
    gate_promotions: int = 0
    exempt_method: int = 0
    exempt_path: int = 0
    exempt_header: int = 0
    limit_releases: int = 0
    demotion_limit: float = 0.0


def parse_prio_status(text: str) -> PrioStatus:
    """Parse the Prometheus text of ``/overtake-prio-status``.

    Raises :class:`ApacheNotRunningError` if ``text`` lacks the module's metrics.
    """
    plain: dict[str, float] = {}
    by_level: dict[str, dict[int, float]] = {}
    late: list[tuple[float, int]] = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name.removeprefix("overtake_cpu_prio_")
            if name == "monitor_late_seconds_bucket":
                late.append((float(s.labels["le"]), int(s.value)))
                continue
            if "cause" in s.labels:
                name = f"{name}:{s.labels['cause']}"
            if "level" in s.labels:
                by_level.setdefault(name, {})[int(s.labels["level"])] = s.value
            else:
                plain[name] = s.value
    if "levels" not in plain or "enabled" not in plain:
        raise ApacheNotRunningError(
            f"{STATUS_PATH}: no overtake_cpu_prio_levels/enabled metrics; is mod_overtake_prio "
            "loaded (start(cpu_priority=...))?"
        )
    n = int(plain["levels"])

    def per_level(name: str) -> tuple[int, ...]:
        got = by_level.get(name, {})
        return tuple(int(got.get(k, 0)) for k in range(n + 1))

    return PrioStatus(
        enabled=plain["enabled"] == 1,
        levels=n,
        thresholds=tuple(
            by_level.get("level_threshold_seconds", {}).get(k, math.nan) for k in range(1, n + 1)
        ),
        in_flight=per_level("in_flight"),
        requests=per_level("requests_total"),
        demotions_age=per_level("demotions_total:age"),
        demotions_class=per_level("demotions_total:class"),
        restores=int(plain.get("restores_total", 0)),
        restore_errors=int(plain.get("restore_errors_total", 0)),
        demote_errors=int(plain.get("demote_errors_total", 0)),
        untracked=int(plain.get("untracked_total", 0)),
        class_invalid=int(plain.get("class_invalid_total", 0)),
        handoffs=int(plain.get("handoffs_total", 0)),
        monitor_ticks=int(plain.get("monitor_ticks_total", 0)),
        clock_reads=int(plain.get("clock_reads_total", 0)),
        cpu_resolution=float(plain.get("cpu_resolution_seconds", math.nan)),
        monitor_late_max=float(plain.get("monitor_late_max_seconds", math.nan)),
        monitor_late_buckets=tuple(sorted(late)),
        monitor_late_sum=float(plain.get("monitor_late_seconds_sum", 0.0)),
        rlimit_nice=int(plain.get("rlimit_nice", -1)),
        child_pid=int(plain.get("child_pid", 0)),
        gate_mapped=plain.get("overtake_gate_mapped", 0) == 1,
        gate_token=int(plain.get("overtake_gate_token", 0)),
        gate_key_loaded=plain.get("overtake_gate_key_loaded", 0) == 1,
        **{f"gate_{k}": int(plain.get(f"overtake_gate_{k}_total", 0))
           for k in ("held", "cancels", "stale", "timeouts", "aborts", "invalid", "forged", "unmapped", "faults",
                     "idle_starts", "promotions")},
        gate_wait_s=float(plain.get("overtake_gate_wait_seconds_total", 0.0)),
        **{f"exempt_{k}": int(plain.get(f"exempt_total:{k}", 0)) for k in ("method", "path", "header")},
        limit_releases=int(plain.get("limit_releases_total", 0)),
        demotion_limit=float(plain.get("demotion_limit_seconds", 0.0)),
    )


def fetch_prio_status(host: str, port: int, *, timeout: float = 2.0) -> PrioStatus:
    """GET and parse ``/overtake-prio-status``.

    Parameters
    ----------
    host : str
        Address to connect to (loopback: the location is local-only).
    port : int
        Apache's port.
    timeout : float
        Socket timeout, seconds.

    Returns
    -------
    PrioStatus

    Raises
    ------
    ApacheNotRunningError
        Nothing answers, the answer is not 200 or lacks the module's metrics.
    """
    # Its own GET, not mod_status.http_get: config imports cpu_priority (and so this module), mod_status imports config.
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", STATUS_PATH)
        resp = conn.getresponse()
        code, body = resp.status, resp.read().decode("utf-8", errors="replace")
    except OSError as exc:
        raise ApacheNotRunningError(f"{STATUS_PATH}: no answer from {host}:{port} ({exc})") from None
    finally:
        conn.close()
    if code != 200:
        raise ApacheNotRunningError(
            f"{STATUS_PATH}: {host}:{port} answered {code}; is mod_overtake_prio loaded "
            "(start(cpu_priority=...))?"
        )
    return parse_prio_status(body)
