"""The counters of overtake_prio, the PHP extension that demotes PHP workers by attained CPU.

The extension (``apache-conf/php_overtake_prio``) keeps them in a small file mapped shared by
PHP-FPM's master and workers (``overtake_prio.stats_file``): two header words, the totals (one
unsigned 64-bit little-endian counter per field of :class:`PhpPrioCounts`, in that order), the
number of stage rows, then the rows: a state word, a 32-byte NUL-padded stage name and the same
counters for the requests of that stage (the FastCGI parameter ``OVERTAKE_STAGE``, which
mod_overtake_prio's ``OvertakeStage`` sets); the row ``none`` counts requests without a stage. A
worker claims a row at its stage's first request; two workers may claim one each for the same new
stage, so rows are summed by name, and a row whose name is still being written (state 1) is left out.
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

__all__ = ["PhpPrioCollector", "PhpPrioCounts", "read_counts", "read_stage_counts"]

log = logging.getLogger("overtake.sidecar")

_MAGIC = int.from_bytes(b"overtake", "big")
_VERSION = 3
_ROW_READY = 2  # a row whose name is written (0: free, 1: a worker is writing its name)


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
_ROWS = struct.Struct("<Q")  # the number of stage rows, after the totals
_ROW = struct.Struct(f"<Q32s{_N}Q")  # state, name, counters


def _read(path: str | Path) -> bytes | None:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    fix = "point overtake_prio.stats_file and the sidecar's php_stats_file at the same new path"
    if len(data) < _LAYOUT.size + _ROWS.size:
        raise SidecarInputError(f"{path}: {len(data)} bytes, not overtake_prio's stats file (at least "
                                f"{_LAYOUT.size + _ROWS.size} bytes); {fix}")
    magic, version = struct.unpack_from("<2Q", data)
    if magic != _MAGIC or version != _VERSION:
        raise SidecarInputError(f"{path}: not overtake_prio's stats file of this version (magic {magic:#x}, version "
                                f"{version}, expected {_VERSION}); {fix}, with the extension built from this release")
    return data


def read_counts(path: str | Path) -> PhpPrioCounts | None:
    """The totals in ``path``; None while the file does not exist (PHP-FPM not started yet).

    Raises
    ------
    SidecarInputError
        The file is not overtake_prio's (wrong size, magic or version), naming the setting to fix.
    """
    data = _read(path)
    if data is None:
        return None
    return PhpPrioCounts(*_LAYOUT.unpack_from(data)[2:])


def read_stage_counts(path: str | Path) -> dict[str, PhpPrioCounts] | None:
    """The counters per stage in ``path`` (``none``: requests without a stage); None while the file
    does not exist. Their sums are the totals of :func:`read_counts` (up to requests counted
    between the reads of two words).

    Raises
    ------
    SidecarInputError
        As :func:`read_counts`, and when the rows do not fit in the file.
    """
    data = _read(path)
    if data is None:
        return None
    (rows,) = _ROWS.unpack_from(data, _LAYOUT.size)
    end = _LAYOUT.size + _ROWS.size + rows * _ROW.size
    if end > len(data):
        raise SidecarInputError(f"{path}: {rows} stage rows need {end} bytes, the file has {len(data)}; point "
                                "overtake_prio.stats_file and the sidecar's php_stats_file at the same new path")
    out: dict[str, list[int]] = {}
    for i in range(rows):
        state, raw, *counts = _ROW.unpack_from(data, _LAYOUT.size + _ROWS.size + i * _ROW.size)
        if state != _ROW_READY:
            continue
        name = raw.rstrip(b"\0").decode("ascii", "replace")
        acc = out.setdefault(name, [0] * _N)
        for k, v in enumerate(counts):
            acc[k] += v
    return {name: PhpPrioCounts(*c) for name, c in out.items()}


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
    """Exports the extension's counters at each scrape (one read of the file); nothing while the file
    is absent, and one warning when it is not the extension's."""

    def __init__(self, path: str | Path) -> None:
        self.path = path
        self._warned = False

    def collect(self) -> Iterator[CounterMetricFamily]:
        try:
            stages = read_stage_counts(self.path)
        except (SidecarInputError, OSError) as exc:
            if not self._warned:
                log.warning("php_stats_file: %s", exc)
                self._warned = True
            return
        if stages is None:
            return
        for k, (name, text) in enumerate(_METRICS):
            family = CounterMetricFamily(name, text + " (stage: OvertakeStage's, none: without one)", labels=["stage"])
            for stage, counts in sorted(stages.items()):
                family.add_metric([stage], astuple(counts)[k])
            yield family
