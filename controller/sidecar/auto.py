"""``classifier.mode: auto``: run the policy solved for the information the traffic carries .

A policy is optimal only for what it was solved to see (``phase_info``, :mod:`overtake.mdp.observation`):

==========  ===================================================  =====================
solved for  what the sidecar must know of each request           classifier mode run
==========  ===================================================  =====================
``full``    its phase, from a trusted phase header                ``explicit``
``start``   the same (the model reveals it when a thread starts)  ``explicit``
``route``   its route's class, learned from the route's history   ``learned``
``none``    nothing: waiting and active counts per stage          ``hidden``
==========  ===================================================  =====================

:func:`choose` takes the candidates the operator solved (one file, or every ``.npz`` of a
directory), keeps those whose information is available now, and runs the one with the lowest
predicted E[W] — unless it is not predicted better than Apache's default π(∞) by ``margin``
(relative), in which case it runs passthrough and says why. :class:`Evidence` decides what is
available from the traffic itself: the phase header counts only when nearly every recent stage
request carried a valid one, route classes only once enough routes have a history.

With mod_overtake_prio's CPU priority in Apache (``--cpu-priority``) the exact predictions no
longer hold; a policy file solved with ``overtake solve --cpu-priority`` carries simulated ones
(:mod:`overtake.mdp.priority_prediction`): under ``age`` every candidate is weighed by its prediction with age
priority (one without is not usable) and passthrough by π(∞)'s with it; under ``class`` a
candidate that sees the phases is weighed by its prediction with short-first classes. Gains are
always against Apache's default without CPU priority.

A policy file solved for a model with a lock (scenario ``stages[].lock``, :mod:`overtake.mdp.lock`)
carries the lock model's predictions, whatever it sees (full, start, route, none): its own, Apache's
default (whose threads block at the lock) and, under ``age``, both with the locked stage exempt.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from overtake.controller.sidecar.policies import SpawnPolicy

__all__ = ["MODE_FOR", "Choice", "Evidence", "choose", "priority_wait"]

#: the classifier mode that supplies each information level
MODE_FOR = {"full": "explicit", "start": "explicit", "route": "learned", "none": "hidden"}


@dataclass(frozen=True)
class Choice:
    """What auto runs: a policy, the classifier mode that feeds it, and why."""

    policy: SpawnPolicy
    mode: str
    info: str  #: the information level of ``policy`` ("none" for passthrough)
    predicted_gain: float | None  #: over π(∞), relative; None when not predicted
    reason: str


def priority_wait(p: SpawnPolicy, cpu_priority: str) -> float | None:
    """``p``'s predicted E[W] under the CPU priority in force (module docstring); None when unknown. A
    policy solved for class priority is a candidate only under it."""
    solved = getattr(p, "solved_priority", "off")
    if solved != "off":
        return p.predicted_wait if cpu_priority == solved else None
    pred = (getattr(p, "priority_predictions", None) or {}).get(cpu_priority)
    if cpu_priority == "age":
        return float(pred["mean_response_time"]) if pred else None
    if cpu_priority == "class" and pred and p.phase_info == "full":
        return float(pred["mean_response_time"])
    return p.predicted_wait


def choose(candidates: Sequence[SpawnPolicy], available: Collection[str], passthrough: SpawnPolicy, *,
           margin: float = 0.02, cpu_priority: str = "off") -> Choice:
    """The candidate with the lowest predicted E[W] among those whose information is ``available``.

    Passthrough (π(∞), ``mode`` hidden) when no candidate is usable, or when the best one's
    predicted gain (E W(π(∞)) − E W) / E W(π(∞)) is below ``margin``; a candidate without
    both predictions (an old file, a baseline) is never chosen over passthrough. ``cpu_priority``:
    what mod_overtake_prio runs in Apache (off, age, class).
    """
    with_priority = "" if cpu_priority == "off" else f" with {cpu_priority} priority"
    # (policy, predicted E[W], Apache's default without CPU priority, label)
    options: list[tuple[SpawnPolicy, float, float, str]] = []
    for p in candidates:
        w = priority_wait(p, cpu_priority)
        if p.phase_info in available and w is not None and p.passthrough_wait is not None:
            options.append((p, w, p.passthrough_wait, f"{p.name} ({p.phase_info}){with_priority}"))
    if cpu_priority == "age":  # age priority alone, π(∞) with it, is a candidate of its own
        for p in candidates:
            pr = (getattr(p, "priority_predictions", None) or {}).get("age")
            if pr and pr.get("passthrough") is not None and p.passthrough_wait is not None:
                options.append((passthrough, float(pr["passthrough"]), p.passthrough_wait,
                                "passthrough with age priority in Apache"))
                break
    if not options:
        have = sorted({p.phase_info for p in candidates})
        why = (f"candidates are solved for {', '.join(have) or 'nothing'}" if cpu_priority == "off" else
               f"none carries a prediction with {cpu_priority} priority (overtake solve --cpu-priority {cpu_priority})")
        return Choice(passthrough, "hidden", "none", None,
                      f"no candidate policy for the information available ({', '.join(sorted(available))}); "
                      f"{why}: running passthrough")
    best, w, ps, label = min(options, key=lambda t: t[1])
    gain = (ps - w) / ps
    if gain < margin:
        return Choice(passthrough, "hidden", "none", gain,
                      f"best choice {label} predicts {100 * gain:.1f} % over Apache's default, below the "
                      f"{100 * margin:g} % margin: running passthrough")
    if best is passthrough:
        return Choice(passthrough, "hidden", "none", gain, f"{label} predicts {100 * gain:.1f} % over Apache's default")
    return Choice(best, MODE_FOR[best.phase_info], best.phase_info, gain,
                  f"{label} predicts {100 * gain:.1f} % over Apache's default")


@dataclass
class Evidence:
    """What the recent traffic shows: phase headers and route histories.

    ``window`` stage requests are remembered; the header counts as available when at least
    ``header_share`` of them carried a valid phase header, route classes when at least
    ``min_routes`` routes have ``min_samples`` observed demands each.
    """

    window: int = 500
    header_share: float = 0.99
    min_routes: int = 1
    min_samples: int = 8
    _headers: deque[bool] = field(default_factory=deque)
    _samples: dict[str, int] = field(default_factory=dict)

    def request(self, has_header: bool) -> None:
        self._headers.append(has_header)
        if len(self._headers) > self.window:
            self._headers.popleft()

    def demand(self, route_key: str) -> None:
        if route_key in self._samples or len(self._samples) < 4096:
            self._samples[route_key] = self._samples.get(route_key, 0) + 1

    def available(self) -> frozenset[str]:
        out = {"none"}
        if sum(1 for n in self._samples.values() if n >= self.min_samples) >= self.min_routes:
            out.add("route")
        h = self._headers
        if len(h) >= min(self.window, 50) and sum(h) >= self.header_share * len(h):
            out.update(("full", "start"))
        return frozenset(out)

