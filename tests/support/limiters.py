"""A limiter for the no-network tests (the limiter's own, the stage lock's), and the step of their
random programs that picks the ticket a cancel or a release acts on."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

from overtake.controller.sidecar.classifier import Classifier
from overtake.controller.sidecar.limiter import ADMITTED, QUEUED, Limiter, Ticket
from overtake.controller.sidecar.stages import ClassifierSettings

Mode = Literal["explicit", "learned", "hidden", "auto"]


def make_limiter(policy: Any, names: tuple[str, ...], *, max_inflight: int = 1000, queue_cap: int = 1000,
                 pt_cap: int | None = None, mode: Mode = "explicit",
                 clock: Callable[[], float] = time.monotonic) -> Limiter:
    """A limiter over ``names`` with one queue cap for every stage and the passthrough lane."""
    return Limiter(
        policy, Classifier(ClassifierSettings(mode=mode), policy), stage_names=names,
        queue_caps=(queue_cap,) * len(names), max_inflight=max_inflight, passthrough_cap=pt_cap,
        passthrough_queue_cap=queue_cap, clock=clock,
    )


def picked(tickets: list[Ticket], op: str, pick: int) -> Ticket | None:
    """The ticket a program's ``cancel`` (a queued one) or release (an admitted one) acts on:
    the ``pick``-th, cyclically, of those in that status; None when there is none."""
    pool = [t for t in tickets if t.status == (QUEUED if op == "cancel" else ADMITTED)]
    return pool[pick % len(pool)] if pool else None
