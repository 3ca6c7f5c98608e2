"""Apache's mod_status ``/server-status?auto`` parsed, its scoreboard counted.

``?auto`` is aggregate only: per-request timing comes from the access log; rates come from
differencing ``Total Accesses`` and ``Total Duration``. The sidecar's probe
(:mod:`.apache_probe`) reads it for its metrics and health; the private Apache's launcher
(:mod:`overtake.controller.harness.apache`) fetches it with the same parser.
"""

from __future__ import annotations

import re

__all__ = ["SCOREBOARD_STATES", "parse_status", "scoreboard_counts"]

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
