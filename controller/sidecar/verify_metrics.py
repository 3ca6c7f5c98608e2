"""``overtake_verification_*`` Prometheus metrics of the live verification (:mod:`.verify`), read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from overtake.controller.sidecar.verify import ARMS, STATES, Verifier

__all__ = ["VerifyCollector"]


@dataclass(eq=False)  # the registry keys collectors by identity
class VerifyCollector(Collector):
    """The verifier's state, arm, estimate, pairs and decisions."""

    verifier: Verifier

    def collect(self) -> Iterator[Metric]:
        v = self.verifier
        state = GaugeMetricFamily("overtake_verification_state", "1 for the verification's state: idle (the "
                                  "policy is Apache's default), verifying, kept, fell_back", labels=["state"])
        for s in STATES:
            state.add_metric([s], float(v.state == s))
        yield state
        arm = GaugeMetricFamily("overtake_verification_arm", "1 for what is in force: the policy or Apache's "
                                "default", labels=["arm"])
        for a in ARMS:
            arm.add_metric([a], float(v.arm == a))
        yield arm
        verdict = v.verdict
        if verdict is not None and verdict.gain is not None:
            yield GaugeMetricFamily("overtake_verification_gain_ratio", "Measured gain of the policy's mean response "
                                    "time over Apache's default (1 - policy / default) in the current verification",
                                    value=verdict.gain)
        if verdict is not None and verdict.ci is not None:
            ci = GaugeMetricFamily("overtake_verification_gain_ci_ratio", "Bounds of the gain's CI (confidence: "
                                   "the level's share per look)", labels=["bound"])
            ci.add_metric(["lower"], verdict.ci[0])
            ci.add_metric(["upper"], verdict.ci[1])
            yield ci
        pairs = CounterMetricFamily("overtake_verification_pairs", "Window pairs completed: used, or void (a "
                                    "window with too few requests)", labels=["outcome"])
        for k, n in v.pairs_total.items():
            pairs.add_metric([k], n)
        yield pairs
        decisions = CounterMetricFamily("overtake_verification_decisions", "Verification verdicts by state and "
                                        "reason (better, worse, max_pairs, no_gain, error)", labels=["state", "reason"])
        for (s, r), n in sorted(v.decisions_total.items()):
            decisions.add_metric([s, r], n)
        yield decisions
        if v.last_pair is not None:
            mean = GaugeMetricFamily("overtake_verification_window_mean_response_seconds", "Mean response time of "
                                     "the stage requests of the last completed pair's windows", labels=["arm"])
            mean.add_metric(["policy"], float(v.last_pair["policy_mean_seconds"]))
            mean.add_metric(["default"], float(v.last_pair["default_mean_seconds"]))
            yield mean
