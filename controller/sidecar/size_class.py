"""A CPU class from the predicted size: ``--cpu-priority class`` without phase information.

Where the policy in force knows no phases (``phase_info: none``, a baseline), the class header
can still carry what the sidecar knows about a request: its predicted holding time, the mean of
the last holding times (admission to the whole answer) of the requests learned under the same
key (a stage's route ``key``: body size, query, or ``link``, the transaction's previous request,
so a wiki's view is predicted from its preview's body size). A request whose prediction exceeds
its stage's threshold starts at mod_overtake_prio's low level (``X-Overtake-Class: 1``); the
others at level 0, so short requests overtake the long ones on the CPU. Knowing sizes, serving
the small first is what processor sharing cannot do with heavy-tailed work (Harchol-Balter et
al., "Size-based scheduling to improve web performance"); with a prediction that errs, demoting
only the largest few keeps the cost of a misjudged request small.

The threshold is the stage's ``class_threshold`` (seconds) when given, else the
``class_quantile`` of the predictions of its recent requests (those whose key was known), so
that about ``1 − class_quantile`` of them are demoted whatever the time scale; none is demoted
before :data:`MIN_PREDICTIONS` predictions are in.

Never demoted: a stage with a ``lock`` or whose ``cpu_exempt`` covers the request's method (a
demoted lock holder makes every waiter wait at its priority), a stage the online loop found
serialised, and a stage without a learned key (every request would get the same prediction).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from overtake.controller.sidecar.listener import LimiterListener
from overtake.controller.sidecar.stages import StageTable
from overtake.controller.sidecar.tandem import Ticket

__all__ = ["MIN_PREDICTIONS", "SizeClass"]

#: predictions a stage needs before its quantile threshold is trusted
MIN_PREDICTIONS = 50
_KEYS_MAX = 4096  # keys whose holding times are remembered per stage (LRU)
_PREDICTIONS = 512  # recent predictions the quantile is taken over
_REFRESH = 32  # predictions between recomputations of the quantile


@dataclass
class _Key:
    samples: deque[float]
    total: float = 0.0


@dataclass
class _Stage:
    """One eligible stage's learned keys, recent predictions and threshold."""

    fixed: float | None
    quantile: float
    keys: OrderedDict[str, _Key] = field(default_factory=OrderedDict)
    predictions: deque[float] = field(default_factory=lambda: deque(maxlen=_PREDICTIONS))
    threshold: float | None = None
    since: int = 0  # predictions since the quantile was last computed
    low: int = 0
    sent: int = 0


class SizeClass(LimiterListener):
    """Learns holding times per key (as a limiter listener) and decides each request's level."""

    def __init__(self, names: tuple[str, ...], eligible: tuple[bool, ...],
                 thresholds: tuple[tuple[float | None, float], ...], history: int = 64) -> None:
        self.names = names
        self.history = history
        self._stages: dict[int, _Stage] = {
            i: _Stage(fixed, q) for i, (ok, (fixed, q)) in enumerate(zip(eligible, thresholds, strict=True)) if ok}
        for st in self._stages.values():
            st.threshold = st.fixed

    @staticmethod
    def from_table(table: StageTable) -> SizeClass:
        """The stages of ``table`` with a learned key and no lock (module docstring)."""
        n = len(table.names)
        eligible = tuple(table.keyed(i) and table.lock(i) is None for i in range(n))
        return SizeClass(table.names, eligible, tuple(table.class_threshold(i) for i in range(n)),
                         table.config.classifier.history)

    def eligible(self, stage: int) -> bool:
        return stage in self._stages

    # ---- learning ----------------------------------------------------------------------------
    def learn(self, stage: int, key: str, seconds: float) -> None:
        """One completed request of ``key`` held its thread for ``seconds``."""
        st = self._stages.get(stage)
        if st is None:
            return
        k = st.keys.get(key)
        if k is None:
            k = st.keys[key] = _Key(deque())
            if len(st.keys) > _KEYS_MAX:
                st.keys.popitem(last=False)
        else:
            st.keys.move_to_end(key)
        k.samples.append(seconds)
        k.total += seconds
        if len(k.samples) > self.history:
            k.total -= k.samples.popleft()

    def on_release(self, ticket: Ticket, now: float, outcome: str) -> None:
        if outcome == "completed":
            self.learn(ticket.stage, ticket.route, now - ticket.t_admit)

    def predict(self, stage: int, key: str) -> float | None:
        """Predicted holding time (s) of a request of ``key``: its key's mean, None when unseen."""
        st = self._stages.get(stage)
        k = None if st is None else st.keys.get(key)
        return None if k is None or not k.samples else k.total / len(k.samples)

    # ---- the decision ------------------------------------------------------------------------
    def level(self, stage: int, key: str) -> int | None:
        """The starting level of a request of ``stage`` learned under ``key``: 1 when its
        prediction exceeds the stage's threshold, 0 otherwise, None for a stage this never
        decides (the caller sends no class). The caller has already ruled out exempt requests."""
        st = self._stages.get(stage)
        if st is None:
            return None
        st.sent += 1
        pred = self.predict(stage, key)
        if pred is None:
            return 0
        if st.fixed is None:
            st.predictions.append(pred)
            st.since += 1
            if len(st.predictions) >= MIN_PREDICTIONS and (st.threshold is None or st.since >= _REFRESH):
                st.threshold = float(np.quantile(np.fromiter(st.predictions, float), st.quantile))
                st.since = 0
        if st.threshold is None or pred <= st.threshold:
            return 0
        st.low += 1
        return 1

    def info(self) -> dict[str, Any]:
        """Per eligible stage, for ``GET /-/policy``: the threshold in force and how it was chosen,
        the requests decided and the share sent low."""
        out: dict[str, Any] = {}
        for i, st in self._stages.items():
            source = ("class_threshold" if st.fixed is not None
                      else f"quantile {st.quantile:g} of {len(st.predictions)} recent predictions"
                      if st.threshold is not None
                      else f"learning ({len(st.predictions)} of {MIN_PREDICTIONS} predictions)")
            out[self.names[i]] = {"threshold_seconds": st.threshold, "source": source, "decided": st.sent,
                                  "low": st.low, "keys_learned": len(st.keys)}
        return out
