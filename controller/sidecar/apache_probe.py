"""The sidecar's view of Apache: its mod_status scrape, its health and its worker limit.

:class:`ApacheProbe` reads Apache's ``/server-status?auto`` every ``status_interval`` seconds from
one task, never per ``/-/metrics`` request, so scrapes add no load on Apache. An Apache that
answers 401, 403, 404 or 410 there (no mod_status, or not for the sidecar's address) is said so
once in the log, and the ``apache_*`` series are left out; ``apache_up 0`` means Apache could not
be reached. With ``cpu_priority`` age or class, or the gate, the same task reads
mod_overtake_prio's ``/overtake-prio-status`` and passes its counters through; an Apache without
the module is said so once.

Every scrape is also the health check behind ``/-/healthz``: Apache is *down* when the last
scrape could not connect or got no HTTP answer within 2 s (answering without mod_status is up).

Apache's worker limit is the length of the ``Scoreboard`` line: mod_status prints one character
per slot of every server it may run (``MaxRequestWorkers`` after Apache's own rounding to
``ThreadsPerChild`` and capping by ``ServerLimit``), under prefork, worker and event alike, while
``BusyWorkers + IdleWorkers`` counts only the processes running now.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from overtake.controller.sidecar.metrics import ApacheCollector, PrioCollector
from overtake.controller.sidecar.mod_status import parse_status

__all__ = ["ApacheProbe", "Health", "max_request_workers", "workers_warning"]

log = logging.getLogger("overtake.sidecar")

_NO_STATUS = (401, 403, 404, 410)  # Apache answers, but not with mod_status for us
_TIMEOUT = 2.0  # s per scrape request
_MAX_BODY = 1 << 20  # mod_status ?auto and the module's counters are a few kB


@dataclass(frozen=True)
class Health:
    """Apache as the last scrape found it: ``up``, and since when (``time.time()``) and why not."""

    up: bool
    since: float
    reason: str = ""


def max_request_workers(status: dict[str, int | float | str]) -> int | None:
    """Apache's worker limit from a parsed ``?auto`` (the Scoreboard's length), None without one."""
    board = status.get("Scoreboard")
    return len(board) if isinstance(board, str) and board else None


def workers_warning(workers: int, max_inflight: int, gate_slots: int | None) -> str | None:
    """The start-up warning when Apache's ``workers`` cannot hold what the sidecar may send it
    (``max_inflight`` admitted, plus ``gate_slots`` held in Apache's gate), or None."""
    if workers < max_inflight:
        return (f"limits.max_inflight = {max_inflight} but Apache has {workers} workers (MaxRequestWorkers): "
                "excess admitted requests wait inside Apache; lower limits.max_inflight or raise MaxRequestWorkers")
    if gate_slots is not None and workers < max_inflight + gate_slots:
        # held requests occupy workers too: admitted ones could find none free
        return (f"limits.max_inflight {max_inflight} + gate_slots {gate_slots} > {workers} workers "
                f"(MaxRequestWorkers): lower gate_slots to {max(workers - max_inflight, 1)} or raise MaxRequestWorkers")
    return None


class ApacheProbe:
    """Scrapes one Apache into ``apache`` (and ``prio``), and keeps its :class:`Health`.

    Parameters
    ----------
    host, port
        Apache's address.
    apache, prio
        The metrics collectors filled from ``?auto`` and from mod_overtake_prio's counters.
    interval
        Seconds between scrapes (read at each one: a reload may change it).
    want_prio
        Whether to read ``/overtake-prio-status`` too, and why (named when it is absent).
    on_gate_token
        Called after every read of the module's counters with its ``overtake_gate_token`` (None:
        not reported) and the failure, if any.
    on_status
        Called after every scrape that read Apache's status (``apache.status`` is set).
    on_prio
        Called with the module's metric families after every read of its counters that answered.
    """

    def __init__(self, host: str, port: int, apache: ApacheCollector, prio: PrioCollector, *,
                 interval: Callable[[], float], want_prio: str | None = None,
                 on_gate_token: Callable[[int | None, str], None] | None = None,
                 on_status: Callable[[], None] | None = None,
                 on_prio: Callable[[list[Metric]], None] | None = None) -> None:
        self.host, self.port = host, port
        self.apache, self.prio = apache, prio
        self.interval = interval
        self.want_prio = want_prio
        self.on_gate_token = on_gate_token
        self.on_status = on_status
        self.on_prio = on_prio
        self.health = Health(True, time.time())
        self._state = "unknown"  # ok | absent | unreachable: the scrape's last outcome
        self._prio_ok: bool | None = None  # mod_overtake_prio's counters: last scrape answered
        self._task: asyncio.Task[None] | None = None

    @property
    def max_workers(self) -> int | None:
        """MaxRequestWorkers as the last scrape read it (None: no mod_status)."""
        st = self.apache.status
        return max_request_workers(st) if st is not None else None

    def start(self) -> None:
        """Scrape every ``interval()`` seconds from now on."""
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval())
            await self.scrape()

    async def _get(self, path: bytes) -> tuple[int, bytes]:
        """GET ``path`` from Apache (2 s, 1 MiB at most): (status, de-chunked body)."""
        async with asyncio.timeout(_TIMEOUT):
            r, w = await asyncio.open_connection(self.host, self.port)
            try:
                w.write(b"GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (path, self.host.encode()))
                raw = b""
                while len(raw) < _MAX_BODY:
                    chunk = await r.read(65536)
                    if not chunk:
                        break
                    raw += chunk
            finally:
                w.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        try:
            code = int(head.split(b" ", 2)[1])
        except (IndexError, ValueError):
            raise ValueError("not HTTP") from None
        if b"chunked" in head.lower():
            body = _dechunk(body)
        return code, body

    async def scrape(self) -> None:
        """Read ``/server-status?auto`` into the metrics and the health: the parsed status, or
        absent (Apache answers 401/403/404/410 or not with mod_status), or an error status, or
        unreachable (no connection or no HTTP answer: Apache is down)."""
        if self.want_prio is not None:
            await self.scrape_prio()
        apache = self.apache
        try:
            code, body = await self._get(b"/server-status?auto")
        except (OSError, TimeoutError, ValueError) as exc:
            apache.status, apache.absent = None, False
            apache.scrape_failures += 1
            self._set_health(False, _why(exc))
            self._log_state("unreachable", _why(exc))
            return
        self._set_health(True, "")
        if code in _NO_STATUS or (code == 200 and b"ServerMPM" not in body):
            apache.status, apache.absent = None, True
            self._log_state("absent", f"GET /server-status?auto answered HTTP {code}" + (
                " without mod_status fields" if code == 200 else ""))
        elif code != 200:
            apache.status, apache.absent = None, False
            apache.scrape_failures += 1
            self._log_state("error", f"GET /server-status?auto answered HTTP {code}")
        else:
            apache.status, apache.absent = parse_status(body.decode("latin-1")), False
            self._log_state("ok", "")
            if self.on_status is not None:
                self.on_status()

    async def scrape_prio(self) -> None:
        """mod_overtake_prio's counters into the metrics (left out while it does not answer)."""
        prio = self.prio
        try:
            code, body = await self._get(b"/overtake-prio-status")
            if code != 200 or b"overtake_cpu_prio_enabled" not in body:
                raise ValueError(f"HTTP {code}" + (" without the module's counters" if code == 200 else ""))
            prio.families = list(text_string_to_metric_families(body.decode("utf-8", errors="replace")))
            ok, detail = True, ""
        except (OSError, TimeoutError, ValueError) as exc:
            prio.families = []
            ok, detail = False, _why(exc)
        if self.on_gate_token is not None:
            token = next((int(s.value) for f in prio.families if f.name == "overtake_gate_token"
                          for s in f.samples), None)
            self.on_gate_token(token, "" if ok else f"GET /overtake-prio-status: {detail}")
        if ok and self.on_prio is not None:
            self.on_prio(prio.families)
        if ok != self._prio_ok:
            self._prio_ok = ok
            if not ok:
                log.warning("Apache's mod_overtake_prio does not answer: overtake_cpu_prio_* metrics left out", extra={
                    "event": "cpu_priority_absent", "detail": f"GET /overtake-prio-status: {detail}; "
                    f"{self.want_prio} needs mod_overtake_prio loaded in Apache (apache-conf/mod_overtake_prio/README.md)"})
            else:
                log.info("mod_overtake_prio counters scraped", extra={"event": "cpu_priority_ok"})

    def _set_health(self, up: bool, detail: str) -> None:
        """The health after a scrape: ``since`` moves only when ``up`` changes."""
        since = self.health.since if up == self.health.up else time.time()
        self.health = Health(up, since, "" if up else f"Apache at {self.host}:{self.port} unreachable: {detail}")

    def _log_state(self, state: str, detail: str) -> None:
        """Log a change of the scrape's outcome once (not at every scrape)."""
        if state == self._state:
            return
        first, self._state = self._state == "unknown", state
        if state == "absent":
            log.warning("Apache has no mod_status for the sidecar: apache_* metrics left out, its worker limit "
                        "not checked against limits.max_inflight", extra={
                "event": "apache_status_absent", "detail": f"{detail}; to get them, load mod_status and allow "
                "the sidecar's address to /server-status (apache-conf/examples/vhost-behind-sidecar.conf)"})
        elif state == "error":
            log.warning("Apache's mod_status answers with an error: apache_* metrics left out", extra={
                "event": "apache_status_error", "detail": detail})
        elif state == "unreachable" and not first:  # at start, the sidecar's start-up check says so
            log.warning("Apache not reachable for the status scrape", extra={
                "event": "apache_unreachable", "detail": detail})
        elif state == "ok" and not first:
            log.info("Apache status scrape ok", extra={"event": "apache_status_ok"})


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {_TIMEOUT:g} s"
    return f"{exc.__class__.__name__}: {exc}"


def _dechunk(body: bytes) -> bytes:
    out = []
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        n = int(size_line.split(b";")[0], 16)
        if n == 0:
            break
        out.append(rest[:n])
        body = rest[n + 2:]
    return b"".join(out)
