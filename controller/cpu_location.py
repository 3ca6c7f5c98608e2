"""Where the server's CPU runs: in Apache's processes, or in PHP-FPM's workers.

mod_overtake_prio changes the priority of Apache's worker threads. Behind PHP-FPM
(``proxy_fcgi``) those threads only wait for FPM, whose workers burn the CPU: the module then
demotes nothing, yet a sidecar told ``--cpu-priority age`` would go on predicting its gain. So the
sidecar samples, from ``/proc``, the CPU used by the host's Apache and PHP-FPM processes (their
own and their reaped children's), exports it, and says once, as a warning, when most of it runs
in PHP-FPM while the module does the CPU priority: the ``overtake_prio`` PHP extension is what
reaches there. Per stage (module mode's ``OvertakeStage``), the module counts by which handler
served each request (:func:`stage_stacks`): :class:`StackWatch` says where each stage's work runs
and which lever reaches it, and warns where the CPU priority in use cannot.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["GROUPS", "PLACES", "CpuLocation", "StackWatch", "StageStack", "cpu_by_group", "stage_stacks"]

log = logging.getLogger("overtake.sidecar")

#: process name (``/proc/PID/comm``) prefixes of each group
GROUPS: Mapping[str, tuple[str, ...]] = {"apache": ("apache2", "httpd"), "php-fpm": ("php-fpm",)}


def cpu_by_group(proc: Path = Path("/proc")) -> dict[str, float]:
    """CPU seconds (user + system, own and reaped children's) of each group's processes now."""
    tick = os.sysconf("SC_CLK_TCK")
    out = dict.fromkeys(GROUPS, 0.0)
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        comm = stat[stat.find("(") + 1: stat.rfind(")")]
        group = next((g for g, names in GROUPS.items() if comm.startswith(names)), None)
        if group is None:
            continue
        f = stat.rsplit(")", 1)[1].split()
        out[group] += sum(int(x) for x in f[11:15]) / tick  # utime stime cutime cstime
    return out


class CpuLocation(Collector):
    """The per-group CPU counters, and the check of the CPU priority in use against them.

    Parameters
    ----------
    cpu_priority
        The sidecar's ``cpu_priority`` (``off``, ``age``, ``class``): which CPU priority it relies on.
    php_extension
        The ``overtake_prio`` PHP extension's counters are read (``php_stats_file``).
    min_cpu
        CPU seconds, both groups together since the first sample, before the check speaks.
    share
        PHP-FPM's share of that CPU above which the module is said not to reach the work.
    """

    def __init__(self, cpu_priority: str, *, php_extension: bool = False, min_cpu: float = 5.0, share: float = 0.5,
                 proc: Path = Path("/proc")) -> None:
        self.cpu_priority, self.php_extension = cpu_priority, php_extension
        self.min_cpu, self.share = min_cpu, share
        self.proc = proc
        self._lock = threading.Lock()
        self._first: dict[str, float] | None = None
        self.last: dict[str, float] = dict.fromkeys(GROUPS, 0.0)
        #: None until enough CPU was seen; then whether the module reaches most of it
        self.module_reaches: bool | None = None

    def sample(self) -> dict[str, float]:
        """Read ``/proc`` and update the check; the counters now."""
        now = cpu_by_group(self.proc)
        with self._lock:
            if self._first is None:
                self._first = now
            self.last = now
            used = {g: max(now[g] - self._first[g], 0.0) for g in GROUPS}
            total = sum(used.values())
            if total >= self.min_cpu:
                reaches = used["php-fpm"] <= self.share * total
                if reaches != self.module_reaches:
                    self._say(reaches, used)
                self.module_reaches = reaches
        return now

    def _say(self, reaches: bool, used: dict[str, float]) -> None:
        if self.cpu_priority == "off" or reaches:
            return
        fix = ("the overtake_prio PHP extension's counters are exported (php_stats_file): it acts there"
               if self.php_extension else "load the overtake_prio PHP extension into PHP-FPM (docs/howto/php-sites.md) "
               "and give the sidecar its php_stats_file")
        log.warning(f"cpu_priority {self.cpu_priority}: mod_overtake_prio cannot reach most of the CPU: PHP-FPM used "
                    f"{used['php-fpm']:.1f} s against Apache's {used['apache']:.1f} s; {fix}",
                    extra={"event": "cpu_priority_unreachable"})

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        now = self.sample()
        c = CounterMetricFamily("overtake_server_cpu_seconds", "CPU of this host's Apache and PHP-FPM "
                                "processes (user + system, reaped children included)", labels=["process"])
        for group, seconds in now.items():
            c.add_metric([group], seconds)
        yield c
        if self.cpu_priority != "off" and self.module_reaches is not None:
            yield GaugeMetricFamily("overtake_cpu_priority_module_reaches", "1 while most of the server's CPU "
                                    "runs in Apache's processes, where mod_overtake_prio acts; 0 when it runs in "
                                    "PHP-FPM", value=float(self.module_reaches))


# ---- per stage: where its work runs (mod_overtake_prio's overtake_stage_served_total) ----------

#: where the work of a request served by each kind of handler runs
PLACES: Mapping[str, str] = {"apache": "Apache (a handler in its own process)", "fcgi": "a FastCGI server (PHP-FPM)",
                             "proxy": "another server behind a proxy", "cgi": "a CGI process"}


@dataclass(frozen=True)
class StageStack:
    """Where a stage's work runs and what can change its CPU priority there."""

    runs_in: str | None  #: apache, fcgi, proxy or cgi (most of its requests); None: none logged yet
    served: dict[str, int]  #: requests logged by where they ran (since Apache started)
    lever: str  #: what reaches that CPU: mod_overtake_prio, the overtake_prio PHP extension, or none

    def said(self) -> str:
        if self.runs_in is None:
            return "not known yet (no request of the stage ended)"
        return f"runs in {PLACES[self.runs_in]}; CPU priority there: {self.lever}"


def _lever(runs_in: str | None, php_extension: bool) -> str:
    if runs_in == "apache":
        return "mod_overtake_prio (age priority of Apache's worker threads)"
    if runs_in == "fcgi" and php_extension:
        return "the overtake_prio PHP extension (php_stats_file)"
    if runs_in is None:
        return "unknown"
    return "none (mod_overtake_prio demotes Apache's threads, which only wait there)"


def stage_stacks(families: Iterable[Metric], *, php_extension: bool) -> dict[str, StageStack]:
    """Per stage of the module's ``OvertakeStage`` sections, from its last scraped counters."""
    served: dict[str, dict[str, int]] = {}
    for fam in families:
        if fam.name != "overtake_stage_served":
            continue
        for s in fam.samples:
            if s.name.endswith("_total") and "stage" in s.labels and "by" in s.labels:
                served.setdefault(s.labels["stage"], {})[s.labels["by"]] = int(s.value)
    out = {}
    for stage, by in served.items():
        runs_in = max(by, key=lambda k: by[k]) if any(by.values()) else None
        out[stage] = StageStack(runs_in, by, _lever(runs_in, php_extension))
    return out


class StackWatch:
    """Says, once per change, where each stage's work runs and which lever reaches it; warns when
    the CPU priority in use cannot reach a stage (so no gain is claimed there)."""

    def __init__(self, cpu_priority: str, *, php_extension: bool) -> None:
        self.cpu_priority, self.php_extension = cpu_priority, php_extension
        self.stacks: dict[str, StageStack] = {}

    def update(self, families: Iterable[Metric]) -> dict[str, StageStack]:
        new = stage_stacks(families, php_extension=self.php_extension)
        for stage, st in new.items():
            old = self.stacks.get(stage)
            if old is not None and (old.runs_in, old.lever) == (st.runs_in, st.lever):
                continue
            if st.runs_in is None:
                continue
            log.info(f"stage {stage}: {st.said()}", extra={"event": "stage_stack", "detail": {
                "stage": stage, "runs_in": st.runs_in, "lever": st.lever, "served": st.served}})
            if self.cpu_priority != "off" and not self.reaches(st):
                log.warning(f"cpu_priority {self.cpu_priority}: stage {stage} runs in {PLACES[st.runs_in]}, where "
                            "mod_overtake_prio cannot change the CPU priority; no gain is claimed for it"
                            + ("; load the overtake_prio PHP extension into PHP-FPM and give php_stats_file"
                               if st.runs_in == "fcgi" else ""),
                            extra={"event": "cpu_priority_unreachable", "detail": {"stage": stage, "runs_in": st.runs_in}})
        self.stacks = new
        return new

    @staticmethod
    def reaches(st: StageStack) -> bool:
        """A CPU lever reaches the stage's work."""
        return st.runs_in == "apache" or st.lever.startswith("the overtake_prio PHP extension")

    def none_reached(self) -> bool:
        """Stages were seen, and no lever reaches any of them."""
        known = [s for s in self.stacks.values() if s.runs_in is not None]
        return bool(known) and not any(self.reaches(s) for s in known)

    def info(self) -> dict[str, Any]:
        """``/-/policy``'s ``stacks``: per stage where its work runs and what reaches it."""
        return {stage: {"runs_in": st.runs_in, "lever": st.lever, "served": st.served}
                for stage, st in self.stacks.items()}
