"""The sidecar's access log: one line per request, as JSON or in Apache's combined format.

The gateway fills a :class:`RequestRecord` while it answers a request and hands it to the
callback given as ``on_request`` (:class:`RequestLog.write`) when the answer has been written.
Beyond what Apache logs, each line carries what only the sidecar knows: the stage the request was
routed to, its start phase, the time it waited in the sidecar's queue for the policy to start a
thread (van der Weij et al., "Dynamic thread assignment" §4.2: the waiting requests of the
MDP's state) and the time Apache took from admission to its whole response.

``json``: one object per line with the keys ``ts``, ``peer``, ``method``, ``target``,
``version``, ``status``, ``bytes``, ``duration``, ``stage``, ``phase``, ``queue_wait``,
``upstream``, ``host``, ``referer``, ``user_agent`` (times in seconds; ``null`` where unknown).

``combined``: Apache's ``"%h %l %u %t \\"%r\\" %>s %b \\"%{Referer}i\\" \\"%{User-agent}i\\""``
followed by ``stage=S phase=P queue_wait=S upstream=S duration=S`` (``-`` where unknown), so
Apache's tools read the first nine fields unchanged.

The file is opened in append mode and reopened by :meth:`RequestLog.reopen` (``SIGHUP``, after
logrotate moved it); ``-`` writes to stdout.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Literal, TextIO

from overtake.controller.errors import SidecarInputError

__all__ = ["LOG_FORMATS", "RequestLog", "RequestRecord"]

LogFormat = Literal["json", "combined"]
LOG_FORMATS: tuple[LogFormat, ...] = ("json", "combined")


@dataclass
class RequestRecord:
    """What the gateway learned about one request (filled as it goes)."""

    start: float  #: wall-clock arrival (epoch seconds)
    t0: float  #: monotonic arrival
    peer: str
    method: str
    target: str
    version: str
    host: str | None = None
    referer: str | None = None
    user_agent: str | None = None
    status: int = 0  #: 0: no answer was written (the client went away)
    bytes: int | None = None  #: response body bytes, when known
    stage: str = "-"  #: stage name, "passthrough" or "admin"
    phase: int | None = None  #: start phase, 1-based
    queue_wait: float | None = None  #: seconds queued in the sidecar before admission
    upstream: float | None = None  #: seconds from admission to Apache's whole response


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.6f}"


def _q(text: str | None) -> str:
    if text is None:
        return "-"
    return text.replace("\\", "\\\\").replace('"', '\\"')


class RequestLog:
    """Writes :class:`RequestRecord` lines to ``path`` (``-``: stdout) in ``fmt``."""

    def __init__(self, path: str, fmt: str = "json") -> None:
        if fmt not in LOG_FORMATS:
            raise SidecarInputError(f"request_log_format: expected json or combined, got {fmt!r}")
        self.path = path
        self.fmt = fmt
        self._out: TextIO = self._open()

    def _open(self) -> TextIO:
        if self.path == "-":
            return sys.stdout
        try:
            return open(self.path, "a", buffering=1, encoding="utf-8")
        except OSError as exc:
            raise SidecarInputError(f"request_log: cannot open {self.path} ({exc.strerror}); "
                                    "give a writable file or - for stdout") from None

    def reopen(self) -> None:
        """Open the file again (after logrotate renamed it)."""
        old = self._out
        self._out = self._open()
        if old is not sys.stdout:
            old.close()

    def close(self) -> None:
        if self._out is not sys.stdout:
            self._out.close()

    def line(self, rec: RequestRecord) -> str:
        duration = time.monotonic() - rec.t0
        if self.fmt == "json":
            return json.dumps({
                "ts": round(rec.start, 6), "peer": rec.peer, "method": rec.method, "target": rec.target,
                "version": rec.version, "status": rec.status, "bytes": rec.bytes, "duration": round(duration, 6),
                "stage": rec.stage, "phase": rec.phase,
                "queue_wait": None if rec.queue_wait is None else round(rec.queue_wait, 6),
                "upstream": None if rec.upstream is None else round(rec.upstream, 6),
                "host": rec.host, "referer": rec.referer, "user_agent": rec.user_agent,
            }, sort_keys=True)
        when = time.strftime("%d/%b/%Y:%H:%M:%S %z", time.localtime(rec.start))
        return (f'{rec.peer} - - [{when}] "{_q(rec.method)} {_q(rec.target)} HTTP/{rec.version}" '
                f'{rec.status or "-"} {rec.bytes if rec.bytes else "-"} "{_q(rec.referer)}" "{_q(rec.user_agent)}" '
                f'stage={rec.stage} phase={rec.phase or "-"} queue_wait={_num(rec.queue_wait)} '
                f'upstream={_num(rec.upstream)} duration={_num(duration)}')

    def write(self, rec: RequestRecord) -> None:
        """One line for ``rec``; a full disk is not the request's problem (the line is dropped)."""
        try:
            self._out.write(self.line(rec) + "\n")
        except (OSError, ValueError):
            pass
