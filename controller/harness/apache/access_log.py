"""The access log: one :class:`AccessRecord` per request (format :data:`~.config.LOG_FORMAT`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from overtake.controller.errors import ApacheError
from overtake.controller.harness.apache.instance import existing_workdir
from overtake.controller.log_format import LineParser, RequestTimes, request_times

__all__ = ["AccessRecord", "read_access_log"]


@dataclass(frozen=True)
class AccessRecord:
    """One access-log line (format :data:`LOG_FORMAT`).

    Attributes
    ----------
    begin_us : int
        Request start, microseconds since the epoch.
    method, path, query : str
        From the request line; ``query`` without the ``?``.
    status : int
        Final HTTP status.
    bytes_sent : int
        Response body bytes (0 for none).
    duration_us : int
        ``%D``: reading the request line to logging, microseconds.
    stage : str or None
        Stage number for ``/stage<N>`` requests.
    cpu_us : int or None
        Thread CPU burnt by the stage handler, microseconds.
    tid : int
        Worker thread id (pthread_t, as Apache's ``%{tid}P``).
    request_id : str or None
        ``X-Request-Id`` request header.
    times : RequestTimes or None
        mod_overtake_prio's split of the handler's time (``OvertakeRequestTimes``); None in a log
        of the older format or when the module noted none.
    """

    begin_us: int
    method: str
    path: str
    query: str
    status: int
    bytes_sent: int
    duration_us: int
    stage: str | None
    cpu_us: int | None
    tid: int
    request_id: str | None
    times: RequestTimes | None = None


def read_access_log(workdir: str | os.PathLike[str]) -> list[AccessRecord]:
    """Parse ``WORKDIR/logs/access.log``.

    A last line without its newline (being written) is left out; any other line that does
    not match :data:`LOG_FORMAT` raises.

    Parameters
    ----------
    workdir : path
        Instance directory given to :func:`start`.

    Returns
    -------
    list of AccessRecord
        In log order (request completion order).
    """
    path = existing_workdir(workdir) / "logs" / "access.log"
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return list(_parse_lines(text, path))


def _parse_lines(text: str, path: Path) -> Iterator[AccessRecord]:
    parser = LineParser()  # imports apachelogs: start/stop/status (the CLI) need nothing beyond the standard library
    lines = text.split("\n")
    for lineno, line in enumerate(lines[:-1], 1):  # lines[-1] is "" or an unfinished line
        if not line:
            continue
        try:
            e = parser.parse(line)
        except ValueError:
            raise ApacheError(
                f"access log: {path}:{lineno} does not match LOG_FORMAT: {line[:200]!r}"
            ) from None
        method, _, rest = str(e["%r"]).partition(" ")
        target = rest.rsplit(" ", 1)[0]
        p, _, q = target.partition("?")
        cpu = e["%{stage_cpu_us}n"]
        yield AccessRecord(
            begin_us=int(e["%{begin:usec}t"]),
            method=method,
            path=p,
            query=q,
            status=int(e["%>s"]),
            bytes_sent=int(e["%b"] or 0),
            duration_us=int(e["%D"]),
            stage=e["%{stage}n"],
            cpu_us=int(cpu) if cpu is not None else None,
            tid=int(e["%{tid}P"]),
            request_id=e["%{X-Request-Id}i"],
            times=request_times(e),
        )
