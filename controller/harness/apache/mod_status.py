"""mod_status: ``/server-status?auto`` fetched from the private Apache.

The parser is the product's (:mod:`overtake.controller.sidecar.mod_status`, re-exported here);
per-request timing comes from the access log (:mod:`.access_log`).
"""

from __future__ import annotations

import http.client

from overtake.controller.errors import ApacheNotRunningError
from overtake.controller.harness.apache.config import connect_host, parse_listen
from overtake.controller.sidecar.mod_status import SCOREBOARD_STATES, parse_status, scoreboard_counts

__all__ = ["SCOREBOARD_STATES", "fetch_status", "http_get", "parse_status", "scoreboard_counts"]


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
