"""Options of the online loop (``overtake sidecar --online ...``) and its metric label values."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from overtake.controller.errors import SidecarInputError

__all__ = ["OUTCOMES", "SOURCES", "OnlineSettings"]

#: values of the ``outcome`` label of ``overtake_online_refits_total``
OUTCOMES = ("swapped", "kept", "failed", "skipped_samples", "skipped_load", "skipped_rate_limited",
            "skipped_busy", "skipped_superseded", "skipped_route")
#: where a service-demand sample comes from (the ``source`` label)
SOURCES = ("access_log", "attained")


@dataclass(frozen=True)
class OnlineSettings:
    """Options of the online loop (``overtake sidecar --online ...``). Times in seconds."""

    refit_interval: float = 60.0  #: at most one refit per interval
    min_samples: int = 200  #: per stage, before a refit is tried
    arrival_window: float = 60.0  #: λ is estimated over this window
    reservoir: int = 2000  #: latest demand samples kept per (stage, source)
    margin: float = 0.01  #: swap only if E[W] improves by more than this fraction
    max_load: float = 0.95  #: skip refits at or above this estimated load
    max_order: int = 2  #: PH order chosen by BIC in 1..max_order (when not pinned)
    tolerance: float = 1e-2  #: the solve's relative accuracy of E[W] (overtake.mdp.solve)
    access_log: str | None = None  #: Apache access log (LOG_FORMAT) to take CPU demands from
    log_poll: float = 1.0  #: seconds between reads of the access log
    #: each access-log record is also an arrival to its stage (module mode: no request passes the
    #: sidecar's limiter, whose events are the arrivals otherwise)
    arrivals_from_log: bool = False
    policy_dir: str | None = None  #: where new policies are written (default: a temporary dir)

    def __post_init__(self) -> None:
        checks = (
            (
                "refit-interval",
                self.refit_interval > 0 and math.isfinite(self.refit_interval),
                "a number of seconds > 0, e.g. 60",
            ),
            ("min-samples", self.min_samples >= 2, "an integer >= 2, e.g. 200"),
            (
                "arrival-window",
                self.arrival_window > 0 and math.isfinite(self.arrival_window),
                "a number of seconds > 0, e.g. 60",
            ),
            ("reservoir", self.reservoir >= self.min_samples, f"an integer >= --min-samples ({self.min_samples})"),
            ("swap-margin", 0 <= self.margin < 1, "a fraction in [0, 1), e.g. 0.01"),
            ("max-load", 0 < self.max_load < 1, "a load in (0, 1), e.g. 0.95"),
            (
                "max-order",
                1 <= self.max_order <= 4,
                "an integer 1..4 (larger orders make the MDP too big to re-solve online)",
            ),
            ("refit-tolerance", 0 < self.tolerance < 0.5, "a fraction in (0, 0.5), e.g. 0.01"),
            ("log-poll", self.log_poll > 0, "a number of seconds > 0"),
        )
        for name, ok, fix in checks:
            if not ok:
                raise SidecarInputError(f"--{name}: must be {fix}")
        if self.access_log is not None and not Path(self.access_log).parent.is_dir():
            raise SidecarInputError(
                f"--access-log: directory of {self.access_log!r} does not exist; give WORKDIR/logs/access.log "
                "of `overtake apache start --workdir WORKDIR`"
            )
