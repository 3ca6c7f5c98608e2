"""The online loop's serialisation verdicts: per stage, from the access log's time split.

:class:`LockWatch` keeps each stage's latest requests with mod_overtake_prio's time split
(``OvertakeRequestTimes``), re-runs :func:`overtake.controller.online.serialisation.detect` on them
at most once per ``CHECK_INTERVAL`` seconds, logs every change of a stage's verdict (one JSON line,
``event = online_serialisation``) and names the stages whose requests the sidecar then sends with
``X-Overtake-Exempt``: a serialised stage's request may hold the lock its peers wait for, and a
demoted lock holder makes them all wait at its priority. A stage whose ``cpu_exempt`` the stages
file sets (``cpu_exempt: []`` for never) keeps the file's word. A stage with ``lock: auto`` also
gets the verdict's lock capacity as its lock (:attr:`LockWatch.on_lock`: the sidecar's
:class:`~overtake.controller.sidecar.stage_lock.StageLock` and the refits' model), and loses it when
the stage is found not serialised.
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
        #: ``lock: auto`` stages: the capacity learned (None: not serialised), and the callback
        #: told of every change (stage, capacity)
        self.learned: dict[int, int | None] = {}
        self.on_lock: Callable[[int, int | None], None] | None = None

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
        self._update_locks()
        return True

    def _update_locks(self) -> None:
        """A ``lock: auto`` stage's lock follows its verdict: serialised with capacity m sets m, not
        serialised removes it, undecided keeps what was learned."""
        for i, name in enumerate(self.table.names):
            v = self.verdicts.get(name)
            if not self.table.lock_auto(i) or v is None or v.serialising is None:
                continue
            cap = v.lock_capacity if v.serialising else None
            if self.learned.get(i) == cap and i in self.learned:
                continue
            self.learned[i] = cap
            log.warning(f"stage {name}: lock {'learned: ' + str(cap) if cap is not None else 'removed'} (lock: auto)",
                        extra={"event": "online_lock_learned", "stage": name, "lock": {"capacity": cap, "source": "learned"}})
            if self.on_lock is not None:
                self.on_lock(i, cap)

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
        out = {n: v.as_dict() for n, v in self.verdicts.items()}
        for i, cap in self.learned.items():
            name = self.table.names[i]
            if name in out:
                out[name]["lock"] = {"capacity": cap, "source": "learned"}
        for i, name in enumerate(self.table.names):
            if self.table.lock(i) is not None and name in out:
                out[name]["lock"] = {"capacity": self.table.lock(i), "source": "configured"}
        return out
