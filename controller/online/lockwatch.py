"""The online loop's serialisation verdicts: per stage, from the access log's time split.

:class:`LockWatch` keeps each stage's latest requests with mod_overtake_prio's time split
(``OvertakeRequestTimes``), re-runs :func:`overtake.controller.online.serialisation.detect` on them
at most once per ``CHECK_INTERVAL`` seconds, logs every change of a stage's verdict (one JSON line,
``event = online_serialisation``) and names the stages whose requests the sidecar then sends with
``X-Overtake-Exempt``: a serialised stage's request may hold the lock its peers wait for, and a
demoted lock holder makes them all wait at its priority. A stage whose ``cpu_exempt`` the stages
file sets (``cpu_exempt: []`` for never) keeps the file's word.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from overtake.controller.online.serialisation import TimedRequest, Verdict, detect
from overtake.controller.sidecar.stages import StageTable

__all__ = ["CHECK_INTERVAL", "WINDOW", "LockWatch"]

log = logging.getLogger("overtake.sidecar")

#: seconds between two verdicts
CHECK_INTERVAL = 5.0
#: latest requests per stage a verdict looks at
WINDOW = 2000


class LockWatch:
    """Per-stage serialisation verdicts from the access log's time split."""

    def __init__(self, table: StageTable, *, clock: Callable[[], float], window: int = WINDOW,
                 check_interval: float = CHECK_INTERVAL) -> None:
        self.table = table
        self.clock = clock
        self.check_interval = check_interval
        self.records: list[deque[TimedRequest]] = [deque(maxlen=window) for _ in table.names]
        self.verdicts: dict[str, Verdict] = {}
        self._last: float | None = None
        self._new = 0
        #: called with the stages to exempt whenever that set changes
        self.on_exempt: Callable[[frozenset[int]], None] | None = None
        self.exempt: frozenset[int] = frozenset()

    def add(self, stage: int, rec: TimedRequest) -> None:
        self.records[stage].append(rec)
        self._new += 1

    def check(self, force: bool = False) -> bool:
        """Re-decide every stage if new records came and the interval has passed (or ``force``);
        whether it ran."""
        now = self.clock()
        if not force and (self._new == 0 or (self._last is not None and now - self._last < self.check_interval)):
            return False
        self._last, self._new = now, 0
        for i, name in enumerate(self.table.names):
            v = detect(list(self.records[i]))
            old = self.verdicts.get(name)
            self.verdicts[name] = v
            if old is None or old.serialising != v.serialising or old.lock_capacity != v.lock_capacity:
                self._say(name, v)
        self._update_exempt()
        return True

    def _say(self, name: str, v: Verdict) -> None:
        word = {True: "serialised", False: "not serialised", None: "undecided"}[v.serialising]
        level = logging.WARNING if v.serialising else logging.INFO
        log.log(level, f"stage {name}: {word} ({v.reason})",
                extra={"event": "online_serialisation", "stage": name, "verdict": v.as_dict()})

    def _update_exempt(self) -> None:
        stages = self.table.config.stages
        exempt = frozenset(i for i, name in enumerate(self.table.names)
                           if stages[i].cpu_exempt is None and self.verdicts.get(name) is not None
                           and self.verdicts[name].serialising)
        if exempt != self.exempt:
            self.exempt = exempt
            if self.on_exempt is not None:
                self.on_exempt(exempt)

    def status(self) -> dict[str, dict[str, object]]:
        """For ``GET /-/policy``: each stage's last verdict."""
        return {n: v.as_dict() for n, v in self.verdicts.items()}
