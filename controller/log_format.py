"""The Apache access-log format the online loop reads service demands from (``--access-log``).

Apache logs each request with it (``LogFormat``; the private Apache of
:mod:`overtake.controller.harness.apache` renders it into its ``httpd.conf``), and
:class:`overtake.controller.online.estimators.AccessLogTail` parses it back. Logs written with
:data:`LEGACY_LOG_FORMAT` (before the request-time split) still parse: readers try
:data:`LOG_FORMATS` in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LEGACY_LOG_FORMAT", "LOG_FORMAT", "LOG_FORMATS", "TIMES_FORMAT", "LineParser", "RequestTimes",
           "request_times"]

#: ``D`` = microseconds from reading the request line to logging (sojourn in Apache);
#: ``cpu_us`` = thread CPU burnt by the stage handler (``-`` for other URLs);
#: ``begin`` = request start, microseconds since the epoch; ``rid`` = X-Request-Id header.
LEGACY_LOG_FORMAT = (
    '%h %{begin:usec}t "%r" %>s %b D=%D msT=%{ms}T usT=%{us}T '
    "stage=%{stage}n cpu_us=%{stage_cpu_us}n tid=%{tid}P rid=%{X-Request-Id}i"
)
#: mod_overtake_prio's request-time split (``OvertakeRequestTimes On``), microseconds: the handler's
#: wall time, its start after ``begin``, and the thread's CPU, run-queue wait and blocked (off the
#: CPU, not runnable) time in it; ``-`` where the module noted nothing.
TIMES_FORMAT = (
    " owall_us=%{overtake_wall_us}n ostart_us=%{overtake_start_us}n ocpu_us=%{overtake_cpu_us}n"
    " owait_us=%{overtake_wait_us}n oblocked_us=%{overtake_blocked_us}n"
)
LOG_FORMAT = LEGACY_LOG_FORMAT + TIMES_FORMAT
#: the formats a reader accepts, newest first
LOG_FORMATS = (LOG_FORMAT, LEGACY_LOG_FORMAT)


@dataclass(frozen=True)
class RequestTimes:
    """A request's handler time split (mod_overtake_prio's notes), in microseconds."""

    start_us: int  #: handler start after the request's begin
    wall_us: int
    cpu_us: int
    wait_us: int  #: runnable, waiting for a CPU
    blocked_us: int  #: off the CPU and not runnable


_NOTES = ("overtake_start_us", "overtake_wall_us", "overtake_cpu_us", "overtake_wait_us", "overtake_blocked_us")


def request_times(directives: Mapping[str, Any]) -> RequestTimes | None:
    """The split of a parsed line (apachelogs' ``directives``); None when the line has none (an older
    format, a module without ``OvertakeRequestTimes``, a kernel without schedstat, a request that
    ended without a response body's end)."""
    values = []
    for note in _NOTES:
        v = directives.get(f"%{{{note}}}n")
        if v is None or not str(v).isdigit():
            return None
        values.append(int(v))
    return RequestTimes(*values)


class LineParser:
    """Parses an access-log line in any of :data:`LOG_FORMATS` (apachelogs, imported here)."""

    def __init__(self) -> None:
        import apachelogs

        self._parsers = [apachelogs.LogParser(f) for f in LOG_FORMATS]
        self._invalid = apachelogs.InvalidEntryError

    def parse(self, line: str) -> dict[str, Any]:
        """The line's directives; ValueError if no format matches it."""
        for p in self._parsers:
            try:
                return dict(p.parse(line).directives)
            except self._invalid:
                continue
        raise ValueError(f"does not match LOG_FORMAT (nor the older format without the time split): {line[:200]!r}")
