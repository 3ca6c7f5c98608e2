"""mod_status: ``/server-status?auto`` fetched and parsed, scoreboard counted.

``?auto`` is aggregate only: per-request timing comes from the access log
(:mod:`.access_log`); rates come from differencing ``Total Accesses`` and ``Total Duration``.
"""

from __future__ import annotations

import http.client
import re

from overtake.controller.errors import ApacheNotRunningError
from overtake.controller.harness.apache.config import connect_host, parse_listen

__all__ = ["SCOREBOARD_STATES", "fetch_status", "http_get", "parse_status", "scoreboard_counts"]

#: mod_status scoreboard characters, named as apache_exporter's ``state`` label.
SCOREBOARD_STATES: dict[str, str] = {
    "_": "idle",
    "S": "startup",
    "R": "read",
    "W": "reply",
    "K": "keepalive",
    "D": "dns",
    "C": "closing",
    "L": "logging",
    "G": "graceful_stop",
    "I": "idle_cleanup",
    ".": "open_slot",
}


def http_get(host: str, port: int, path: str, timeout: float) -> tuple[int, dict[str, str], str]:
    """One GET: status, headers (lower-case names) and body text."""
    conn = http.client.HTTPConnection(connect_host(host), port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read().decode("utf-8", errors="replace")
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body
    finally:
        conn.close()


def parse_status(text: str) -> dict[str, int | float | str]:
    """Parse mod_status ``/server-status?auto`` output.

    Parameters
    ----------
    text : str
        Body of ``?auto``: a first line with the server name, then ``Key: value`` lines.

    Returns
    -------
    dict
        ``{"ServerName": ..., "Total Accesses": 319, "Load1": 7.48, "Scoreboard": "__W_", ...}``;
        values are int, float or str as they parse. ``Total Duration`` is the sum of
        per-request milliseconds; ``BusyWorkers`` the number of requests in Apache.
    """
    out: dict[str, int | float | str] = {}
    for i, line in enumerate(text.splitlines()):
        key, sep, value = line.partition(":")
        if not sep:
            if i == 0 and line.strip():
                out["ServerName"] = line.strip()
            continue
        value = value.strip()
        parsed: int | float | str
        if key == "Scoreboard":
            parsed = value  # "...." or "_" must not be read as numbers
        elif re.fullmatch(r"[+-]?\d+", value):
            parsed = int(value)
        elif re.fullmatch(r"[+-]?(\d+\.\d*|\.\d+)([eE][+-]?\d+)?|[+-]?\d+[eE][+-]?\d+", value):
            parsed = float(value)
        else:
            parsed = value
        out[key.strip()] = parsed
    return out


def scoreboard_counts(scoreboard: str) -> dict[str, int]:
    """Count scoreboard slots per state (apache_exporter's ``state`` names).

    Parameters
    ----------
    scoreboard : str
        The ``Scoreboard`` value of :func:`parse_status`.

    Returns
    -------
    dict of str to int
        Every state of :data:`SCOREBOARD_STATES`, zero included.
    """
    counts = dict.fromkeys(SCOREBOARD_STATES.values(), 0)
    for ch in scoreboard:
        if ch in SCOREBOARD_STATES:
            counts[SCOREBOARD_STATES[ch]] += 1
    return counts


def fetch_status(listen: str, *, timeout: float = 2.0) -> dict[str, int | float | str]:
    """GET ``/server-status?auto`` from an Apache at ``listen`` and parse it.

    Parameters
    ----------
    listen : str
        ``IP:PORT`` the Apache listens on.
    timeout : float
        Socket timeout in seconds.

    Returns
    -------
    dict
        See :func:`parse_status`.

    Raises
    ------
    ApacheNotRunningError
        If nothing answers or the answer is not mod_status.
    """
    host, port = parse_listen(listen)
    try:
        code, _, body = http_get(host, port, "/server-status?auto", timeout)
    except OSError as exc:
        raise ApacheNotRunningError(
            f"listen: no Apache answers at {listen} ({exc}); start it with "
            "`overtake apache start --workdir DIR --listen ...`"
        ) from None
    if code != 200 or "ServerMPM" not in body:
        raise ApacheNotRunningError(
            f"listen: {listen}/server-status?auto answered {code} without mod_status fields; "
            "is that an instance started by `overtake apache start`?"
        )
    return parse_status(body)
