"""The counters of overtake_prio, the PHP extension that demotes PHP workers by attained CPU.

The extension (``apache-conf/php_overtake_prio``) keeps them in a small file mapped shared by
PHP-FPM's master and workers (``overtake_prio.stats_file``): two header words, then one unsigned
64-bit little-endian counter per field of :class:`PhpPrioCounts`, in that order.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from dataclasses import astuple, dataclass, fields
from pathlib import Path

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from overtake.controller.errors import SidecarInputError

__all__ = ["PhpPrioCollector", "PhpPrioCounts", "read_counts"]

log = logging.getLogger("overtake.sidecar")

_MAGIC = int.from_bytes(b"overtake", "big")
_VERSION = 2


@dataclass(frozen=True)
class PhpPrioCounts:
    """Totals since PHP-FPM started."""

    requests: int  # requests the extension armed its CPU timer for, or exempted
    demoted: int  # requests lowered at the CPU threshold
    exempt: int  # requests never demoted: their method is exempt (they may hold a lock)
    promoted: int  # demoted requests raised back after overtake_prio.max_demoted_ms
    restore_errors: int  # a worker failed to regain its priority (it then stops demoting)
    unreachable: int  # requests not armed: the worker could not have regained its priority
    class_low: int  # requests started at the low level: the sidecar's X-Overtake-Class said 1


_N = len(fields(PhpPrioCounts))
_LAYOUT = struct.Struct(f"<{2 + _N}Q")


def read_counts(path: str | Path) -> PhpPrioCounts | None:
    """The counters in ``path``; None while the file does not exist (PHP-FPM not started yet).

    Raises
    ------
    SidecarInputError
        The file is not overtake_prio's (wrong size, magic or version), naming the setting to fix.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    if len(data) < _LAYOUT.size:
        raise SidecarInputError(f"{path}: {len(data)} bytes, not overtake_prio's stats file ({_LAYOUT.size} bytes); "
                                "point overtake_prio.stats_file and the sidecar's php_stats_file at the same new path")
    magic, version, *counts = _LAYOUT.unpack_from(data)
    if magic != _MAGIC or version != _VERSION:
        raise SidecarInputError(f"{path}: not overtake_prio's stats file (magic {magic:#x}, version {version}); "
                                "point overtake_prio.stats_file and the sidecar's php_stats_file at the same new path")
    return PhpPrioCounts(*counts)


#: metric name and help per counter, in :class:`PhpPrioCounts`' order
_METRICS = (
    ("overtake_php_requests", "PHP requests the overtake_prio extension armed its CPU timer for, or exempted"),
    ("overtake_php_demotions", "PHP requests demoted at overtake_prio.threshold_ms of CPU"),
    ("overtake_php_exempt_requests", "PHP requests never demoted: their method is in overtake_prio.exempt_methods"),
    ("overtake_php_promotions", "demoted PHP requests raised back after overtake_prio.max_demoted_ms"),
    ("overtake_php_restore_errors", "PHP workers that failed to regain their priority (they stop demoting)"),
    ("overtake_php_unreachable_requests", "PHP requests not armed: the worker could not regain its priority "
     "(see docs/howto/php-sites.md)"),
    ("overtake_php_class_low_requests", "PHP requests started at the low level: the sidecar's size class "
     "(X-Overtake-Class: 1, overtake_prio.class_header)"),
)


class PhpPrioCollector(Collector):
    """Exports the extension's counters at each scrape (a 72-byte read); nothing while the file
    is absent, and one warning when it is not the extension's."""

    def __init__(self, path: str | Path) -> None:
        self.path = path
        self._warned = False

    def collect(self) -> Iterator[CounterMetricFamily]:
        try:
            counts = read_counts(self.path)
        except (SidecarInputError, OSError) as exc:
            if not self._warned:
                log.warning("php_stats_file: %s", exc)
                self._warned = True
            return
        if counts is None:
            return
        for (name, text), value in zip(_METRICS, astuple(counts), strict=True):
            yield CounterMetricFamily(name, text, value=value)
